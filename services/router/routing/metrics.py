"""Prometheus metrics of the routing core, on a registry passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.decisions = Counter("tandem_routing_decisions_total",
                                 "Routing decisions by policy and reason", ["policy", "reason"],
                                 registry=r)
        self.route_seconds = Histogram("tandem_routing_decision_seconds",
                                       "Time to hash, look up and choose (router overhead)",
                                       buckets=_FAST, registry=r)
        self.predicted_cached = Counter("tandem_routing_predicted_cached_tokens_total",
                                        "Cached prompt tokens the index predicted, on reported "
                                        "requests", registry=r)
        self.actual_cached = Counter("tandem_routing_actual_cached_tokens_total",
                                     "Cached prompt tokens the engines reported", registry=r)
        self.prediction = Counter("tandem_routing_prediction_total",
                                  "Predicted vs reported cached tokens: exact, over or under",
                                  ["outcome"], registry=r)
        self.pod_in_flight = Gauge("tandem_routing_pod_in_flight",
                                   "Requests in flight per pod, all router replicas", ["pod"],
                                   registry=r)
        self.pod_pending_tokens = Gauge("tandem_routing_pod_pending_prefill_tokens",
                                        "Uncached prompt tokens routed to a pod, prefill not "
                                        "done, all replicas", ["pod"], registry=r)
        self.pod_blocks = Gauge("tandem_routing_pod_cached_blocks",
                                "KV blocks the index believes a pod holds", ["pod"], registry=r)
        self.pod_live_blocks = Gauge("tandem_routing_pod_live_blocks",
                                     "KV blocks this replica's live sessions need on a pod "
                                     "(what eviction pricing protects)", ["pod"], registry=r)
        self.pod_kv_capacity = Gauge("tandem_routing_pod_kv_capacity_blocks",
                                     "KV cache size a pod reports, in blocks", ["pod"],
                                     registry=r)
        self.index_blocks = Gauge("tandem_routing_index_blocks",
                                  "Distinct block hashes in the prefix index", registry=r)
        self.index_evictions = Counter("tandem_routing_index_evictions_total",
                                       "Hashes dropped by the index's LRU bound", registry=r)
        self.retries = Counter("tandem_routing_retries_total",
                               "Requests routed again after a pod failed before the first "
                               "byte", ["pod"], registry=r)
        self.ejections = Counter("tandem_routing_ejections_total",
                                 "Pods ejected by their circuit breaker", ["pod"], registry=r)
        self.pod_available = Gauge("tandem_routing_pod_available",
                                   "1 when a pod takes new work (healthy, not draining, "
                                   "circuit closed)", ["pod"], registry=r)
        self.kv_event_batches = Counter("tandem_routing_kv_event_batches_total",
                                        "KV event batches applied", ["pod"], registry=r)
        self.kv_event_gaps = Gauge("tandem_routing_kv_event_gaps",
                                   "Sequence gaps seen on a pod's KV event stream", ["pod"],
                                   registry=r)
        self.kv_event_lost = Gauge("tandem_routing_kv_event_lost_batches",
                                   "KV event batches neither received nor replayable",
                                   ["pod"], registry=r)
        self.shared_state_up = Gauge("tandem_routing_shared_state_up",
                                     "1 while the Redis shared state is reachable", registry=r)
