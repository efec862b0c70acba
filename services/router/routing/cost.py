"""The cost model: what placing a request on a pod costs. Pure math, no I/O.

Costs are in *token-equivalents*, so cache hits and queues compare directly;
``prefill_tokens_per_s`` turns them into a predicted TTFT:

    cost(pod) = uncached prompt tokens on pod
              + pending prefill tokens already routed to pod (all replicas)
              + request_cost_tokens x max(router in-flight, engine running + waiting)
              + kv_pressure_tokens x how far KV usage is above the high watermark
                x the share of the request's KV the pod lacks
              + eviction_cost_factor x live sessions' cached tokens the
                uncached part would evict (KV capacity less what live
                sessions hold there: ``live.py``)

For a P/D decode pod the first and last terms are weighted by
``transfer_weight``: what it lacks, and what an evicted session will lack,
arrives over NIXL rather than being computed (``placement_cost``). With a
shared KV store, the part of the uncached tokens another pod holds is
weighted by ``store_load_weight``: the store has every block an engine
computed, so the pod loads that part rather than computing it.

The eviction term is what makes stickiness right when KV is smaller than the
working set: a session moved, or a fork placed, on a pod whose KV is full of
other live sessions recomputes its context there *and* costs those sessions
theirs. With ample KV it is zero and load decides as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.roles import Role

if TYPE_CHECKING:
    from services.router.routing.policy import PolicySettings


@dataclass(frozen=True)
class PodView:
    name: str
    role: Role = Role.BOTH
    available: bool = True  # healthy, not draining, circuit closed
    in_flight: int = 0  # requests routed there and not finished (all replicas)
    pending_prefill_tokens: int = 0  # uncached tokens routed there, prefill not done
    running: int = 0  # engine-reported
    waiting: int = 0
    kv_cache_usage: float = 0.0
    cached_tokens: int = 0  # predicted prefix hit for this request
    # KV tokens the pod can fill for this request without evicting blocks live
    # sessions need; None: unknown (capacity not reported), nothing priced.
    kv_free_tokens: int | None = None
    pool: str = ""  # the pod's pool (classes.py); "" when none is named


def load_tokens(pod: PodView, s: PolicySettings, new_kv_share: float = 1.0) -> float:
    """Work queued on the pod ahead of a new request, in token-equivalents.

    KV pressure counts in proportion to ``new_kv_share``, the part of the
    request's KV the pod would have to allocate (its uncached share): a pod
    whose KV is full waits for running requests to free blocks only for the
    blocks it lacks. A session turn that finds nearly all of its prefix cached
    is not pushed off its pod because KV is busy; moving it would recompute
    the whole context elsewhere and evict other sessions there (the trap of
    KV-smaller-than-working-set measured in bench/router_policies.py).
    """
    queued = max(pod.in_flight, pod.running + pod.waiting)
    cost = pod.pending_prefill_tokens + s.request_cost_tokens * queued
    if pod.kv_cache_usage > s.kv_high_watermark:
        over = (pod.kv_cache_usage - s.kv_high_watermark) / max(1e-9, 1 - s.kv_high_watermark)
        cost += s.kv_pressure_tokens * min(1.0, over) * new_kv_share
    return cost


def uncached_tokens(pod: PodView, num_tokens: int) -> int:
    return max(0, num_tokens - pod.cached_tokens)


def uncached_share(pod: PodView, num_tokens: int) -> float:
    return uncached_tokens(pod, num_tokens) / num_tokens if num_tokens > 0 else 1.0


def evicted_tokens(pod: PodView, num_tokens: int) -> int:
    """Live sessions' cached tokens the request's uncached KV would push out."""
    if pod.kv_free_tokens is None:
        return 0
    return max(0, uncached_tokens(pod, num_tokens) - pod.kv_free_tokens)


def prefill_cost(pod: PodView, num_tokens: int, s: PolicySettings) -> float:
    """The work ahead of the request's first token on ``pod`` (predicted TTFT)."""
    return uncached_tokens(pod, num_tokens) + load_tokens(pod, s, uncached_share(pod, num_tokens))


def stored_tokens(pod: PodView, held_tokens: int, s: PolicySettings) -> int:
    """The request's tokens ``pod`` lacks that a shared KV store holds: the
    prefix another pod holds (``held_tokens``, the most any pod holds), which
    an engine computed and so put in the store; 0 without a store
    (``store_load_weight`` 1)."""
    if s.store_load_weight >= 1.0:
        return 0
    return max(0, held_tokens - pod.cached_tokens)


def placement_cost(
    pod: PodView,
    num_tokens: int,
    s: PolicySettings,
    weight: float = 1.0,
    held_tokens: int = 0,
) -> float:
    """What choosing ``pod`` costs: its uncached tokens, its load, and the
    later rebuilding of the live KV it evicts. ``weight`` prices a token of KV
    the pod must fill, its own or an evicted session's, alike: 1 where it is
    computed there, ``transfer_weight`` on a P/D decode pod, where either
    arrives over NIXL from the prefill pool (an evicted session's next turn
    pulls it again). Priced as a recompute there, a decode pod whose KV holds
    sessions that went idle would cost more than any queue on the others.
    The uncached tokens the store holds (``stored_tokens``, of the
    ``held_tokens`` another pod holds) cost ``store_load_weight`` each when
    that is less: they are loaded, not computed."""
    uncached = uncached_tokens(pod, num_tokens)
    stored = min(uncached, stored_tokens(pod, held_tokens, s))
    return (
        weight * (uncached - stored)
        + min(weight, s.store_load_weight) * stored
        + load_tokens(pod, s, uncached_share(pod, num_tokens))
        + weight * s.eviction_cost_factor * evicted_tokens(pod, num_tokens)
    )


def ttft_s(cost: float, s: PolicySettings) -> float:
    return cost / s.prefill_tokens_per_s
