"""Per-request phases from vLLM's own per-request timestamps
(`RequestStateStats`, the real class), and their histograms."""

from __future__ import annotations

from prometheus_client import REGISTRY
from vllm.v1.metrics.stats import RequestStateStats

from services.engine.metrics import EngineMetrics, request_phases


def _stats(queued: float, scheduled: float, first_token: float) -> RequestStateStats:
    return RequestStateStats(
        arrival_time=1.7e9, queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first_token
    )


def test_a_prompt_computed_here_splits_into_queue_and_prefill():
    phases = request_phases(_stats(100.0, 100.25, 102.0), remote_kv=False)
    assert phases == {"queue": 0.25, "prefill": 1.75}


def test_a_decode_with_remote_kv_splits_into_kv_pull_and_first_step():
    phases = request_phases(_stats(100.0, 100.5, 100.625), remote_kv=True)
    assert phases == {"kv_pull": 0.5, "first_decode_step": 0.125}


def test_the_wait_before_vllm_queues_a_request_is_its_admission():
    phases = request_phases(_stats(100.0, 100.25, 102.0), remote_kv=False, received=96.5)
    assert phases == {"admission": 3.5, "queue": 0.25, "prefill": 1.75}
    remote = request_phases(_stats(100.0, 100.5, 100.625), remote_kv=True, received=100.0)
    assert remote == {"admission": 0.0, "kv_pull": 0.5, "first_decode_step": 0.125}


def test_no_phases_without_stats_or_before_scheduling():
    assert request_phases(None, remote_kv=False) == {}
    assert request_phases(_stats(100.0, 0.0, 0.0), remote_kv=False) == {}


def test_phases_land_in_histograms_labelled_by_role():
    metrics = EngineMetrics("decode")
    metrics.observe_phases({"kv_pull": 0.5, "first_decode_step": 0.125})

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"role": "decode"})

    assert sample("tandem_engine_kv_pull_seconds_count") == 1
    assert sample("tandem_engine_kv_pull_seconds_sum") == 0.5
    assert sample("tandem_engine_first_decode_step_seconds_sum") == 0.125
    assert sample("tandem_engine_queue_seconds_count") is None  # never observed
