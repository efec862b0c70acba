"""The routing policies, one strategy class each, and the registry that names them.

Every policy answers two questions over one pool's available pods
(``Candidates``), with the same signatures: which decode (or aggregated) pod
(``choose``), and, in P/D, which prefill pod (``choose_prefill``). Each answer
is a pod name and a reason for metrics and logs; ``policy.Policy`` does the
rest (pools, P/D, request classes). ``REGISTRY`` is the one list of policies:
the router's ``--routing-policy`` choices and help, the validation, and the
enums of the operator's CRD and the Helm chart (``public``; a test holds them
equal) all read it.

``cost`` (the default): a session's bound pod keeps it unless its cost
exceeds the best other pod's cost plus the cost of moving the session,
``stickiness_margin_tokens`` plus ``move_cost_factor`` x the session prefix
the bound pod holds and the other does not (KV that would be rebuilt and
duplicated). A bound pod that lost the session's blocks (evicted under KV
pressure) has little to lose, so the session moves where load is lower:
affinity never outweighs capacity. New sessions with nothing cached anywhere
go to their consistent-hash home with bounded loads (the cheapest pod instead
when the request would evict live KV somewhere); a fork of a cached context
goes where its prefix is, held there by the same move cost as a bound session.

``round-robin``, ``least-load``, ``prefix`` (most cached, then least load),
``session`` (always sticky, new sessions by bounded-load hashing) and
``consistent-hash`` (the session id, else the prompt's prefix hash, on a ring
of the pool's pods, load and cache aside: the hash-routing baseline) use the
same inputs, so comparisons are one flag apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.router.routing.cost import PodView, evicted_tokens, load_tokens
from services.router.routing.hashring import bounded_load_choice, ring_home

if TYPE_CHECKING:
    from services.router.routing.policy import PolicySettings, RouteInput

Pick = tuple[str, str]  # the chosen pod's name, and why


@dataclass(frozen=True)
class Candidates:
    """What a strategy chooses among: one pool's available pods (at least one)."""

    req: RouteInput
    pods: Sequence[PodView]
    costs: Mapping[str, float]  # each pod's placement cost (cost.placement_cost)
    settings: PolicySettings

    def pod(self, name: str) -> PodView:
        return next(p for p in self.pods if p.name == name)

    def bound(self) -> tuple[str | None, str | None]:
        """The session's bound pod if it is among the candidates; else None,
        with the reason prefix ``rebind-unavailable`` when it is bound elsewhere."""
        bound = self.req.binding.pod if self.req.binding else None
        if bound is not None and all(p.name != bound for p in self.pods):
            return None, "rebind-unavailable"
        return bound, None


class Strategy(Protocol):
    """A routing policy. ``name``, ``summary`` and ``public`` are class
    attributes: the registry reads them without an instance."""

    name: str  # the --routing-policy value
    summary: str  # what --help says of it; "" when the name says it
    # Offered by the operator's CRD and the Helm chart; the others are
    # ablations for bench/router_policies.py, selectable by flag only.
    public: bool

    def choose(self, c: Candidates) -> Pick:
        """The decode (or aggregated) pod."""
        ...

    def choose_prefill(self, c: Candidates) -> Pick:
        """The prefill pod, after ``choose`` picked the decode pod."""
        ...


def cheapest_prefill(c: Candidates) -> Pick:
    best = min(c.pods, key=lambda p: (c.costs[p.name], p.name))
    return best.name, "prefill-overlap" if best.cached_tokens else "prefill-load"


def move_cost(anchor: PodView, other: PodView, s: PolicySettings) -> float:
    """Leaving the pod that holds a context: a margin against flapping, plus
    the share of the prefix ``other`` lacks (rebuilt there, then held twice),
    rebuilt at ``store_load_weight`` of its compute when a shared KV store
    holds it (the anchor computed it, so the store has it)."""
    return s.stickiness_margin_tokens + s.move_cost_factor * s.store_load_weight * max(
        0, anchor.cached_tokens - other.cached_tokens
    )


def new_session(c: Candidates, rebound: str | None, use_cost: bool) -> Pick:
    """A request with no pod bound among the candidates."""
    s, pods, costs = c.settings, c.pods, c.costs
    prefix = rebound or "new"
    cached = max(pods, key=lambda p: (p.cached_tokens, -costs[p.name], p.name))
    # A fork goes where its prefix is; when KV is tight, a new session goes
    # where it evicts least. Otherwise its hash home: every replica agrees.
    tight = s.eviction_cost_factor > 0 and any(evicted_tokens(p, c.req.num_tokens) for p in pods)
    if use_cost and (cached.cached_tokens > 0 or tight):
        best = min(pods, key=lambda p: (costs[p.name], p.name))
        # A fork sticks to its parent's context as a session to its pod.
        if (
            cached.cached_tokens > 0
            and best is not cached
            and costs[cached.name] <= costs[best.name] + move_cost(cached, best, s)
        ):
            best = cached
        return best.name, f"{prefix}-prefix" if best.cached_tokens else f"{prefix}-cost"
    if c.req.session is None:
        best = min(pods, key=lambda p: (costs[p.name] if use_cost else load_tokens(p, s), p.name))
        return best.name, f"{prefix}-least-cost"
    loads = {p.name: float(max(p.in_flight, p.running + p.waiting)) for p in pods}
    name, spilled = bounded_load_choice(
        c.req.session, [p.name for p in pods], loads, s.load_bound_factor
    )
    return name, f"{prefix}-hash-spill" if spilled else f"{prefix}-hash"


