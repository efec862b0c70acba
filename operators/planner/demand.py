"""Demand and pool measurements from the routers' counters (pure).

Every router replica counts, per pool role, the prompts it had computed
(tokens, cached tokens), the generations finished (output tokens), and the
seconds requests spent in the pool (``tandem_router_pool_*``). The scrapes of
every replica over the last few intervals give a window (as Prometheus'
``increase()`` over a range: a rate between two consecutive scrapes moves with
every scrape's jitter); summed over replicas:

* demand: finished generations / s, mean prompt and output tokens, the
  fleet's prefix hit rate (cached / prompt tokens);
* per pool and ready replica: the request and token rates and the mean
  requests in flight (busy seconds / window seconds), the load the profile is
  compared at (``efficiency.py``).

A replica whose counters went down restarted: its window counts from zero.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise

from .efficiency import PoolMeasurement
from .profiles import PoolRole
from .solver import Demand

# Router role labels → pool roles ("both" is an aggregated pod).
POOL_OF_LABEL: Mapping[str, PoolRole] = {
    "prefill": "prefill",
    "decode": "decode",
    "both": "aggregated",
}


@dataclass(frozen=True)
class PoolCounters:
    prompts: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generations: float = 0.0
    output_tokens: float = 0.0
    busy_seconds: float = 0.0

    def minus(self, earlier: PoolCounters) -> PoolCounters:
        """The increase since ``earlier``; all of it after a restart."""
        restarted = any(getattr(self, c) < getattr(earlier, c) for c in COUNTERS)
        if restarted:
            return self
        return PoolCounters(*(getattr(self, c) - getattr(earlier, c) for c in COUNTERS))

    def plus(self, other: PoolCounters) -> PoolCounters:
        return PoolCounters(*(getattr(self, c) + getattr(other, c) for c in COUNTERS))


# The router's tandem_router_pool_<name>_total counters, one per field.
COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(PoolCounters))


@dataclass(frozen=True)
class RouterSample:
    """One scrape of one router replica."""

    at: float
    pools: Mapping[PoolRole, PoolCounters] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """What every replica counted over a span of scrapes, summed."""

    seconds: float
    pools: Mapping[PoolRole, PoolCounters]


# A scrape round: each replica's latest sample (replica → sample).
Round = Mapping[str, RouterSample]


def window(rounds: Sequence[Round]) -> Window | None:
    """The counts from the first round to the last: the increases between
    consecutive rounds summed, so a replica that restarts mid-span loses only
    what it counted in that one interval; a replica absent from a round counts
    from zero in the next. Seconds: the longest span of a replica present in
    the first round and the last. None when no time passed."""
    totals: dict[PoolRole, PoolCounters] = {}
    for before, after in pairwise(rounds):
        for replica, now in after.items():
            then = before.get(replica)
            for role, counters in now.pools.items():
                earlier = then.pools.get(role, PoolCounters()) if then else PoolCounters()
                totals[role] = totals.get(role, PoolCounters()).plus(counters.minus(earlier))
    first, last = (rounds[0], rounds[-1]) if rounds else ({}, {})
    seconds = max((s.at - first[r].at for r, s in last.items() if r in first), default=0.0)
    if seconds <= 0:
        return None
    return Window(seconds, totals)


# Scrape intervals a window spans: Prometheus' rule of thumb for rate() (a
# range of at least four scrape intervals); the live loop's default tick of
# 15 s makes it a minute.
RATE_INTERVALS = 4


@dataclass(frozen=True)
class ScrapeHistory:
    """The last ``intervals`` + 1 scrape rounds; a window once it spans them all."""

    intervals: int = RATE_INTERVALS
    rounds: tuple[Round, ...] = ()

    def add(self, samples: Round, replicas: Collection[str]) -> ScrapeHistory:
        """This round's samples; a replica that did not answer keeps its last
        sample, one no longer among ``replicas`` is forgotten (a new pod at the
        same address starts from zero anyway)."""
        latest = {**(self.rounds[-1] if self.rounds else {}), **samples}
        kept = {r: s for r, s in latest.items() if r in replicas}
        return replace(self, rounds=(*self.rounds, kept)[-(self.intervals + 1) :])

    def window(self) -> Window | None:
        """None until the rounds span ``intervals`` scrape intervals."""
        return window(self.rounds) if len(self.rounds) > self.intervals else None


def demand_of(w: Window) -> Demand | None:
    """None when nothing finished in the window (no shape to size for)."""
    pools = w.pools.values()
    generations = sum(p.generations for p in pools)
    prompts = sum(p.prompts for p in pools)
    prompt_tokens = sum(p.prompt_tokens for p in pools)
    if generations <= 0 or prompts <= 0 or prompt_tokens <= 0:
        return None
    return Demand(
        request_rate=generations / w.seconds,
        mean_input_tokens=prompt_tokens / prompts,
        mean_output_tokens=sum(p.output_tokens for p in pools) / generations,
        hit_rate=sum(p.cached_tokens for p in pools) / prompt_tokens,
    )


def measurements_of(w: Window, ready: Mapping[PoolRole, int]) -> tuple[PoolMeasurement, ...]:
    """Per ready replica of each pool; pools with no ready replica are left out."""
    out = []
    for role, c in w.pools.items():
        n = ready.get(role, 0)
        if n <= 0:
            continue
        per_s = 1.0 / (w.seconds * n)
        finished = c.prompts if role == "prefill" else c.generations
        out.append(
            PoolMeasurement(
                role=role,
                requests=int(finished),
                in_flight=c.busy_seconds * per_s,
                request_rate=finished * per_s,
                uncached_tokens_per_s=(c.prompt_tokens - c.cached_tokens) * per_s,
                output_tokens_per_s=c.output_tokens * per_s,
            )
        )
    return tuple(out)
