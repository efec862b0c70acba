"""Choosing pods: pure math, no I/O, the current time passed in.

Input: one ``PodView`` per pod (health, load, and how many of this request's
tokens the prefix index predicts it has cached), the request's size and
session binding. Output: a ``Choice`` with the decode pod (or the one
aggregated pod), an optional prefill pod, and a reason for metrics and logs.

What a pod costs is ``cost.py``; which pod each policy picks is its strategy
class in ``strategies.py`` (``--routing-policy``, ``cost`` by default).
``Policy`` runs the chosen strategy over the pools:

P/D (XpYd): the decode pod is chosen first (stickiness, load, KV pressure, the
prefix it already holds weighted by ``transfer_weight`` since it arrives over
NIXL rather than being computed); then, unless the part the decode pod lacks
is below ``remote_prefill_threshold`` tokens (the decode pod prefills it
locally; with ``remote_prefill_scope`` "pod" the uncached tokens it is already
prefilling count too, so a burst of sub-agent forks routed within
milliseconds does not pile into one long decode step), the strategy's prefill
pod among those of the request's class (``classes.py``: a long fresh prefill
or an append turn, each to its own pool when ``prefill_pool_for`` names one).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.roles import Role
from common.settings import SettingError, flag_of, setting
from services.router.routing.classes import (
    ClassPool,
    classify,
    parse_class_pool,
    pods_for_class,
)
from services.router.routing.cost import PodView, placement_cost, prefill_cost, ttft_s
from services.router.routing.strategies import (
    POLICIES,
    REGISTRY,
    Candidates,
    Strategy,
    policies_help,
)

REMOTE_PREFILL_SCOPES = ("request", "pod")
# The prompt prefix a request without a session is hashed on (consistent-hash):
# past a system prompt, into what tells conversations apart.
PREFIX_KEY_TOKENS = 1024


def prefix_key(block_hashes: Sequence[int], block_size: int) -> str | None:
    """The chained hash of the prompt's first ``PREFIX_KEY_TOKENS`` (fewer when
    the prompt is shorter): block hashes chain, so one names the whole prefix."""
    if not block_hashes:
        return None
    blocks = min(len(block_hashes), max(1, PREFIX_KEY_TOKENS // block_size))
    return format(block_hashes[blocks - 1], "x")


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
    # The prompt's prefix, as the chained hash of its first blocks (up to
    # PREFIX_KEY_TOKENS): what consistent-hash routing keys a request without
    # a session on. None: the prompt fills no block.
    prefix_key: str | None = None


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
    policy: str = setting(
        "cost",
        f"how pods are chosen: {policies_help()}",
        flag="--routing-policy",
        aliases=("--policy",),
        choices=POLICIES,
    )
    prefill_tokens_per_s: float = setting(
        2_000.0, "a pod's prefill speed, to turn costs into predicted TTFT"
    )
    request_cost_tokens: float = 64.0
    kv_high_watermark: float = 0.9
    kv_pressure_tokens: float = setting(
        4_096.0,
        "cost policy: the load, in prompt tokens, "
        "of a pod whose KV usage is full (scaled from the 90% "
        "watermark, and by the share of the request the pod "
        "must allocate)",
    )
    stickiness_margin_tokens: float = 256.0
    # Per token of prefix the other pod lacks (strategies.move_cost); the value is
    # measured (routing/README.md, "Measured").
    move_cost_factor: float = setting(
        0.5,
        "cost policy: how strongly a session (or a "
        "sub-agent fork) stays with the pod holding its "
        "context: the cost of moving, per token of that "
        "context the other pod lacks",
    )
    load_bound_factor: float = 1.25
    remote_prefill_threshold: int = setting(
        256, "P/D: below this many uncached tokens the decode pod prefills locally"
    )
    remote_prefill_scope: str = setting(
        "request",
        "P/D: what --remote-prefill-threshold bounds: request (this request's "
        "uncached remainder) or pod (that plus the uncached tokens the decode pod is already "
        "prefilling, so a burst of sub-agent forks goes to the prefill pool instead of one "
        "long decode step)",
        choices=REMOTE_PREFILL_SCOPES,
    )
    transfer_weight: float = 0.1
    store_load_weight: float = setting(
        1.0,
        "cost policy, with a shared KV store: what a prompt token a pod lacks "
        "and another pod holds costs there, as a share of computing it (the store "
        "has every block an engine computed, so the pod loads it); it also scales "
        "the cost of moving a session off the pod holding its context. 1: no "
        "store, a missing token is computed",
    )
    eviction_cost_factor: float = setting(
        1.0,
        "cost policy: weight of live sessions' cached "
        "tokens a placement would evict (recomputed on "
        "their next turn); 0 ignores KV capacity",
    )
    long_request_tokens: int = setting(
        1024,
        "request classes: a request whose prompt part "
        "no pod holds (the prefix index's prediction) is at "
        "least this many tokens is class long (a fresh or long "
        "prefill), else append (a turn that reuses its context); "
        "shown in metrics and logs",
        metavar="TOKENS",
    )
    prefill_pool_for: tuple[ClassPool, ...] = setting(
        (),
        "P/D: prefill requests of CLASS (long or append) only on the prefill pods of POOL "
        "(--prefill POOL=ADDR, or the pods' tandem.dev/pool label); a class without a pool "
        "uses pods of pools no class reserved; when its pods cannot serve, the decode pod "
        "prefills it (repeat per class)",
        parse=parse_class_pool,
        metavar="CLASS=POOL",
    )

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
        if not 0 <= self.store_load_weight <= 1:
            raise bad("store_load_weight", "must be in [0, 1]")
        if self.kv_pressure_tokens < 0:
            raise bad("kv_pressure_tokens", "must be >= 0")
        if self.move_cost_factor < 0:
            raise bad("move_cost_factor", "must be >= 0")
        if self.load_bound_factor < 1:
            raise bad("load_bound_factor", "must be >= 1")
        if self.remote_prefill_scope not in REMOTE_PREFILL_SCOPES:
            raise bad(
                "remote_prefill_scope",
                f"{self.remote_prefill_scope!r}: choose one of {REMOTE_PREFILL_SCOPES}",
            )
        if self.long_request_tokens <= 0:
            raise bad("long_request_tokens", "must be positive")
        classes = [a.request_class for a in self.prefill_pool_for]
        if len(classes) != len(set(classes)):
            raise bad("prefill_pool_for", "names a class twice")


class NoPodAvailable(RuntimeError):
    pass


class Policy:
    """The policy ``settings.policy`` names, over the pools: decode (or
    aggregated) first, then, in P/D, the prefill pod."""

    def __init__(self, settings: PolicySettings) -> None:
        settings.validate()
        self.settings = settings
        self.strategy: Strategy = REGISTRY[settings.policy]()

    def choose(self, req: RouteInput) -> Choice:
        s = self.settings
        request_class = classify(
            req.num_tokens, (p.cached_tokens for p in req.pods), s.long_request_tokens
        )
        return self._choose(req, request_class)

    def peek(self, req: RouteInput) -> Choice:
        """What ``choose`` would answer now, leaving the strategy's state (the
        round-robin cursor) as it is."""
        twin = copy.copy(self)
        twin.strategy = copy.copy(self.strategy)
        return twin.choose(req)

    def _choose(self, req: RouteInput, request_class: str) -> Choice:
        s = self.settings
        prefill = [p for p in req.pods if p.available and p.role == Role.PREFILL]
        decode = [p for p in req.pods if p.available and p.role != Role.PREFILL]
        if not decode:
            raise NoPodAvailable("no healthy decode or aggregated pod is available")
        split = any(p.role == Role.PREFILL for p in req.pods)
        if not split:
            return self._choose_one(req, decode, 1.0, request_class, alone=True)
        # P/D: decode first. Its missing prefix arrives by transfer, so it weighs less.
        chosen = self._choose_one(req, decode, s.transfer_weight, request_class)
        d = next(p for p in decode if p.name == chosen.pod)
        local_work = req.num_tokens - d.cached_tokens
        if s.remote_prefill_scope == "pod":
            local_work += d.pending_prefill_tokens
        candidates = pods_for_class(prefill, request_class, s.prefill_pool_for)
        if local_work < s.remote_prefill_threshold or not candidates:
            why = (
                "short_uncached"
                if local_work < s.remote_prefill_threshold and prefill
                else "prefill_unavailable"
                if not prefill
                else "class_pool_unavailable"
            )
            cost = prefill_cost(d, req.num_tokens, s)
            return Choice(
                d.name,
                None,
                f"{chosen.reason}+local-prefill:{why.replace('_', '-')}",
                d.cached_tokens,
                ttft_s(cost, s),
                chosen.costs,
                why,
                request_class,
            )
        name, reason = self.strategy.choose_prefill(self._candidates(req, candidates, 1.0))
        p = next(p for p in candidates if p.name == name)
        cost = prefill_cost(p, req.num_tokens, s)
        return Choice(
            d.name,
            p.name,
            f"{chosen.reason}+{reason}",
            p.cached_tokens,
            ttft_s(cost, s),
            chosen.costs,
            request_class=request_class,
        )

    def _choose_one(
        self,
        req: RouteInput,
        pods: Sequence[PodView],
        weight: float,
        request_class: str,
        alone: bool = False,
    ) -> Choice:
        """The decode (or aggregated) pod among ``pods``; `alone`: no
        prefill pods are configured (a decode pod then prefills locally)."""
        s = self.settings
        c = self._candidates(req, pods, weight)
        name, reason = self.strategy.choose(c)
        pod = c.pod(name)
        cost = prefill_cost(pod, req.num_tokens, s)
        local = "no_prefill_pods" if alone and pod.role == Role.DECODE else None
        return Choice(
            name,
            None,
            reason,
            pod.cached_tokens,
            ttft_s(cost, s),
            dict(c.costs),
            local,
            request_class,
        )

    def _candidates(self, req: RouteInput, pods: Sequence[PodView], weight: float) -> Candidates:
        held = max((p.cached_tokens for p in req.pods), default=0)
        costs = {
            p.name: placement_cost(p, req.num_tokens, self.settings, weight, held) for p in pods
        }
        return Candidates(req, pods, costs, self.settings)
