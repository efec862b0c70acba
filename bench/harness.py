"""What every benchmark shares: where results go, progress lines, the model
an endpoint serves, and Ctrl-C/SIGTERM handling."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries reports)."""
    print(msg, file=sys.stderr, flush=True)


def urls(url: str) -> list[str]:
    """The base URLs in a comma-separated list (router replicas)."""
    found = [u.strip() for u in url.split(",") if u.strip()]
    if not found:
        raise ValueError(f"no URL in {url!r}")
    return found


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model `GET /v1/models` lists at `url` (the first of several
    replicas: they serve the same model)."""
    import httpx

    url = urls(url)[0]
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"cannot list models at {url}/v1/models ({e}); is the "
                           f"server up? pass --model to skip the lookup") from None
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so a benchmark
    stopped either way cleans up (stops what it started) the same way."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
