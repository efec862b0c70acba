"""The router's Prometheus metrics, created once and passed where needed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0)
# Queue waits run from nothing up to --queue-timeout (default 30 s).
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_router_requests_total",
                                "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.overhead = Histogram("tandem_router_overhead_seconds",
                                  "Router's own added latency: request in to first gRPC call out",
                                  buckets=_FAST_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_router_ttft_seconds",
                              "Time to first token as the router sees it", registry=r)
        self.pod_in_flight = Gauge("tandem_router_pod_in_flight",
                                   "Requests the router has in flight per pod", ["pod", "role"],
                                   registry=r)
        self.pod_healthy = Gauge("tandem_router_pod_healthy",
                                 "1 if the pod passes health checks", ["pod", "role"], registry=r)
        self.retries = Counter("tandem_router_retries_total",
                               "Requests retried on another pod before the first byte, by stage",
                               ["stage"], registry=r)
        self.local_prefill = Counter("tandem_router_local_prefill_total",
                                     "Requests whose prompt the decode pod computed itself, "
                                     "by reason", ["reason"], registry=r)
        self.kv_released = Counter("tandem_router_kv_released_total",
                                   "Prefill KV leases released early (decode failed or client "
                                   "left)", registry=r)
        self.client_disconnects = Counter("tandem_router_client_disconnects_total",
                                          "Requests aborted because the client went away",
                                          registry=r)
        # Admission (services/router/admission.py) and API keys (auth.py).
        self.running = Gauge("tandem_router_requests_running",
                             "Generation requests admitted and not yet finished", registry=r)
        self.queued = Gauge("tandem_router_requests_queued",
                            "Generation requests waiting for a slot", registry=r)
        self.rejected = Counter("tandem_router_requests_rejected_total",
                                "Generation requests refused with 429, by reason "
                                "(queue_full, queue_timeout)", ["reason"], registry=r)
        self.queue_wait = Histogram("tandem_router_queue_wait_seconds",
                                    "Time admitted generation requests waited for a slot",
                                    buckets=_QUEUE_BUCKETS, registry=r)
        self.auth_failures = Counter("tandem_router_auth_failures_total",
                                     "Requests refused with 401, by reason (missing, invalid)",
                                     ["reason"], registry=r)
        # What each pool did, by role, for the rate-matching controller
        # (operators/planner): demand, hit rate and, from busy time (the sum of
        # the time requests spent in the pool), the pool's mean load.
        self.pool_prompts = Counter("tandem_router_pool_prompts_total",
                                    "Prompts a pool computed, by role", ["role"], registry=r)
        self.pool_prompt_tokens = Counter("tandem_router_pool_prompt_tokens_total",
                                          "Prompt tokens of those prompts, cached included",
                                          ["role"], registry=r)
        self.pool_cached_tokens = Counter("tandem_router_pool_cached_tokens_total",
                                          "Prompt tokens a pool found in its prefix cache",
                                          ["role"], registry=r)
        self.pool_generations = Counter("tandem_router_pool_generations_total",
                                        "Generations a pool finished, by role", ["role"],
                                        registry=r)
        self.pool_output_tokens = Counter("tandem_router_pool_output_tokens_total",
                                          "Output tokens a pool generated, by role", ["role"],
                                          registry=r)
        self.pool_busy = Counter("tandem_router_pool_busy_seconds_total",
                                 "Seconds requests spent in a pool's Prefill or Generate "
                                 "calls, summed (÷ elapsed time = mean requests in flight)",
                                 ["role"], registry=r)
        # KV store retention hints (services/router/retention.py).
        self.retention_hints = Counter("tandem_router_kv_retention_hints_total",
                                       "Requests sent with a KV store retention hint, by kind "
                                       "(pin, release)", ["kind"], registry=r)
        self.retention_sessions = Gauge("tandem_router_kv_retention_sessions",
                                        "Sessions whose KV the router currently keeps pinned",
                                        registry=r)

    def count_prompt(self, role: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.pool_prompts.labels(role).inc()
        self.pool_prompt_tokens.labels(role).inc(prompt_tokens)
        self.pool_cached_tokens.labels(role).inc(cached_tokens)

    def count_generation(self, role: str, output_tokens: int) -> None:
        self.pool_generations.labels(role).inc()
        self.pool_output_tokens.labels(role).inc(output_tokens)
