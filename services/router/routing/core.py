"""The routing core: the one object the router asks where a request goes.

Pure: no I/O, no clock, no background tasks; the current time is an argument.
It holds what this router replica knows: the pods (spec, last poll, circuit
breaker), the prefix index (the caller applies the pods' KV events to
``index``), the live sessions and this replica's exact in-flight load. A
decision is a function of that and of a ``SharedView`` the caller reads from
the shared-state store just before (the session's binding, the other
replicas' load); what the other replicas must learn comes back as
``StateWrites``, which the caller writes to the store after. The pod set
changes at runtime through ``add_pod``, ``remove_pod`` and ``set_draining``.
See README.md in this folder for the call sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.roles import Role
from services.router.routing.chains import HashChains
from services.router.routing.cost import PodView
from services.router.routing.hashing import BlockHasher
from services.router.routing.health import PodHealth
from services.router.routing.index import PrefixIndex, predicted_cached_tokens
from services.router.routing.live import LiveSessions
from services.router.routing.lru import BoundedLru
from services.router.routing.policy import (
    Binding,
    NoPodAvailable,
    Policy,
    RouteInput,
    prefix_key,
)
from services.router.routing.sessions import common_prefix_len
from services.router.routing.settings import INDEX_CAPACITY_FLOOR, RoutingSettings

log = logging.getLogger(__name__)

# A pod's state as /health and the tandem_router_pod_state metric name it,
# the first that applies: not healthy, draining (engine or discovery), circuit
# open, else available (takes new work).
POD_STATES = ("unhealthy", "draining", "ejected", "available")


@dataclass(frozen=True)
class PodSpec:
    """A pod as the router is told of it (flags, or discovery)."""

    name: str  # the pod's gRPC address
    role: Role = Role.BOTH
    # The engine's KV event PUB and replay endpoints; None: no events, the
    # index holds predicted entries for the pod.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    pool: str = ""  # the pool it belongs to (request classes: classes.py); "": unnamed

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # "decode" works, "deocde" fails


@dataclass
class PodStatus:
    """Everything this replica knows of one pod; routing, /health and metrics read it."""

    spec: PodSpec
    healthy: bool = False  # the last poll said SERVING and no call failed since
    draining: bool = False  # the engine says it is shutting down
    marked_draining: bool = False  # set_draining: the pod is going away (discovery)
    running: int = 0  # engine-reported
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_capacity_blocks: int = 0  # 0: not reported
    # Decisions that chose the pod to compute the prompt, by request class.
    class_counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PodLoad:
    in_flight: int = 0  # requests routed to the pod and not finished
    pending_prefill_tokens: int = 0  # uncached prompt tokens routed there, prefill not done


@dataclass(frozen=True)
class SharedView:
    """What the shared-state store says before a decision."""

    binding: Binding | None = None  # where the session's previous turn went
    loads: Mapping[str, PodLoad] = field(default_factory=dict)  # the other replicas' load


@dataclass(frozen=True)
class StateWrites:
    """What the shared-state store must learn after a core call."""

    loads: Mapping[str, PodLoad] = field(default_factory=dict)  # this replica's, per pod
    binding: tuple[str, Binding] | None = None  # (session, where it went)


@dataclass(frozen=True)
class PodReport:
    """One pod as /health and /metrics show it."""

    name: str
    role: Role
    state: str  # one of POD_STATES
    healthy: bool
    draining: bool
    in_flight: int  # this replica's
    pending_prefill_tokens: int  # this replica's
    cached_blocks: int  # KV blocks the index believes the pod holds
    live_blocks: int  # KV blocks this replica's live sessions need there
    kv_capacity_blocks: int
    ejections: int  # times its circuit breaker opened
    engine_running: int  # as the pod's last load poll reported (all routers' requests)
    engine_waiting: int
    class_counts: Mapping[str, int] = field(default_factory=dict)  # decisions, by class


@dataclass(frozen=True)
class RouteRequest:
    token_ids: Sequence[int]
    session: str | None = None
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None  # (name, path) as vLLM hashes it
    exclude: frozenset[str] = frozenset()  # pods that already failed this request
    session_end: bool = False  # the session's last request: its KV is not needed after


@dataclass
class RouteDecision:
    prefill_pod: str | None  # None: decode_pod computes the prompt itself
    decode_pod: str  # the decode pod, or the aggregated pod
    reason: str
    predicted_cached_tokens: int  # on the pod that computes the prompt
    predicted_ttft_s: float
    session: str | None = None
    num_tokens: int = 0
    # Why a decode pod computes the prompt itself (a metric label):
    # no_prefill_pods, prefill_unavailable, class_pool_unavailable (none of the
    # request class's prefill pods can serve) or short_uncached; None otherwise.
    local_prefill: str | None = None
    request_class: str = "append"  # long or append (classes.py)
    # The prompt's block hashes (the KV retention hint names them).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    writes: StateWrites = field(default_factory=StateWrites, repr=False)
    # Load this decision still holds per pod: [requests, prefill tokens].
    _held: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def prefill_on(self) -> str:
        """The pod that computes the prompt's KV."""
        return self.prefill_pod or self.decode_pod


