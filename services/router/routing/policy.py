"""Choosing pods: pure math, no I/O, the current time passed in.

Input: one ``PodView`` per pod (health, load, and how many of this request's
tokens the prefix index predicts it has cached), the request's size and
session binding. Output: a ``Choice`` with the decode pod (or the one
aggregated pod), an optional prefill pod, and a reason for metrics and logs.

Cost model (the default policy, ``cost``), in *token-equivalents* so cache
hits and queues compare directly; ``prefill_tokens_per_s`` turns it into a
predicted TTFT:

    cost(pod) = uncached prompt tokens on pod
              + pending prefill tokens already routed to pod (all replicas)
              + request_cost_tokens x max(router in-flight, engine running + waiting)
              + kv_pressure_tokens x how far KV usage is above the high watermark
                x the share of the request's KV the pod lacks
              + eviction_cost_factor x live sessions' cached tokens the
                uncached part would evict (KV capacity less what live
                sessions hold there: ``live.py``)

The eviction term is what makes stickiness right when KV is smaller than the
working set: a session moved, or a fork placed, on a pod whose KV is full of
other live sessions recomputes its context there *and* costs those sessions
theirs. With ample KV it is zero and load decides as before.

Stickiness: a session's bound pod keeps it unless its cost exceeds the best
other pod's cost plus the cost of moving the session, ``stickiness_margin_tokens``
plus ``move_cost_factor`` x the session prefix the bound pod holds and the
other does not (KV that would be rebuilt and duplicated). A bound pod that
lost the session's blocks (evicted under KV pressure) has little to lose, so
the session moves where load is lower: affinity never outweighs capacity.

New sessions with nothing cached anywhere go to their consistent-hash home
with bounded loads (the cheapest pod instead when the request would evict live
KV somewhere); a fork of a cached context goes where its prefix is, held
there by the same move cost as a bound session.

P/D (XpYd): the decode pod is chosen first (stickiness, load, KV pressure, the
prefix it already holds weighted by ``transfer_weight`` since it arrives over
NIXL rather than being computed); then, unless the part the decode pod lacks
is below ``remote_prefill_threshold`` tokens (the decode pod prefills it
locally; with ``remote_prefill_scope`` "pod" the uncached tokens it is already
prefilling count too, so a burst of sub-agent forks routed within
milliseconds does not pile into one long decode step), the prefill pod with
the lowest prefill cost among those of the request's class (``classes.py``: a
long fresh prefill or an append turn, each to its own pool when
``prefill_pool_for`` names one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from common.roles import Role
from common.settings import SettingError, flag_of, setting
from services.router.routing.classes import (
    ClassPool,
    classify,
    parse_class_pool,
    pods_for_class,
)
from services.router.routing.hashring import bounded_load_choice

POLICIES = ("cost", "round-robin", "least-load", "prefix", "session")
REMOTE_PREFILL_SCOPES = ("request", "pod")


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


@dataclass(frozen=True)
class Binding:
    """Where a session's previous turn went."""
    pod: str  # decode pod (or aggregated pod)
    prefill_pod: str | None = None


@dataclass(frozen=True)
class RouteInput:
    num_tokens: int
    pods: Sequence[PodView]
    session: str | None = None
    binding: Binding | None = None
    now: float = 0.0


@dataclass(frozen=True)
class Choice:
    pod: str  # decode pod, or the aggregated pod
    prefill_pod: str | None
    reason: str
    predicted_cached_tokens: int  # on the pod that computes the prompt
    predicted_ttft_s: float
    costs: dict[str, float] = field(default_factory=dict)
    # Why a decode pod computes the prompt itself: no_prefill_pods (none
    # configured), prefill_unavailable (none can serve), class_pool_unavailable
    # (none of the request class's pool can) or short_uncached (it lacks too
    # little to be worth a transfer); None when a prefill pod does,
    # or the pod is aggregated.
    local_prefill: str | None = None
    request_class: str = "append"  # classes.REQUEST_CLASSES


