"""Metrics sources for the live loop: the routers' own ``/metrics`` scraped
directly (the default: works without a Prometheus), or a Prometheus server's
HTTP API. Both yield a ``demand.Window`` over a span of scrapes (a rate
between two consecutive scrapes moves with every scrape's timing); the
arithmetic is in ``demand.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .demand import (
    COUNTERS,
    POOL_OF_LABEL,
    RATE_INTERVALS,
    PoolCounters,
    RouterSample,
    ScrapeHistory,
    Window,
)
from .profiles import PoolRole

log = logging.getLogger(__name__)

# Router counter name (without _total) → PoolCounters field.
_METRICS: Mapping[str, str] = {f"tandem_router_pool_{c}": c for c in COUNTERS}


class MetricsSource(Protocol):
    async def window(self, now: float) -> Window | None:
        """Counts over the source's window, ending about ``now``."""
        ...

    async def aclose(self) -> None: ...


def parse_router_metrics(text: str, at: float) -> RouterSample:
    """The pool counters of one router's exposition text."""
    values: dict[PoolRole, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field_name = _METRICS.get(family.name)
        if field_name is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            role = POOL_OF_LABEL.get(sample.labels.get("role", ""))
            if role is not None:
                values.setdefault(role, {})[field_name] = sample.value
    return RouterSample(at, {role: PoolCounters(**v) for role, v in values.items()})


class RouterScrapeSource:
    """Scrapes every router replica's ``/metrics`` at once; each call returns
    the window over the last ``intervals`` calls (none until there are that
    many). Each sample is stamped with ``clock()`` when its answer arrived, not
    with the tick's ``now``: under load a tick can reach the scrape a varying
    while after it starts. ``urls`` is read on every call (router pods come and
    go). A replica that does not answer within ``timeout_s`` is left out of
    this round (the others are not kept waiting) and counts from its last
    sample when it is back."""

    def __init__(
        self,
        urls: Sequence[str] | None = None,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
        intervals: int = RATE_INTERVALS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.urls = list(urls or [])
        self.timeout_s = timeout_s
        self.clock = clock
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._history = ScrapeHistory(intervals)
        # The replicas the last round could not read, with why.
        self.failures: dict[str, str] = {}

    async def sample(self, url: str) -> RouterSample:
        r = await self._client.get(url.rstrip("/") + "/metrics")
        r.raise_for_status()
        return parse_router_metrics(r.text, self.clock())

    async def _sample_or_why(self, url: str) -> RouterSample | str:
        try:
            return await asyncio.wait_for(self.sample(url), self.timeout_s)
        except TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except (httpx.HTTPError, ValueError) as exc:
            return str(exc) or type(exc).__name__

    async def window(self, now: float) -> Window | None:
        urls = list(self.urls)
        results = await asyncio.gather(*(self._sample_or_why(u) for u in urls))
        samples: dict[str, RouterSample] = {}
        self.failures = {}
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, str):
                log.warning("router metrics at %s unreadable: %s", url, result)
                self.failures[url] = result
            else:
                samples[url] = result
        self._history = self._history.add(samples, self.urls)
        return self._history.window()

    async def aclose(self) -> None:
        await self._client.aclose()


class PrometheusSource:
    """Reads the same counters from a Prometheus server: ``increase()`` of each
    over ``window_s``, summed by role over the series ``selector`` matches
    (e.g. ``namespace="serving",job="tandem-router"``)."""

    def __init__(
        self,
        url: str,
        selector: str = "",
        window_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.selector = selector
        self.window_s = window_s
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    def query(self, counter: str) -> str:
        return (
            f"sum by (role) (increase(tandem_router_pool_{counter}_total"
            f"{{{self.selector}}}[{self.window_s:g}s]))"
        )

    async def window(self, now: float) -> Window | None:
        values: dict[PoolRole, dict[str, float]] = {}
        for counter in COUNTERS:
            r = await self._client.get(
                f"{self.url}/api/v1/query", params={"query": self.query(counter), "time": now}
            )
            r.raise_for_status()
            body = r.json()
            if body.get("status") != "success":
                raise ValueError(f"Prometheus query failed: {body.get('error', body)}")
            for series in body["data"]["result"]:
                role = POOL_OF_LABEL.get(series["metric"].get("role", ""))
                if role is not None:
                    values.setdefault(role, {})[counter] = float(series["value"][1])
        if not values:
            return None
        return Window(self.window_s, {role: PoolCounters(**v) for role, v in values.items()})

    async def aclose(self) -> None:
        await self._client.aclose()