@dataclass(frozen=True)
class _Lookup:
    """A session's latest prompt as the index was asked about it."""

    hashes: list[int]
    held: dict[str, tuple[int, int]]  # pod -> (leading blocks held, index epoch then)


class RoutingCore:
    def __init__(self, settings: RoutingSettings, pods: Iterable[PodSpec] = ()) -> None:
        settings.validate()
        self.settings = settings
        self.hasher = BlockHasher(settings.block_size, settings.hash_algo, settings.hash_seed)
        self.index = PrefixIndex(
            settings.index_capacity or INDEX_CAPACITY_FLOOR, settings.predicted_capacity
        )
        self.chains = HashChains(self.hasher, settings.live_max_sessions, settings.live_max_tokens)
        # session -> its latest prompt's lookup, where the next turn's resumes.
        self._lookups: BoundedLru[str, _Lookup] = BoundedLru(
            settings.live_max_sessions, settings.live_max_blocks, weigh=lambda m: len(m.hashes)
        )
        self.live = LiveSessions(
            settings.live_session_window_s, settings.live_max_sessions, settings.live_max_blocks
        )
        self.policy = Policy(settings.policy)
        self.health = PodHealth(settings.breaker)
        self._pods: dict[str, PodStatus] = {}
        self._loads: dict[str, PodLoad] = {}  # this replica's; zero loads are dropped
        for spec in pods:
            self.add_pod(spec)

    # ----- the pod set ------------------------------------------------------
    def add_pod(self, spec: PodSpec) -> None:
        """A new pod; it takes work once a poll finds it healthy (``update_pod``)."""
        if spec.name in self._pods:
            raise ValueError(f"pod {spec.name} is already known")
        self._pods[spec.name] = PodStatus(spec)
        self.index.add_pod(spec.name)

    def remove_pod(self, name: str) -> None:
        """The pod is gone: no new work, and what the index, the breakers and
        the live sessions knew of it is dropped. Load its running requests still
        hold is freed as they are released."""
        self._status(name)
        st = self._pods.pop(name)
        self.index.remove_pod(name)
        if st.kv_capacity_blocks:
            self._fit_index()
        self.health.remove(name)
        self.live.remove_pod(name)

    def _fit_index(self) -> None:
        """Unless bounded by a setting, the index keeps as many hashes as the
        pods have KV blocks in all: it never needs more, and with fewer it
        forgets where sessions' prefixes are."""
        if self.settings.index_capacity is None:
            blocks = sum(st.kv_capacity_blocks for st in self._pods.values())
            self.index.resize(max(INDEX_CAPACITY_FLOOR, blocks))

    def set_draining(self, name: str, draining: bool = True) -> None:
        """The pod is going away (or stays after all): while marked, it gets no
        new requests; those it runs finish."""
        self._status(name).marked_draining = draining

    @property
    def pods(self) -> Mapping[str, PodStatus]:
        return self._pods

    # ----- polls ------------------------------------------------------------
    def update_pod(
        self,
        name: str,
        now: float,
        *,
        healthy: bool,
        draining: bool = False,
        running: int = 0,
        waiting: int = 0,
        kv_cache_usage: float = 0.0,
        kv_capacity_blocks: int = 0,
        why: str = "",
    ) -> None:
        """Feed a poll result (``why``: what made it unhealthy, for the log).
        A poll of a pod removed meanwhile is ignored. A healthy poll of an
        ejected pod is its recovery probe."""
        st = self._pods.get(name)
        if st is None:
            return
        self._set_healthy(st, healthy, why)
        st.draining, st.running, st.waiting = draining, running, waiting
        reported = kv_capacity_blocks != st.kv_capacity_blocks
        st.kv_cache_usage, st.kv_capacity_blocks = kv_cache_usage, kv_capacity_blocks
        if reported:
            self._fit_index()
        breaker = self.health.breaker(name)
        if healthy and breaker.probe_due(now):
            breaker.record_success(now)
            log.info("pod %s recovered: circuit closed", name)

    def mark_unhealthy(self, name: str, why: str) -> None:
        """No new work until a poll finds the pod healthy again (its load as last polled)."""
        st = self._pods.get(name)
        if st is not None:
            self._set_healthy(st, False, why)

    @staticmethod
    def _set_healthy(st: PodStatus, healthy: bool, why: str) -> None:
        if healthy and not st.healthy:
            log.info("pod %s (%s) is healthy", st.spec.name, st.spec.role)
        elif st.healthy and not healthy:
            log.warning("pod %s (%s) marked unhealthy: %s", st.spec.name, st.spec.role, why)
        st.healthy = healthy

    # ----- what /health and /metrics read ----------------------------------
    def available(self, name: str, now: float) -> bool:
        """Takes new work: healthy, not draining, circuit closed."""
        return self.state_of(name, now) == "available"

    def state_of(self, name: str, now: float) -> str:
        st = self._status(name)
        if not st.healthy:
            return "unhealthy"
        if st.draining or st.marked_draining:
            return "draining"
        if not self.health.allows_traffic(name, now):
            return "ejected"
        return "available"

    def local_load(self, name: str) -> PodLoad:
        """This replica's load on the pod."""
        return self._loads.get(name, PodLoad())

    def report(self, now: float) -> list[PodReport]:
        reports = []
        for name, st in self._pods.items():
            load = self.local_load(name)
            reports.append(
                PodReport(
                    name=name,
                    role=st.spec.role,
                    state=self.state_of(name, now),
                    healthy=st.healthy,
                    draining=st.draining or st.marked_draining,
                    in_flight=load.in_flight,
                    pending_prefill_tokens=load.pending_prefill_tokens,
                    cached_blocks=self.index.held_blocks(name),
                    live_blocks=self.live.occupied_blocks(name, None),
                    kv_capacity_blocks=st.kv_capacity_blocks,
                    ejections=self.health.breaker(name).ejections,
                    engine_running=st.running,
                    engine_waiting=st.waiting,
                    class_counts=dict(st.class_counts),
                )
            )
        return reports

    # ----- the seam ---------------------------------------------------------
    def route(
        self,
        req: RouteRequest,
        shared: SharedView,
        now: float,
        block_hashes: Sequence[int] | None = None,
    ) -> RouteDecision:
        """Choose pods for one request and hold its load (``release`` frees it).
        ``block_hashes``: the prompt's (``block_hashes``), if the caller
        computed them; None: computed here.

        Raises ``NoPodAvailable`` when no decode or aggregated pod can take it.
        Write ``decision.writes`` to the shared-state store afterwards.
        """
        n = len(req.token_ids)
        hashes = list(block_hashes) if block_hashes is not None else self.block_hashes(req)
        self.index.expire_predictions(now)
        self.live.expire(now)
        views = self._views(n, hashes, req.session, shared, req.exclude, now)
        key = prefix_key(hashes, self.settings.block_size)
        choice = self.policy.choose(
            RouteInput(n, views, req.session, shared.binding, now, prefix_key=key)
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route session=%s tokens=%d class=%s -> %s prefill=%s (%s) cached=%s "
                "free=%s costs=%s",
                req.session,
                n,
                choice.request_class,
                choice.pod,
                choice.prefill_pod,
                choice.reason,
                {v.name: v.cached_tokens for v in views},
                {v.name: v.kv_free_tokens for v in views},
                {k: round(v) for k, v in choice.costs.items()},
            )
        decision = RouteDecision(
            choice.prefill_pod,
            choice.pod,
            choice.reason,
            choice.predicted_cached_tokens,
            choice.predicted_ttft_s,
            req.session,
            n,
            choice.local_prefill,
            choice.request_class,
            hashes,
        )
        counts = self._pods[decision.prefill_on].class_counts
        counts[decision.request_class] = counts.get(decision.request_class, 0) + 1
        uncached = max(0, n - choice.predicted_cached_tokens)
        loads = {decision.prefill_on: self._hold(decision, decision.prefill_on, 1, uncached)}
        if decision.prefill_pod is not None:
            loads[decision.decode_pod] = self._hold(decision, decision.decode_pod, 1, 0)
        # As the lookup found the index (predicting below loses nothing there
        # unless it pushes out older predictions, which changes the epoch).
        epochs = {pod: self.index.epoch(pod) for pod in self._pods}
        for pod in loads:
            ttl = (
                self.settings.predicted_ttl_with_events_s
                if self._pods[pod].spec.kv_events
                else self.settings.predicted_ttl_s
            )
            self.index.predict(pod, hashes, now, ttl)
        binding = None
        if req.session:
            if req.session_end:
                self.live.end(req.session)
                self._lookups.pop(req.session)
            else:
                self.live.touch(req.session, loads, hashes, now)
                self._remember_lookup(req.session, hashes, views, loads, epochs)
            binding = (req.session, Binding(decision.decode_pod, decision.prefill_pod))
        decision.writes = StateWrites(loads, binding)
        return decision

    def block_hashes(self, req: RouteRequest) -> list[int]:
        """The request's block hashes as KV events carry them; a session's
        turn hashes only the blocks its previous turn (or, for a sub-agent,
        its parent) did not have (``chains.py``)."""
        hashes = self.chains.event_hashes(req.token_ids, req.session, req.cache_salt, req.lora)
        if req.session_end and req.session:
            self.chains.forget(req.session)
        return hashes

    def next_turn(
        self, hashes: list[int], num_tokens: int, session: str, binding: Binding | None, now: float
    ) -> PodView | None:
        """The pod a turn of ``session`` with this prompt (``num_tokens`` long,
        its block ``hashes`` as ``hasher.event_hashes`` gives them) would go to
        now (the decode or aggregated pod), as the policy saw it: the tokens the
        index predicts there, the KV room it has without evicting live sessions.
        The policy is asked as ``route`` asks it, with nothing held, predicted
        or counted. None: no pod could take it."""
        self.index.expire_predictions(now)
        views = self._views(num_tokens, hashes, session, SharedView(binding), frozenset(), now)
        try:
            key = prefix_key(hashes, self.settings.block_size)
            choice = self.policy.peek(
                RouteInput(num_tokens, views, session, binding, now, prefix_key=key)
            )
        except NoPodAvailable:
            return None
        return next(v for v in views if v.name == choice.pod)

    def note_warmed(self, pod: str, hashes: Sequence[int], now: float) -> None:
        """A prefetch put the KV of the prompt with these block hashes on
        ``pod``: the index predicts it there until the pod's events (or the
        prediction's TTL) say otherwise."""
        st = self._pods.get(pod)
        if st is None:
            return
        ttl = (
            self.settings.predicted_ttl_with_events_s
            if st.spec.kv_events
            else self.settings.predicted_ttl_s
        )
        self.index.predict(pod, hashes, now, ttl)

    def report_prefill(
        self, decision: RouteDecision, now: float, pod: str | None = None
    ) -> StateWrites:
        """The prompt's KV is computed on ``pod`` (default: the pod chosen to compute it).

        Frees the pod's pending prefill tokens, and a P/D prefill pod's request
        slot. An aggregated or decode pod's prompt is done at its first token:
        a decoding request is not prefill work queued ahead of the next one.
        """
        pod = pod or decision.prefill_on
        self.health.record_success(pod, now)
        held = decision._held.get(pod)
        if held is None:
            return StateWrites()
        tokens, held[1] = held[1], 0
        requests = 0
        if pod == decision.prefill_pod and pod != decision.decode_pod:
            requests, held[0] = held[0], 0
        if not (requests or tokens):
            return StateWrites()
        return StateWrites({pod: self._add_load(pod, -requests, -tokens)})

    def report_failure(self, pod: str, now: float, why: str = "a call failed") -> bool:
        """A call to ``pod`` failed before its first byte: no new work until a
        poll finds it healthy, and one failure on its circuit breaker. True
        when this failure ejected the pod."""
        self.mark_unhealthy(pod, why)
        if pod not in self._pods or not self.health.record_failure(pod, now):
            return False
        log.warning("pod %s ejected after repeated failures", pod)
        return True

    def release(self, decision: RouteDecision) -> StateWrites:
        """The request ended (any way): free the load it still holds. Idempotent."""
        loads = {}
        for pod, held in decision._held.items():
            if held[0] or held[1]:
                loads[pod] = self._add_load(pod, -held[0], -held[1])
                held[0] = held[1] = 0
        return StateWrites(loads)

    # ----- internals --------------------------------------------------------
    def _status(self, name: str) -> PodStatus:
        st = self._pods.get(name)
        if st is None:
            raise KeyError(f"unknown pod {name}")
        return st

    def _views(
        self,
        n: int,
        hashes: list[int],
        session: str | None,
        shared: SharedView,
        exclude: frozenset[str],
        now: float,
    ) -> list[PodView]:
        matched = self.index.match(hashes, now, self._known_held(session, hashes))
        bs = self.settings.block_size
        # Blocks live sessions need, on the pods that report a KV capacity
        # (``_kv_free_tokens``; the others' room is unknown).
        reported = (name for name, st in self._pods.items() if st.kv_capacity_blocks)
        occupied = self.live.occupied_by_pod(
            session, hashes, {name: matched.get(name, 0) for name in reported}
        )
        views = []
        for name, st in self._pods.items():
            local, remote = self.local_load(name), shared.loads.get(name, PodLoad())
            blocks = matched.get(name, 0)
            views.append(
                PodView(
                    name=name,
                    role=st.spec.role,
                    available=self.available(name, now) and name not in exclude,
                    in_flight=local.in_flight + remote.in_flight,
                    pending_prefill_tokens=(
                        local.pending_prefill_tokens + remote.pending_prefill_tokens
                    ),
                    running=st.running,
                    waiting=st.waiting,
                    kv_cache_usage=st.kv_cache_usage,
                    cached_tokens=predicted_cached_tokens(blocks, n, bs),
                    kv_free_tokens=self._kv_free_tokens(st, occupied.get(name, 0)),
                    pool=st.spec.pool,
                )
            )
        return views

    def _known_held(self, session: str | None, hashes: list[int]) -> dict[str, int]:
        """Per pod, leading blocks of ``hashes`` known held there: those the
        session's previous prompt shares with it, as far as they were held
        then, where no block stopped being held since (``index.epoch``)."""
        prev = self._lookups.get(session) if session else None
        if prev is None:
            return {}
        shared = common_prefix_len(prev.hashes, hashes)
        return {
            pod: min(held, shared)
            for pod, (held, epoch) in prev.held.items()
            if self.index.epoch(pod) == epoch
        }

    def _remember_lookup(
        self,
        session: str,
        hashes: list[int],
        views: list[PodView],
        predicted: Iterable[str],
        epochs: Mapping[str, int | None],
    ) -> None:
        bs = self.settings.block_size
        held = {v.name: v.cached_tokens // bs for v in views}
        held.update({pod: len(hashes) for pod in predicted})  # just predicted there
        self._lookups.put(
            session,
            _Lookup(
                hashes,
                {p: (n, e) for p, n in held.items() if (e := epochs.get(p)) is not None},
            ),
        )

    def _hold(self, decision: RouteDecision, pod: str, requests: int, tokens: int) -> PodLoad:
        held = decision._held.setdefault(pod, [0, 0])
        held[0] += requests
        held[1] += tokens
        return self._add_load(pod, requests, tokens)

    def _add_load(self, pod: str, requests: int, tokens: int) -> PodLoad:
        old = self.local_load(pod)
        new = PodLoad(max(0, old.in_flight + requests), max(0, old.pending_prefill_tokens + tokens))
        if new == PodLoad():
            self._loads.pop(pod, None)
        else:
            self._loads[pod] = new
        return new

    def _kv_free_tokens(self, st: PodStatus, occupied: int) -> int | None:
        """KV the pod can fill for this request without evicting the
        ``occupied`` blocks live sessions need (None: the pod has not
        reported its capacity)."""
        capacity = st.kv_capacity_blocks
        if not capacity:
            return None
        return max(0, capacity - occupied) * self.settings.block_size
