"""The routing core: the one object the router calls to place a request.

It composes the pieces (hasher, prefix index, KV event subscribers, shared
state, circuit breakers, policy, metrics) and does the I/O the policy must not:
reading session bindings and load from shared state, and recording what it
decided. See README.md in this folder for the call sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.router.routing.events import KvEventSubscriber
from services.router.routing.hashing import BlockHasher
from services.router.routing.health import PodHealth
from services.router.routing.index import PrefixIndex, predicted_cached_tokens
from services.router.routing.live import LiveSessions
from services.router.routing.metrics import RoutingMetrics
from services.router.routing.policy import Binding, Policy, PodView, RouteInput
from services.router.routing.settings import RoutingSettings
from services.router.routing.shared_state import LocalState, RedisState

log = logging.getLogger("tandem.router.routing")


@dataclass(frozen=True)
class PodSpec:
    name: str  # the pod's gRPC address
    role: str = "both"  # "prefill", "decode" or "both"


@dataclass
class PodStatus:
    """What the router's health/load poller last saw of a pod."""
    healthy: bool = True
    draining: bool = False
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_capacity_blocks: int = 0  # 0: not reported


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
    # The prompt's block hashes (the KV retention hint names them).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # Bookkeeping for report_prefill/release: load this decision still holds.
    _held: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def prefill_on(self) -> str:
        """The pod that computes the prompt's KV."""
        return self.prefill_pod or self.decode_pod


