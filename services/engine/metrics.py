"""The engine host's own Prometheus metrics (vLLM's `vllm:*` metrics are
registered in the same default registry by vLLM itself).

Per-request phases come from vLLM's own per-request timestamps
(``RequestOutput.metrics``, a ``RequestStateStats``: when the request entered
the scheduler's queue, when it was first scheduled, when its first token came
out; all taken in the engine core, so they compare with each other):

* a request that computes its prompt here (prefill, aggregated, or a decode
  engine prefilling a short remainder itself): ``queue`` = queued → first
  scheduled, ``prefill`` = first scheduled → first token (the uncached part's
  compute, every chunk of it, and any preemption in between);
* a decode request whose KV comes from a prefill engine over NIXL: vLLM
  schedules it only once the KV is in, so ``kv_pull`` = queued → scheduled
  (the NIXL handshake and transfer, plus any wait for free KV blocks or a
  sequence slot) and ``first_decode_step`` = scheduled → first token;
* every request: ``admission`` = the engine host received it → vLLM's
  scheduler queued it. vLLM's engine core takes new requests in only between
  steps, so a request that arrives during a long step (a whole 2K-token
  prefill is one step) waits here, where vLLM's own queue time does not see
  it. (The host's and the engine core's ``time.monotonic()`` are the same
  system-wide clock.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

from common.scheduler import SETTINGS

# From a few milliseconds (a cached prompt) to minutes (a long prompt queued
# behind others on a busy CPU).
_PHASE_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


def request_phases(stats: Any, remote_kv: bool, received: float | None = None) -> dict[str, float]:
    """Seconds per phase of one request from vLLM's ``RequestStateStats`` as
    it stands at the request's first output, and from `received`, the
    host's ``time.monotonic()`` when the request reached it; empty when vLLM
    kept no stats or the request never got scheduled."""
    if stats is None or not (stats.queued_ts and stats.scheduled_ts and stats.first_token_ts):
        return {}
    phases = {} if received is None else {"admission": max(0.0, stats.queued_ts - received)}
    waited = stats.scheduled_ts - stats.queued_ts
    computed = stats.first_token_ts - stats.scheduled_ts
    if remote_kv:
        return {**phases, "kv_pull": waited, "first_decode_step": computed}
    return {**phases, "queue": waited, "prefill": computed}


class EngineMetrics:
    def __init__(self, role: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.role = role
        self.requests = Counter(
            "tandem_engine_requests_total",
            "Requests received, by kind (prefill or generate)",
            ["kind"],
            registry=registry,
        )
        self.cancelled = Counter(
            "tandem_engine_requests_cancelled_total",
            "Requests whose caller went away (aborted in vLLM)",
            ["kind"],
            registry=registry,
        )
        self.errors = Counter(
            "tandem_engine_request_errors_total",
            "Requests that ended in an error, by kind and reason",
            ["kind", "reason"],
            registry=registry,
        )
        self.kv_released = Counter(
            "tandem_engine_kv_released_total",
            "Prefill KV leases released early through ReleaseKv",
            registry=registry,
        )
        self.phases = {
            "admission": Histogram(
                "tandem_engine_admission_seconds",
                "Every request: from the engine host receiving it to vLLM's scheduler "
                "queueing it (new requests wait out the engine step in progress)",
                ["role"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
            "queue": Histogram(
                "tandem_engine_queue_seconds",
                "Requests that compute their prompt here: time in vLLM's waiting queue "
                "before first scheduled",
                ["role"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
            "prefill": Histogram(
                "tandem_engine_prefill_seconds",
                "Requests that compute their prompt here: first scheduled to first token "
                "(every chunk of the uncached part)",
                ["role"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
            "kv_pull": Histogram(
                "tandem_engine_kv_pull_seconds",
                "Decode requests with a prefill engine's KV: queued until the KV is pulled "
                "over NIXL and the request scheduled",
                ["role"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
            "first_decode_step": Histogram(
                "tandem_engine_first_decode_step_seconds",
                "Decode requests with a prefill engine's KV: scheduled to first token",
                ["role"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
        }
        self.scheduler = Info(
            "tandem_engine_scheduler",
            "The vLLM scheduler settings this engine runs with",
            registry=registry,
        )
        # A gauge rather than a count of stalls: the host exits right after
        # one, before a scrape would see the count (Kubernetes counts restarts).
        self.without_progress = Gauge(
            "tandem_engine_seconds_without_progress",
            "Seconds the engine has had requests in flight without taking an engine step "
            "(0 when idle or stepping); at --stall-timeout-s the host fails them and exits",
            ["role"],
            registry=registry,
        )

    def watch_progress(self, seconds_without_progress: Callable[[], float]) -> None:
        """Read the gauge from ``seconds_without_progress`` at each scrape."""
        self.without_progress.labels(self.role).set_function(seconds_without_progress)

    def observe_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phases[phase].labels(self.role).observe(seconds)

    def describe_scheduler(self, scheduler_config: Any) -> None:
        """Publish the scheduler settings in effect (vLLM's defaults resolved)."""

        def text(value: Any) -> str:
            return str(value).lower() if isinstance(value, bool) else str(value)

        settings = {
            s: text(getattr(scheduler_config, s)) for s in (*SETTINGS, "enable_chunked_prefill")
        }
        self.scheduler.info({"role": self.role, **settings})
