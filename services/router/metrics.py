"""The router's Prometheus metrics: one registry, each fact once.

``tandem_router_*``: the request path (HTTP, admission, API keys, P/D calls,
retention hints) and the pods as this replica sees them. ``tandem_routing_*``:
the routing core's decisions, its prefix index and the engines' KV event
streams. Metrics of pods are read from the routing core when scraped
(``watch``), so a pod that leaves takes its series with it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.router.pods import PodPool
from services.router.routing import RouteDecision, RoutingCore
from services.router.routing.core import POD_STATES
from services.router.routing.shared_state import LocalState

_FAST_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
_ROUTE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# Queue waits run from nothing up to --queue-timeout-s (default 30 s).
_QUEUE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)


# The stages of the router's own work on a request, in order (label `stage` of
# tandem_router_stage_seconds): the chat template, tokenization, the prompt's
# block hashes, the prefix index and policy, the shared-state store (Redis)
# read and write, and the gRPC call to the engine up to its first message
# (which includes the engine's own time to first token).
STAGES = ("template", "tokenize", "hash", "index", "state", "grpc")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests_total",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.overhead = Histogram(
            "tandem_router_overhead_seconds",
            "Router's own added latency: request in to first gRPC call out",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds", "Time to first token as the router sees it", registry=r
        )
        self.stage_seconds = Histogram(
            "tandem_router_stage_seconds",
            "Router's own work per request by stage (template, tokenize, hash, index, "
            "state, grpc), observed at the first token",
            ["stage"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "tandem_router_retries_total",
            "Requests retried on another pod before the first byte, by stage",
            ["stage"],
            registry=r,
        )
        self.local_prefill = Counter(
            "tandem_router_local_prefill_total",
            "Requests whose prompt the decode pod computed itself, by reason",
            ["reason"],
            registry=r,
        )
        self.kv_released = Counter(
            "tandem_router_kv_released_total",
            "Prefill KV leases released early (decode failed or client left)",
            registry=r,
        )
        self.client_disconnects = Counter(
            "tandem_router_client_disconnects_total",
            "Requests aborted because the client went away",
            registry=r,
        )
        # Request migration (services/router/migration.py).
        self.migrations = Counter(
            "tandem_router_migrations_total",
            "Requests whose decode pod was lost mid-stream, by outcome: resumed on another "
            "pod, failed (no pod could take it), disabled, refused_limit, refused_deadline, "
            "refused_unsupported",
            ["outcome"],
            registry=r,
        )
        self.migrated_tokens = Counter(
            "tandem_router_migrated_tokens_total",
            "Generated tokens carried into resumed requests (their prompt grew by these)",
            registry=r,
        )
        self.migration_seconds = Histogram(
            "tandem_router_migration_seconds",
            "Time to resume a migrated request: decode pod lost to the next message",
            registry=r,
        )
        # Admission (services/router/admission.py) and API keys (auth.py).
        self.running = Gauge(
            "tandem_router_requests_running",
            "Generation requests admitted and not yet finished",
            registry=r,
        )
        self.queued = Gauge(
            "tandem_router_requests_queued", "Generation requests waiting for a slot", registry=r
        )
        self.rejected = Counter(
            "tandem_router_requests_rejected_total",
            "Generation requests refused with 429, by reason (queue_full, queue_timeout)",
            ["reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "tandem_router_queue_wait_seconds",
            "Time admitted generation requests waited for a slot",
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter(
            "tandem_router_rate_limited_total",
            "Requests refused with 429 by a per-client rate limit, by limit (requests, tokens)",
            ["limit"],
            registry=r,
        )
        self.auth_failures = Counter(
            "tandem_router_auth_failures_total",
            "Requests refused with 401, by reason (missing, invalid)",
            ["reason"],
            registry=r,
        )
        # What each pool did, by role, for the rate-matching controller
        # (operators/planner): demand, hit rate and, from busy time (the sum of
        # the time requests spent in the pool), the pool's mean load.
        self.pool_prompts = Counter(
            "tandem_router_pool_prompts_total",
            "Prompts a pool computed, by role",
            ["role"],
            registry=r,
        )
        self.pool_prompt_tokens = Counter(
            "tandem_router_pool_prompt_tokens_total",
            "Prompt tokens of those prompts, cached included",
            ["role"],
            registry=r,
        )
        self.pool_cached_tokens = Counter(
            "tandem_router_pool_cached_tokens_total",
            "Prompt tokens a pool found in its prefix cache",
            ["role"],
            registry=r,
        )
        self.pool_generations = Counter(
            "tandem_router_pool_generations_total",
            "Generations a pool finished, by role",
            ["role"],
            registry=r,
        )
        self.pool_output_tokens = Counter(
            "tandem_router_pool_output_tokens_total",
            "Output tokens a pool generated, by role",
            ["role"],
            registry=r,
        )
        self.pool_busy = Counter(
            "tandem_router_pool_busy_seconds_total",
            "Seconds requests spent in a pool's Prefill or Generate "
            "calls, summed (÷ elapsed time = mean requests in flight)",
            ["role"],
            registry=r,
        )
        # KV store retention hints (services/router/retention.py).
        self.retention_hints = Counter(
            "tandem_router_kv_retention_hints_total",
            "Requests sent with a KV store retention hint, by kind (pin, release)",
            ["kind"],
            registry=r,
        )
        self.retention_sessions = Gauge(
            "tandem_router_kv_retention_sessions",
            "Sessions whose KV the router currently keeps pinned",
            registry=r,
        )
        # Session KV prefetch (services/router/prefetch.py).
        self.prefetches = Counter(
            "tandem_router_prefetches_total",
            "Session KV prefetches (load-only requests between turns) by "
            "outcome: started, completed, cancelled (the session's turn "
            "came first), failed",
            ["outcome"],
            registry=r,
        )
        self.prefetch_tokens = Counter(
            "tandem_router_prefetch_tokens_total",
            "Prompt tokens completed prefetches warmed (missing on the pod when decided)",
            registry=r,
        )
        # Pod discovery from Kubernetes EndpointSlices (services/router/discovery.py).
        self.discovery_changes = Counter(
            "tandem_router_discovery_changes_total",
            "Pod set changes from EndpointSlices (added, draining, ready_again, removed)",
            ["change"],
            registry=r,
        )
        self.discovery_events = Counter(
            "tandem_router_discovery_watch_events_total",
            "EndpointSlice watch events by type (added, modified, deleted)",
            ["type"],
            registry=r,
        )
        self.discovery_lists = Counter(
            "tandem_router_discovery_lists_total",
            "Full EndpointSlice lists (at start and after a watch is lost)",
            registry=r,
        )
        self.discovery_restarts = Counter(
            "tandem_router_discovery_watch_restarts_total",
            "EndpointSlice watches ended, by reason (timeout: "
            "the server's, rewatched; gone: 410, relisted; "
            "error: relisted after a pause)",
            ["reason"],
            registry=r,
        )
        self.discovery_up = Gauge(
            "tandem_router_discovery_up",
            "1 while the API server answers the EndpointSlice list/watch, 0 after an "
            "error (the router keeps routing to the pods it last knew)",
            registry=r,
        )
        self.discovery_last_sync = Gauge(
            "tandem_router_discovery_last_sync_timestamp_seconds",
            "When the API server last confirmed the pod set (a list, a watch event "
            "or bookmark), Unix time; 0 before the first",
            registry=r,
        )
        # Routing decisions (services/router/routing).
        self.decisions = Counter(
            "tandem_routing_decisions_total",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "tandem_routing_decision_seconds",
            "Time to hash, look up and choose (router overhead)",
            buckets=_ROUTE_BUCKETS,
            registry=r,
        )
        self.predicted_cached = Counter(
            "tandem_routing_predicted_cached_tokens_total",
            "Cached prompt tokens the index predicted, on reported requests",
            registry=r,
        )
        self.actual_cached = Counter(
            "tandem_routing_actual_cached_tokens_total",
            "Cached prompt tokens the engines reported",
            registry=r,
        )
        self.prediction = Counter(
            "tandem_routing_prediction_total",
            "Predicted vs reported cached tokens: exact, over or under",
            ["outcome"],
            registry=r,
        )
        # Request classes (routing/classes.py): long fresh prefills vs append turns.
        self.class_ttft = Histogram(
            "tandem_router_class_ttft_seconds",
            "Time to first token as the router sees it, by request class (long, append)",
            ["class"],
            registry=r,
        )
        _memoize_children(vars(self).values())

    def count_decision(self, policy: str, decision: RouteDecision, seconds: float) -> None:
        self.decisions.labels(policy, decision.reason).inc()
        self.decision_seconds.observe(seconds)

    def observe_stages(self, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.stage_seconds.labels(stage).observe(seconds)

    def observe_ttft(self, decision: RouteDecision, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.class_ttft.labels(decision.request_class).observe(seconds)

    def count_cached(self, decision: RouteDecision, cached_tokens: int) -> None:
        """The engine that computed the prompt reported its cached tokens."""
        predicted = decision.predicted_cached_tokens
        self.predicted_cached.inc(predicted)
        self.actual_cached.inc(cached_tokens)
        outcome = (
            "exact"
            if cached_tokens == predicted
            else ("over" if predicted > cached_tokens else "under")
        )
        self.prediction.labels(outcome).inc()

    def count_prompt(self, role: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.pool_prompts.labels(role).inc()
        self.pool_prompt_tokens.labels(role).inc(prompt_tokens)
        self.pool_cached_tokens.labels(role).inc(cached_tokens)

    def count_generation(self, role: str, output_tokens: int) -> None:
        self.pool_generations.labels(role).inc()
        self.pool_output_tokens.labels(role).inc(output_tokens)

    def watch(self, core: RoutingCore, pool: PodPool, state: LocalState) -> None:
        """Expose the pods, the index and the shared state as they are at each scrape."""
        self.registry.register(_RoutingCollector(core, pool, state))

    def watch_tables(self, tables: Callable[[], Iterable[TableSize]]) -> None:
        """Expose the size and the evictions of each bounded table at each scrape."""
        self.registry.register(_TableCollector(tables))


def _memoize_children(metrics: Iterable[object]) -> None:
    """Each labelled metric's ``labels`` looks a child up once per label
    values: prometheus_client validates and locks on every call (~1.2 us, a
    dozen calls a streamed request). The router never removes a series, so
    the child remembered is always the one exported, and there are as many
    as the metric holds anyway."""
    for metric in metrics:
        if isinstance(metric, Counter | Gauge | Histogram) and metric._labelnames:
            metric.labels = functools.cache(metric.labels)  # type: ignore[method-assign]


@dataclass(frozen=True)
class TableSize:
    """A table that grows with traffic, as /metrics shows it (docs/operate.md,
    "Memory bounds")."""

    table: str
    entries: int
    evictions: int  # entries its bound dropped (not those that expired)
    capacity: int | None = None  # its bound, where one number is it


class _TableCollector(Collector):
    def __init__(self, tables: Callable[[], Iterable[TableSize]]) -> None:
        self._tables = tables

    def collect(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily(
            "tandem_router_table_entries",
            "Entries in each table that grows with traffic (prefix index, sessions, caches)",
            labels=["table"],
        )
        evictions = CounterMetricFamily(
            "tandem_router_table_evictions",
            "Entries a table's memory bound dropped before they expired",
            labels=["table"],
        )
        capacity = GaugeMetricFamily(
            "tandem_router_table_capacity",
            "Most entries a table keeps (the prefix index's follows the pods' KV blocks "
            "unless --routing-index-capacity is set)",
            labels=["table"],
        )
        for t in self._tables():
            entries.add_metric([t.table], t.entries)
            evictions.add_metric([t.table], t.evictions)
            if t.capacity is not None:
                capacity.add_metric([t.table], t.capacity)
        yield entries
        yield evictions
        yield capacity


class _RoutingCollector(Collector):
    def __init__(self, core: RoutingCore, pool: PodPool, state: LocalState) -> None:
        self._core = core
        self._pool = pool
        self._state = state

    def collect(self) -> Iterator[Metric]:
        reports = self._core.report(time.monotonic())
        in_flight = GaugeMetricFamily(
            "tandem_router_pod_in_flight",
            "Requests this router has in flight per pod",
            labels=["pod", "role"],
        )
        state = GaugeMetricFamily(
            "tandem_router_pod_state",
            "1 for the pod's state: available (takes new work), "
            "draining, ejected (circuit open) or unhealthy",
            labels=["pod", "role", "state"],
        )
        pending = GaugeMetricFamily(
            "tandem_routing_pod_pending_prefill_tokens",
            "Uncached prompt tokens this router sent to a pod whose prefill is not done",
            labels=["pod"],
        )
        cached = GaugeMetricFamily(
            "tandem_routing_pod_cached_blocks",
            "KV blocks the index believes a pod holds",
            labels=["pod"],
        )
        live = GaugeMetricFamily(
            "tandem_routing_pod_live_blocks",
            "KV blocks this router's live sessions need on a pod (what eviction pricing protects)",
            labels=["pod"],
        )
        capacity = GaugeMetricFamily(
            "tandem_routing_pod_kv_capacity_blocks",
            "KV cache size a pod reports, in blocks",
            labels=["pod"],
        )
        engine = GaugeMetricFamily(
            "tandem_router_pod_engine_requests",
            "Requests a pod's engine reported at the last load poll, "
            "by state (running, waiting): every router's, and up to "
            "one poll interval old",
            labels=["pod", "state"],
        )
        ejections = CounterMetricFamily(
            "tandem_routing_ejections", "Pods ejected by their circuit breaker", labels=["pod"]
        )
        classes = CounterMetricFamily(
            "tandem_routing_class_requests",
            "Routing decisions by request class (long, append) and "
            "the pod that computes the prompt (a retry decides "
            "again)",
            labels=["class", "pod"],
        )
        for r in reports:
            in_flight.add_metric([r.name, r.role], r.in_flight)
            for s in POD_STATES:
                state.add_metric([r.name, r.role, s], 1.0 if r.state == s else 0.0)
            pending.add_metric([r.name], r.pending_prefill_tokens)
            cached.add_metric([r.name], r.cached_blocks)
            live.add_metric([r.name], r.live_blocks)
            capacity.add_metric([r.name], r.kv_capacity_blocks)
            engine.add_metric([r.name, "running"], r.engine_running)
            engine.add_metric([r.name, "waiting"], r.engine_waiting)
            ejections.add_metric([r.name], r.ejections)
            for request_class, count in sorted(r.class_counts.items()):
                classes.add_metric([request_class, r.name], count)
        yield from (in_flight, state, pending, cached, live, capacity, engine, ejections, classes)
        batches = CounterMetricFamily(
            "tandem_routing_kv_event_batches", "KV event batches applied", labels=["pod"]
        )
        gaps = GaugeMetricFamily(
            "tandem_routing_kv_event_gaps",
            "Sequence gaps seen on a pod's KV event stream",
            labels=["pod"],
        )
        lost = GaugeMetricFamily(
            "tandem_routing_kv_event_lost_batches",
            "KV event batches neither received nor replayable",
            labels=["pod"],
        )
        for pod in self._pool.pods:
            if pod.events is not None:
                stats = pod.events.stats
                batches.add_metric([pod.address], stats.batches)
                gaps.add_metric([pod.address], stats.gaps)
                lost.add_metric([pod.address], stats.lost)
        yield from (batches, gaps, lost)
        if self._state.shared:
            yield GaugeMetricFamily(
                "tandem_routing_shared_state_up",
                "1 while the Redis shared state is reachable",
                value=1.0 if self._state.up else 0.0,
            )