class RoutingCore:
    def __init__(self, settings: RoutingSettings, pods: Sequence[PodSpec],
                 registry: CollectorRegistry | None = None) -> None:
        settings.validate()
        self.settings = settings
        self.pods: dict[str, PodSpec] = {p.name: p for p in pods}
        self.status: dict[str, PodStatus] = {p.name: PodStatus() for p in pods}
        self.hasher = BlockHasher(settings.block_size, settings.hash_algo, settings.hash_seed)
        self.index = PrefixIndex(settings.index_capacity)
        self.live = LiveSessions(settings.live_session_window_s)
        for p in pods:
            self.index.add_pod(p.name)
        self.policy = Policy(settings.policy)
        self.health = PodHealth(settings.breaker)
        self.metrics = RoutingMetrics(registry)
        self.state = (RedisState(settings.redis_url, settings.replica_id,
                                 binding_ttl_s=settings.session_ttl_s,
                                 timeout_s=settings.redis_timeout_s)
                      if settings.redis_url else LocalState(settings.session_ttl_s))
        if self.state.shared:
            state = self.state
            self.metrics.shared_state_up.set_function(lambda: 1.0 if state.up else 0.0)
        index = self.index
        self.metrics.index_blocks.set_function(lambda: len(index))
        # Per-pod gauges are refreshed by the poller (update_pod), off the hot
        # path, from the loads the last routing decision saw.
        self._seen_loads: dict = {}
        self._evictions_counted = 0
        unknown = [s.pod for s in settings.kv_events if s.pod not in self.pods]
        if unknown:
            raise ValueError(f"--kv-events names pods that are not configured: {unknown}")
        self.subscribers = {
            s.pod: KvEventSubscriber(s.pod, s.endpoint, s.replay_endpoint, self.index,
                                     settings.kv_events_topic, on_batch=self._on_event_batch)
            for s in settings.kv_events}

    # ----- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await self.state.start()
        for sub in self.subscribers.values():
            sub.start()

    async def close(self) -> None:
        for sub in self.subscribers.values():
            await sub.stop()
        await self.state.close()

    # ----- inputs from the router's poller ---------------------------------
    def update_pod(self, name: str, now: float, *, healthy: bool, draining: bool = False,
                   running: int = 0, waiting: int = 0, kv_cache_usage: float = 0.0,
                   kv_capacity_blocks: int = 0) -> None:
        """Feed a poll result. A healthy poll of an ejected pod is its recovery probe."""
        self.status[name] = PodStatus(healthy, draining, running, waiting, kv_cache_usage,
                                      kv_capacity_blocks)
        breaker = self.health.breaker(name)
        if healthy and breaker.probe_due(now):
            breaker.record_success(now)
            log.info("pod %s recovered: circuit closed", name)
        self.metrics.pod_available.labels(name).set(1 if self.available(name, now) else 0)
        self._refresh_pod_gauges(name)

    def _refresh_pod_gauges(self, name: str) -> None:
        m = self.metrics
        m.pod_blocks.labels(name).set(self.index.held_blocks(name))
        m.pod_live_blocks.labels(name).set(self.live.occupied_blocks(name, None))
        m.pod_kv_capacity.labels(name).set(self.status[name].kv_capacity_blocks)
        load = self._seen_loads.get(name)
        m.pod_in_flight.labels(name).set(load.in_flight if load else 0)
        m.pod_pending_tokens.labels(name).set(load.pending_prefill_tokens if load else 0)
        m.index_evictions.inc(self.index.evictions - self._evictions_counted)
        self._evictions_counted = self.index.evictions

    def available(self, name: str, now: float) -> bool:
        st = self.status[name]
        return st.healthy and not st.draining and self.health.allows_traffic(name, now)

    def pods_due_probe(self, now: float) -> list[str]:
        """Ejected pods whose wait is over: poll them now (their next poll probes them)."""
        return self.health.pods_due_probe(now)

    # ----- the seam ---------------------------------------------------------
    async def route(self, req: RouteRequest, now: float) -> RouteDecision:
        """Choose pods for one request and account its load (release() undoes it)."""
        t0 = time.perf_counter()
        n = len(req.token_ids)
        hashes = self._block_hashes(req)
        self.index.expire_predictions(now)
        self.live.expire(now)
        matched = self.index.match(hashes, now)
        binding = await self.state.get_binding(req.session) if req.session else None
        loads = self._seen_loads = await self.state.loads()
        bs = self.settings.block_size
        views = []
        for name, spec in self.pods.items():
            st = self.status[name]
            load = loads.get(name)
            views.append(PodView(
                name=name, role=spec.role,
                available=self.available(name, now) and name not in req.exclude,
                in_flight=load.in_flight if load else 0,
                pending_prefill_tokens=load.pending_prefill_tokens if load else 0,
                running=st.running, waiting=st.waiting, kv_cache_usage=st.kv_cache_usage,
                cached_tokens=predicted_cached_tokens(matched.get(name, 0), n, bs),
                kv_free_tokens=self._kv_free_tokens(name, req.session,
                                                    hashes[:matched.get(name, 0)])))
        choice = self.policy.choose(RouteInput(n, views, req.session, binding, now))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route session=%s tokens=%d -> %s prefill=%s (%s) cached=%s free=%s "
                      "costs=%s", req.session, n, choice.pod, choice.prefill_pod, choice.reason,
                      {v.name: v.cached_tokens for v in views},
                      {v.name: v.kv_free_tokens for v in views},
                      {k: round(v) for k, v in choice.costs.items()})
        decision = RouteDecision(choice.prefill_pod, choice.pod, choice.reason,
                                 choice.predicted_cached_tokens, choice.predicted_ttft_s,
                                 req.session, n, hashes)
        uncached = max(0, n - choice.predicted_cached_tokens)
        await self._hold(decision, decision.prefill_on, 1, uncached)
        if decision.prefill_pod is not None:
            await self._hold(decision, decision.decode_pod, 1, 0)
        for pod in {decision.prefill_on, decision.decode_pod}:
            ttl = (self.settings.predicted_ttl_with_events_s if pod in self.subscribers
                   else self.settings.predicted_ttl_s)
            self.index.predict(pod, hashes, now, ttl)
        if req.session:
            if req.session_end:
                self.live.end(req.session)
            else:
                self.live.touch(req.session, {decision.prefill_on, decision.decode_pod},
                                hashes, now)
            await self.state.set_binding(req.session, Binding(decision.decode_pod,
                                                              decision.prefill_pod))
        if req.exclude:
            for pod in req.exclude:
                self.metrics.retries.labels(pod).inc()
        self.metrics.decisions.labels(self.settings.policy.policy, _reason_label(choice.reason)).inc()
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        return decision

    async def report_prefill(self, decision: RouteDecision, cached_tokens: int | None,
                             now: float, pod: str | None = None) -> None:
        """The prompt's KV is computed: the engine's reported cached_tokens (None if unknown).

        Frees the pod's pending prefill tokens; a P/D prefill pod's request slot too.
        Compares prediction and report (metrics only: a pod that lacked blocks the
        index believed it held has just recomputed them, so the index is right
        again; forgetting them made the session's next turn under-predicted).
        An aggregated pod's prompt is done at its first token, but its count
        comes with the last: call at the first with None (frees the load at
        once; a decoding request is not queued prefill work), again at the end.
        """
        pod = pod or decision.prefill_on
        self.health.record_success(pod, now)
        held = decision._held.get(pod)
        if held is not None:
            tokens = held[1]
            held[1] = 0
            requests = 0
            if pod == decision.prefill_pod and pod != decision.decode_pod:
                requests, held[0] = held[0], 0
            if requests or tokens:
                await self.state.add_load(pod, -requests, -tokens)
        if cached_tokens is None:
            return
        predicted = decision.predicted_cached_tokens
        self.metrics.predicted_cached.inc(predicted)
        self.metrics.actual_cached.inc(cached_tokens)
        outcome = "exact" if cached_tokens == predicted else (
            "over" if predicted > cached_tokens else "under")
        self.metrics.prediction.labels(outcome).inc()

    async def report_failure(self, decision: RouteDecision, pod: str, now: float) -> None:
        """A call to ``pod`` failed (connect error, engine error before the first byte)."""
        if self.health.record_failure(pod, now):
            self.metrics.ejections.labels(pod).inc()
            log.warning("pod %s ejected after repeated failures", pod)

    async def release(self, decision: RouteDecision) -> None:
        """The request ended (any way): free the load it still holds. Idempotent."""
        for pod, held in decision._held.items():
            if held[0] or held[1]:
                await self.state.add_load(pod, -held[0], -held[1])
                held[0] = held[1] = 0

    # ----- internals --------------------------------------------------------
    async def _hold(self, decision: RouteDecision, pod: str, requests: int, tokens: int) -> None:
        held = decision._held.setdefault(pod, [0, 0])
        held[0] += requests
        held[1] += tokens
        await self.state.add_load(pod, requests, tokens)

    def _kv_free_tokens(self, name: str, session: str | None,
                        cached: Sequence[int]) -> int | None:
        """KV the pod can fill for this request without evicting what live
        sessions need (None: the pod has not reported its capacity)."""
        capacity = self.status[name].kv_capacity_blocks
        if not capacity:
            return None
        used = self.live.occupied_blocks(name, session, cached)
        return max(0, capacity - used) * self.settings.block_size

    def _block_hashes(self, req: RouteRequest) -> list[int]:
        # 100K tokens hash in about 2.3 ms (sha256) on this machine's cores: cheap
        # next to tokenization, so no per-session hash cache.
        return self.hasher.event_hashes(req.token_ids, req.cache_salt, req.lora)

    def _on_event_batch(self, pod: str, batch) -> None:
        self.metrics.kv_event_batches.labels(pod).inc()
        sub = self.subscribers.get(pod)
        if sub is not None:
            self.metrics.kv_event_gaps.labels(pod).set(sub.stats.gaps)
            self.metrics.kv_event_lost.labels(pod).set(sub.stats.lost)


def _reason_label(reason: str) -> str:
    """Bounded label values: the reason without pod names or numbers (it has none today)."""
    return reason
