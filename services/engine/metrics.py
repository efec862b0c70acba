"""The engine host's own Prometheus metrics (vLLM's `vllm:*` metrics are
registered in the same default registry by vLLM itself)."""

from __future__ import annotations

from prometheus_client import Counter


class EngineMetrics:
    def __init__(self) -> None:
        self.requests = Counter("tandem_engine_requests_total",
                                "Requests received, by kind (prefill or generate)", ["kind"])
        self.cancelled = Counter("tandem_engine_requests_cancelled_total",
                                 "Requests whose caller went away (aborted in vLLM)", ["kind"])
        self.errors = Counter("tandem_engine_request_errors_total",
                              "Requests that ended in an error, by kind and reason",
                              ["kind", "reason"])
        self.kv_released = Counter("tandem_engine_kv_released_total",
                                   "Prefill KV leases released early through ReleaseKv")
