"""Metric formulas on hand-built timings, and the report on them.
No mocks, no server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.agentx import report
from tandem.workload import metrics
from tandem.workload.runs import make_run, write_run


def rec(start, ttft, e2e, out, prompt, cached, turn=0, ok=True, error=None):
    return {
        "session": "s",
        "agent": "",
        "turn": turn,
        "lane": 0,
        "start": start,
        "trace_in": prompt - 6,
        "trace_out": out,
        "max_tokens": out,
        "expected_prompt_tokens": prompt,
        "ok": ok,
        "status": 200 if ok else 500,
        "error": error,
        "ttft": ttft if ok else None,
        "e2e": e2e if ok else None,
        "itl": (e2e - ttft) / (out - 1) if ok and out > 1 else None,
        "prompt_tokens": prompt if ok else None,
        "cached_tokens": cached if ok else None,
        "output_tokens": out if ok else None,
        "max_gap": None,
    }


RECORDS = [
    rec(0.0, 0.5, 2.5, 11, 1000, 0, turn=0),  # e2e/out = 0.227
    rec(1.0, 0.1, 1.1, 11, 1000, 900, turn=1),  # 0.1
    rec(2.0, 0.2, 4.2, 21, 2000, 1800, turn=1),  # 0.2
    rec(3.0, 1.0, 7.0, 5, 500, 0, turn=2),  # 1.4
    rec(4.0, None, None, 0, 0, 0, ok=False, error="HTTP 500: boom"),
    rec(5.0, None, None, 0, 0, 0, ok=False, error="interrupted"),
]


def test_summary_formulas():
    s = metrics.summarize(RECORDS)
    assert (s["requests"], s["ok"], s["failures"], s["interrupted"]) == (6, 4, 1, 1)
    assert s["failure_kinds"] == {"HTTP 500: boom": 1}
    # duration: first start (0.0) to last end (3.0 + 7.0)
    assert s["duration_s"] == pytest.approx(10.0)
    # TTFT over ok requests [0.1, 0.2, 0.5, 1.0], linear interpolation
    assert s["ttft_p50"] == pytest.approx(0.35)
    assert s["ttft_p90"] == pytest.approx(0.5 + 0.7 * 0.5)
    assert s["ttft_p99"] == pytest.approx(0.5 + 0.97 * 0.5)
    # ITL: (e2e - ttft) / (out - 1) = [0.2, 0.1, 0.2, 1.5]
    assert s["itl_p50"] == pytest.approx(0.2)
    # P90 interactivity = 1 / P90(e2e / out); values [0.1, 0.2, 0.2273, 1.4]
    per_tok = sorted([2.5 / 11, 1.1 / 11, 4.2 / 21, 7.0 / 5])
    p90 = per_tok[2] + 0.7 * (per_tok[3] - per_tok[2])
    assert s["interactivity_p90"] == pytest.approx(1 / p90)
    # throughput: (prompt incl. cached + output) / duration
    assert s["prompt_tokens"] == 4500 and s["output_tokens"] == 48
    assert s["total_tokens_per_s"] == pytest.approx((4500 + 48) / 10.0)
    assert s["output_tokens_per_s"] == pytest.approx(4.8)
    assert s["hit_rate"] == pytest.approx(2700 / 4500)
    assert s["prompt_tokens_mismatch"] == 0


def test_hit_rate_missing_when_server_does_not_report_cached():
    rs = [dict(r, cached_tokens=None) for r in RECORDS[:2]]
    assert metrics.summarize(rs)["hit_rate"] is None


def test_per_turn_and_pareto():
    rows = metrics.per_turn(RECORDS)
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert rows[1]["hit_rate"] == pytest.approx(2700 / 3000)
    assert rows[0]["hit_rate"] == 0
    pts = [(10, 100), (20, 80), (15, 70), (5, 120), (20, 60)]
    assert metrics.pareto_front(pts) == [(5, 120), (10, 100), (20, 80)]
    assert metrics.ratio(2.0, 4.0) == 0.5 and metrics.ratio(1.0, 0) is None


def _run(label, conc, scale):
    rs = [dict(r, ttft=r["ttft"] * scale if r["ttft"] else None) for r in RECORDS]
    replay = {
        "config": {"concurrency": conc, "url": "http://x", "model": "m"},
        "duration_s": 10.0,
        "interrupted": False,
        "salt": "s",
        "sessions_done": 1,
        "started_at": 0.0,
        "records": rs,
    }
    return make_run(label, replay, {"path": "t.jsonl", "stats": {"sessions": 1}})


def test_report_with_baseline_ratios(tmp_path):
    runs = [_run("agg", 1, 1.0), _run("pd", 1, 0.5), _run("agg", 2, 1.0), _run("pd", 2, 2.0)]
    for r in runs:
        write_run(r, tmp_path / "runs" / f"{r['label']}-{r['concurrency']}" / "run.json")
    loaded = report.load_runs([tmp_path / "runs"])
    assert len(loaded) == 4
    md_path = report.write_report(loaded, tmp_path / "rep", baseline="agg")
    md = md_path.read_text()
    assert "Ratios vs baseline `agg`" in md
    assert "| pd | 1 | 0.50× |" in md and "| pd | 2 | 2.00× |" in md
    for img in ("ttft_cdf.png", "pareto.png", "hit_rate_by_turn.png"):
        assert (tmp_path / "rep" / img).stat().st_size > 1000
        assert f"]({img})" in md
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert {(s["label"], s["concurrency"]) for s in summary} == {
        ("agg", 1),
        ("pd", 1),
        ("agg", 2),
        ("pd", 2),
    }


def test_load_runs_rejects_other_files(tmp_path):
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="not a replay run file"):
        report.load_runs([p])


def test_percentile_interpolates_linearly_and_skips_missing():
    values = [0.3, 0.1, None, 0.4, 0.2]
    assert metrics.percentile(values, 50) == pytest.approx(0.25)
    expected = float(np.percentile([0.1, 0.2, 0.3, 0.4], 90))
    assert metrics.percentile(values, 90) == pytest.approx(expected)
    assert metrics.percentile([], 50) is None and metrics.percentile([None], 99) is None