class Cost:
    name = "cost"
    summary = "prefix hits vs load, sticky sessions"
    public = True

    def choose(self, c: Candidates) -> Pick:
        bound, rebound = c.bound()
        if bound is None:
            return new_session(c, rebound, use_cost=True)
        others = [p for p in c.pods if p.name != bound]
        if not others:
            return bound, "sticky"
        best = min(others, key=lambda p: (c.costs[p.name], p.name))
        if c.costs[bound] <= c.costs[best.name] + move_cost(c.pod(bound), best, c.settings):
            return bound, "sticky"
        return best.name, "sticky-yielded"

    def choose_prefill(self, c: Candidates) -> Pick:
        return cheapest_prefill(c)


class RoundRobin:
    """The one policy with state: a cursor over the pods by name."""

    name = "round-robin"
    summary = ""
    public = True

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, c: Candidates) -> Pick:
        name = self._at_cursor(c)
        self._cursor += 1
        return name, "round-robin"

    def choose_prefill(self, c: Candidates) -> Pick:
        # The cursor moved on with the decode pod's choice; it does not move again.
        return self._at_cursor(c), "prefill-round-robin"

    def _at_cursor(self, c: Candidates) -> str:
        ordered = sorted(c.pods, key=lambda p: p.name)
        return ordered[self._cursor % len(ordered)].name


class LeastLoad:
    name = "least-load"
    summary = ""
    public = True

    def choose(self, c: Candidates) -> Pick:
        return self._least(c), "least-load"

    def choose_prefill(self, c: Candidates) -> Pick:
        return self._least(c), "prefill-least-load"

    @staticmethod
    def _least(c: Candidates) -> str:
        return min(c.pods, key=lambda p: (load_tokens(p, c.settings), p.name)).name


class Prefix:
    name = "prefix"
    summary = "most cached"
    public = False

    def choose(self, c: Candidates) -> Pick:
        best = max(c.pods, key=lambda p: (p.cached_tokens, -load_tokens(p, c.settings), p.name))
        return best.name, "prefix-hit" if best.cached_tokens else "prefix-miss"

    def choose_prefill(self, c: Candidates) -> Pick:
        return cheapest_prefill(c)


class Session:
    name = "session"
    summary = "always sticky"
    public = False

    def choose(self, c: Candidates) -> Pick:
        bound, rebound = c.bound()
        if bound is not None:
            return bound, "sticky"
        return new_session(c, rebound, use_cost=False)

    def choose_prefill(self, c: Candidates) -> Pick:
        binding = c.req.binding
        if binding and binding.prefill_pod and any(p.name == binding.prefill_pod for p in c.pods):
            return binding.prefill_pod, "prefill-sticky"
        return cheapest_prefill(c)


class ConsistentHash:
    """Where the request's key falls on a hash ring of the pool's pods: the
    session id, else the prompt's prefix hash (``RouteInput.prefix_key``);
    a request with neither (a prompt shorter than a block) goes to the least
    loaded pod. No load bound, no cache or KV awareness: a pod keeps its keys
    however busy, and a pod added or removed moves only its share of them."""

    name = "consistent-hash"
    summary = "session or prefix hash on a ring"
    public = False

    def choose(self, c: Candidates) -> Pick:
        return self._home(c, "hash")

    def choose_prefill(self, c: Candidates) -> Pick:
        return self._home(c, "prefill-hash")

    @staticmethod
    def _home(c: Candidates, reason: str) -> Pick:
        key = c.req.session or c.req.prefix_key
        if key is None:
            return LeastLoad._least(c), f"{reason}-no-key"
        return ring_home(key, [p.name for p in c.pods]), reason


# The registry, in the order --help lists them. A new policy is a class above and
# its name here.
REGISTRY: Mapping[str, type[Strategy]] = {
    cls.name: cls for cls in (Cost, RoundRobin, LeastLoad, Prefix, Session, ConsistentHash)
}
POLICIES = tuple(REGISTRY)
PUBLIC_POLICIES = tuple(name for name, cls in REGISTRY.items() if cls.public)


def policies_help() -> str:
    """The policies as --help lists them: "cost (prefix hits vs load, ...), round-robin, ..."."""
    return ", ".join(
        f"{name} ({cls.summary})" if cls.summary else name for name, cls in REGISTRY.items()
    )