@dataclass(frozen=True)
class PolicySettings:
    policy: str = setting("cost", "how pods are chosen: cost (prefix hits vs load, sticky "
                          "sessions), round-robin, least-load, prefix (most cached), session "
                          "(always sticky)", flag="--routing-policy", aliases=("--policy",),
                          choices=POLICIES)
    prefill_tokens_per_s: float = setting(2_000.0, "a pod's prefill speed, to turn costs "
                                          "into predicted TTFT")
    request_cost_tokens: float = 64.0
    kv_high_watermark: float = 0.9
    kv_pressure_tokens: float = setting(4_096.0, "cost policy: the load, in prompt tokens, "
                                        "of a pod whose KV usage is full (scaled from the 90% "
                                        "watermark, and by the share of the request the pod "
                                        "must allocate)")
    stickiness_margin_tokens: float = 256.0
    # Per token of prefix the other pod lacks (see _move_cost); the value is
    # measured (routing/README.md, "Measured").
    move_cost_factor: float = setting(0.5, "cost policy: how strongly a session (or a "
                                      "sub-agent fork) stays with the pod holding its "
                                      "context: the cost of moving, per token of that "
                                      "context the other pod lacks")
    load_bound_factor: float = 1.25
    remote_prefill_threshold: int = setting(256, "P/D: below this many uncached tokens the "
                                            "decode pod prefills locally")
    remote_prefill_scope: str = setting(
        "request", "P/D: what --remote-prefill-threshold bounds: request (this request's "
        "uncached remainder) or pod (that plus the uncached tokens the decode pod is already "
        "prefilling, so a burst of sub-agent forks goes to the prefill pool instead of one "
        "long decode step)", choices=REMOTE_PREFILL_SCOPES)
    transfer_weight: float = 0.1
    eviction_cost_factor: float = setting(1.0, "cost policy: weight of live sessions' cached "
                                          "tokens a placement would evict (recomputed on "
                                          "their next turn); 0 ignores KV capacity")
    long_request_tokens: int = setting(1024, "request classes: a request whose prompt part "
                                       "no pod holds (the prefix index's prediction) is at "
                                       "least this many tokens is class long (a fresh or long "
                                       "prefill), else append (a turn that reuses its context); "
                                       "shown in metrics and logs", metavar="TOKENS")
    prefill_pool_for: tuple[ClassPool, ...] = setting(
        (), "P/D: prefill requests of CLASS (long or append) only on the prefill pods of POOL "
        "(--prefill POOL=ADDR, or the pods' tandem.dev/pool label); a class without a pool "
        "uses pods of pools no class reserved; when its pods cannot serve, the decode pod "
        "prefills it (repeat per class)", parse=parse_class_pool, metavar="CLASS=POOL")

    def validate(self) -> None:
        def bad(name: str, message: str) -> SettingError:
            return SettingError(flag_of(PolicySettings, name), message)

        if self.policy not in POLICIES:
            raise bad("policy", f"routing policy {self.policy!r}: choose one of {POLICIES}")
        if self.prefill_tokens_per_s <= 0:
            raise bad("prefill_tokens_per_s", "must be positive")
        if not 0 < self.kv_high_watermark <= 1:
            raise bad("kv_high_watermark", "must be in (0, 1]")
        if self.eviction_cost_factor < 0:
            raise bad("eviction_cost_factor", "must be >= 0")
        if self.kv_pressure_tokens < 0:
            raise bad("kv_pressure_tokens", "must be >= 0")
        if self.move_cost_factor < 0:
            raise bad("move_cost_factor", "must be >= 0")
        if self.load_bound_factor < 1:
            raise bad("load_bound_factor", "must be >= 1")
        if self.remote_prefill_scope not in REMOTE_PREFILL_SCOPES:
            raise bad("remote_prefill_scope",
                      f"{self.remote_prefill_scope!r}: choose one of {REMOTE_PREFILL_SCOPES}")
        if self.long_request_tokens <= 0:
            raise bad("long_request_tokens", "must be positive")
        classes = [a.request_class for a in self.prefill_pool_for]
        if len(classes) != len(set(classes)):
            raise bad("prefill_pool_for", "names a class twice")


