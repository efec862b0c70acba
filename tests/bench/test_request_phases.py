"""Per-request phases from engine logs, joined to replay records (no server)."""

from __future__ import annotations

import pytest

from bench.request_phases import SLOWEST_HEADER, join, parse_engine_log, queue_ahead, slowest_table

PREFILL_LOG = """\
2026-12-01 18:00:00,000 INFO engine-prefill services.engine.server: engine ready
2026-12-01 18:00:10,000 DEBUG engine-prefill services.engine.servicer: request fork-1 \
(prefill, 1600, 512 cached): ignored, the count has no 'prompt tokens'
2026-12-01 18:00:10,000 DEBUG engine-prefill services.engine.servicer: request fork-1 \
(prefill, 1600 prompt tokens, 512 cached): queue 0.000s prefill 4.000s
2026-12-01 18:00:14,000 DEBUG engine-prefill services.engine.servicer: request fork-2 \
(prefill, 1600 prompt tokens, 512 cached): queue 3.500s prefill 4.000s
2026-12-01 18:00:20,500 DEBUG engine-prefill services.engine.servicer: request first \
(prefill, 2540 prompt tokens, None cached): queue 5.000s prefill 6.000s
"""
DECODE_LOG = """\
2026-12-01 18:00:21,000 DEBUG engine-decode services.engine.servicer: request first \
(generate, 2540 prompt tokens, 2540 cached): admission 0.200s kv_pull 0.300s \
first_decode_step 0.100s
2026-12-01 18:00:22,000 DEBUG engine-decode services.engine.servicer: request append \
(generate, 2600 prompt tokens, 2540 cached): queue 0.050s prefill 0.400s
"""


def _entries():
    return parse_engine_log(PREFILL_LOG, "prefill-0") + parse_engine_log(DECODE_LOG, "decode-0")


def test_phase_lines_parse_with_their_arrival_and_unknown_cached_counts():
    first = parse_engine_log(PREFILL_LOG, "prefill-0")[-1]
    assert first["id"] == "first" and first["kind"] == "prefill"
    assert first["prompt_tokens"] == 2540 and first["cached_tokens"] is None
    assert first["phases"] == {"queue": 5.0, "prefill": 6.0}
    assert first["first_output"] - first["arrived"] == pytest.approx(11.0)
    assert len(parse_engine_log(PREFILL_LOG, "prefill-0")) == 3  # the malformed line skipped


def test_queue_ahead_counts_what_had_not_produced_output_on_the_same_engine():
    entries = _entries()
    first = next(e for e in entries if e["id"] == "first" and e["kind"] == "prefill")
    # arrived 18:00:09.5: fork-1 (out at :10) and fork-2 (arrived 6.5, out at :14) ahead
    assert queue_ahead(first, entries) == {"requests": 2, "uncached_tokens": 2 * 1088}


def _record(rid: str, ttft: float, agent: str = "", ok: bool = True) -> dict:
    return {
        "ok": ok,
        "ttft": ttft,
        "response_id": rid,
        "session": "s1",
        "agent": agent,
        "turn": 0,
        "start": 3.0,
        "prompt_tokens": 2540,
        "cached_tokens": 0,
    }


def test_records_join_prefill_and_decode_phases_and_the_rest_is_other():
    rows = join(
        [
            _record("first", 11.7),
            _record("append", 0.5),
            _record("lost", 1.0),
            _record("failed", None, ok=False),
        ],
        _entries(),
    )
    assert [r["ttft"] for r in rows] == [11.7, 0.5, 1.0]
    first, append, lost = rows
    assert first["phases"] == {
        "prefill.queue": 5.0,
        "prefill.prefill": 6.0,
        "decode.admission": 0.2,
        "decode.kv_pull": 0.3,
        "decode.first_decode_step": 0.1,
    }
    assert first["prefilled_on"] == "prefill-0" and first["ahead"]["requests"] == 2
    assert first["other"] == pytest.approx(0.1)
    assert append["prefilled_on"] == "decode-0" and append["phases"] == {
        "prefill.queue": 0.05,
        "prefill.prefill": 0.4,
    }
    assert lost["phases"] == {} and lost["other"] is None and lost["ahead"] is None


def test_slowest_table_lists_the_slowest_first_in_the_header_columns():
    rows = join([_record("first", 11.7, agent="sa1"), _record("append", 0.5)], _entries())
    lines = slowest_table("pd-off", rows, 1)
    assert len(lines) == 1
    assert lines[0].startswith(
        "| pd-off | s1/sa1/0 | 3.0 | 11.70 | 2540 (0 cached) | prefill-0 "
        "| — | 5.00 | 6.00 | 0.20 | 0.30 | 0.10 | 0.10 | 2 (2176 tok) |"
    )
    assert lines[0].count("|") == SLOWEST_HEADER[0].count("|")
