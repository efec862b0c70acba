"""The long-prefill benchmark's plan and figures, on hand-built records (no
server)."""

from __future__ import annotations

import pytest

from bench.long_prefill import Config, long_requests, parse_thresholds, plan, summarize


def test_thresholds_start_with_off_and_name_bad_values():
    assert parse_thresholds("off,512,2048") == [0, 512, 2048]
    with pytest.raises(ValueError, match="'lots' is neither"):
        parse_thresholds("off,lots")
    with pytest.raises(ValueError, match="the first must be 'off'"):
        parse_thresholds("512,off")


def test_configurations_interleave_and_every_second_round_runs_backwards():
    order = [c.label for c in plan(["agg", "pd"], [0, 512], rounds=2)]
    assert order == [
        "agg-off",
        "pd-off",
        "agg-512",
        "pd-512",
        "pd-512",
        "agg-512",
        "pd-off",
        "agg-off",
    ]


def _record(ttft: float, prompt: int, cached: int, out: int = 10, e2e: float = 2.0) -> dict:
    return {
        "ok": True,
        "start": 0.0,
        "ttft": ttft,
        "e2e": e2e,
        "itl": None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out,
        "expected_prompt_tokens": prompt,
        "turn": 0,
    }


def test_long_requests_are_those_with_many_uncached_tokens():
    records = [_record(5.0, 2000, 512), _record(0.5, 2100, 2048), _record(1.0, 1500, 476)]
    assert [r["ttft"] for r in long_requests(records, 1024)] == [5.0, 1.0]


def test_runs_pool_into_per_core_throughput_and_long_ttft():
    runs = [
        {
            "records": [_record(4.0, 2000, 0), _record(0.5, 2000, 1900)],
            "summary": {"duration_s": 10.0},
        },
        {"records": [_record(6.0, 2000, 0)], "summary": {"duration_s": 10.0}},
    ]
    row = summarize(Config("pd", 512), runs, long_tokens=1024)
    assert row["runs"] == 2 and row["requests"] == 3
    assert row["tpgs"] == pytest.approx((3 * 2000 + 3 * 10) / 20.0 / 2)  # two engine cores
    assert row["long_requests"] == 2
    assert row["long_ttft_p50"] == 5.0 and row["long_ttft_max"] == 6.0


def test_the_step_budget_is_set_for_every_pool_or_the_pools_named():
    from bench.long_prefill import _per_pool_batched_tokens

    assert _per_pool_batched_tokens("8192") == {"prefill": 8192, "decode": 8192, "aggregated": 8192}
    assert _per_pool_batched_tokens("decode=256") == {"decode": 256}
    with pytest.raises(Exception, match="POOL=VALUE"):
        _per_pool_batched_tokens("router=256")