class NoPodAvailable(RuntimeError):
    pass


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


def placement_cost(pod: PodView, num_tokens: int, s: PolicySettings,
                   weight: float = 1.0) -> float:
    """What choosing ``pod`` costs: ``weight`` x its uncached tokens, its load,
    and the later recompute of the live KV it evicts."""
    return (weight * uncached_tokens(pod, num_tokens)
            + load_tokens(pod, s, uncached_share(pod, num_tokens))
            + s.eviction_cost_factor * evicted_tokens(pod, num_tokens))


def ttft_s(cost: float, s: PolicySettings) -> float:
    return cost / s.prefill_tokens_per_s


class Policy:
    """The selectable policies behind one call. Holds only a round-robin cursor."""

    def __init__(self, settings: PolicySettings) -> None:
        settings.validate()
        self.settings = settings
        self._cursor = 0

    def choose(self, req: RouteInput) -> Choice:
        s = self.settings
        request_class = classify(req.num_tokens, (p.cached_tokens for p in req.pods),
                                 s.long_request_tokens)
        return replace(self._choose(req, request_class), request_class=request_class)

    def _choose(self, req: RouteInput, request_class: str) -> Choice:
        s = self.settings
        prefill = [p for p in req.pods if p.available and p.role == Role.PREFILL]
        decode = [p for p in req.pods if p.available and p.role != Role.PREFILL]
        if not decode:
            raise NoPodAvailable("no healthy decode or aggregated pod is available")
        split = any(p.role == Role.PREFILL for p in req.pods)
        if not split:
            chosen = self._choose_one(req, decode, weight=1.0)
            role = next(p.role for p in decode if p.name == chosen.pod)
            return replace(chosen,
                           local_prefill="no_prefill_pods" if role == Role.DECODE else None)
        # P/D: decode first. Its missing prefix arrives by transfer, so it weighs less.
        chosen = self._choose_one(req, decode, weight=s.transfer_weight)
        d = next(p for p in decode if p.name == chosen.pod)
        local_work = req.num_tokens - d.cached_tokens
        if s.remote_prefill_scope == "pod":
            local_work += d.pending_prefill_tokens
        candidates = pods_for_class(prefill, request_class, s.prefill_pool_for)
        if local_work < s.remote_prefill_threshold or not candidates:
            why = ("short_uncached" if local_work < s.remote_prefill_threshold and prefill
                   else "prefill_unavailable" if not prefill else "class_pool_unavailable")
            cost = prefill_cost(d, req.num_tokens, s)
            return Choice(d.name, None, f"{chosen.reason}+local-prefill:{why.replace('_', '-')}",
                          d.cached_tokens, ttft_s(cost, s), chosen.costs, why)
        p, reason = self._choose_prefill(req, candidates)
        cost = prefill_cost(p, req.num_tokens, s)
        return Choice(d.name, p.name, f"{chosen.reason}+{reason}", p.cached_tokens,
                      ttft_s(cost, s), chosen.costs)

    # ----- one pool ----------------------------------------------------------
    def _choose_one(self, req: RouteInput, pods: Sequence[PodView], weight: float) -> Choice:
        s = self.settings
        costs = {p.name: placement_cost(p, req.num_tokens, s, weight) for p in pods}
        by_name = {p.name: p for p in pods}

        def done(name: str, reason: str) -> Choice:
            pod = by_name[name]
            cost = prefill_cost(pod, req.num_tokens, s)
            return Choice(name, None, reason, pod.cached_tokens, ttft_s(cost, s), costs)

        least = min(pods, key=lambda p: (costs[p.name] if s.policy == "cost"
                                         else load_tokens(p, s), p.name))
        if s.policy == "round-robin":
            ordered = sorted(pods, key=lambda p: p.name)
            pod = ordered[self._cursor % len(ordered)]
            self._cursor += 1
            return done(pod.name, "round-robin")
        if s.policy == "least-load":
            return done(least.name, "least-load")
        if s.policy == "prefix":
            best = max(pods, key=lambda p: (p.cached_tokens, -load_tokens(p, s), p.name))
            return done(best.name, "prefix-hit" if best.cached_tokens else "prefix-miss")

        bound = req.binding.pod if req.binding else None
        if bound is not None and bound not in by_name:
            bound_reason = "rebind-unavailable"
            bound = None
        else:
            bound_reason = None

        if s.policy == "session":
            if bound is not None:
                return done(bound, "sticky")
            return self._new_session(req, pods, costs, done, bound_reason, use_cost=False)

        # cost (default)
        if bound is not None:
            others = [p for p in pods if p.name != bound]
            if not others:
                return done(bound, "sticky")
            anchor = by_name[bound]
            best = min(others, key=lambda p: (costs[p.name], p.name))
            if costs[bound] <= costs[best.name] + self._move_cost(anchor, best):
                return done(bound, "sticky")
            return done(best.name, "sticky-yielded")
        return self._new_session(req, pods, costs, done, bound_reason, use_cost=True)

    def _move_cost(self, anchor: PodView, other: PodView) -> float:
        """Leaving the pod that holds a context: a margin against flapping, plus
        the share of the prefix ``other`` lacks (rebuilt there, then held twice)."""
        s = self.settings
        return (s.stickiness_margin_tokens
                + s.move_cost_factor * max(0, anchor.cached_tokens - other.cached_tokens))

    def _new_session(self, req: RouteInput, pods: Sequence[PodView], costs: dict[str, float],
                     done: Callable[[str, str], Choice], bound_reason: str | None,
                     use_cost: bool) -> Choice:
        s = self.settings
        prefix = bound_reason or "new"
        cached = max(pods, key=lambda p: (p.cached_tokens, -costs[p.name], p.name))
        # A fork goes where its prefix is; when KV is tight, a new session goes
        # where it evicts least. Otherwise its hash home: every replica agrees.
        tight = s.eviction_cost_factor > 0 and any(evicted_tokens(p, req.num_tokens)
                                                   for p in pods)
        if use_cost and (cached.cached_tokens > 0 or tight):
            best = min(pods, key=lambda p: (costs[p.name], p.name))
            # A fork sticks to its parent's context as a session to its pod.
            if (cached.cached_tokens > 0 and best is not cached
                    and costs[cached.name] <= costs[best.name] + self._move_cost(cached, best)):
                best = cached
            return done(best.name, f"{prefix}-prefix" if best.cached_tokens else f"{prefix}-cost")
        if req.session is None:
            best = min(pods, key=lambda p: (costs[p.name] if use_cost else load_tokens(p, s),
                                            p.name))
            return done(best.name, f"{prefix}-least-cost")
        loads = {p.name: float(max(p.in_flight, p.running + p.waiting)) for p in pods}
        name, spilled = bounded_load_choice(req.session, [p.name for p in pods], loads,
                                            s.load_bound_factor)
        return done(name, f"{prefix}-hash-spill" if spilled else f"{prefix}-hash")

    def _choose_prefill(self, req: RouteInput, pods: Sequence[PodView]) -> tuple[PodView, str]:
        s = self.settings
        if s.policy == "round-robin":
            ordered = sorted(pods, key=lambda p: p.name)
            pod = ordered[self._cursor % len(ordered)]
            return pod, "prefill-round-robin"
        if s.policy == "least-load":
            return min(pods, key=lambda p: (load_tokens(p, s), p.name)), "prefill-least-load"
        if (s.policy == "session" and req.binding and req.binding.prefill_pod
                and any(p.name == req.binding.prefill_pod for p in pods)):
            return next(p for p in pods if p.name == req.binding.prefill_pod), "prefill-sticky"
        best = min(pods, key=lambda p: (placement_cost(p, req.num_tokens, s), p.name))
        return best, "prefill-overlap" if best.cached_tokens else "prefill-load"
