"""The Phase 2 report's verdict (bench/planner_sweep.py)."""

from __future__ import annotations

from bench.planner_sweep import best_per_core


def test_best_per_core_counts_cores_and_names_no_winner_at_zero():
    rows = [
        {"deployment": "1P1D", "cores": 2, "measured_rps": 0.4},
        {"deployment": "4agg", "cores": 4, "measured_rps": 0.6},
    ]
    assert best_per_core(rows, "measured_rps") == "1P1D"  # 0.2 vs 0.15 per core
    assert best_per_core([dict(r, measured_rps=0.0) for r in rows], "measured_rps") is None
    assert best_per_core([], "measured_rps") is None
