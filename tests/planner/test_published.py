"""The solver on published GPU figures: DeepSeek-V3 on H800 nodes
(operators/planner/published/deepseek-v3-h800.yaml, profiles written by hand
from DeepSeek's 2025-03-01 inference-system overview)."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.planner.profiles import profiles_from_yaml
from operators.planner.solver import Demand, Problem, Slo, solve

PUBLISHED = Path(__file__).resolve().parents[2] / "operators/planner/published"
DEEPSEEK = tuple(profiles_from_yaml((PUBLISHED / "deepseek-v3-h800.yaml").read_text()))
# The published day: 608B input tokens (56.3% cache hits) and 168B output tokens,
# written as requests of 3619 input / 1000 output tokens (the ratio 608 / 168).
RATE = 168e9 / 86_400 / 1000
DAY = Demand(RATE, 3619.0, 1000.0, hit_rate=0.563)


def test_profiles_are_marked_published_and_lack_what_was_not_published():
    assert [p.role for p in DEEPSEEK] == ["prefill", "decode"]
    assert all(p.source == "published" for p in DEEPSEEK)
    assert DEEPSEEK[0].points[0].ttft_p90_s is None


def test_the_published_day_needs_the_nodes_deepseek_ran():
    d = solve(Problem(DEEPSEEK, DAY, headroom=1.0))
    pre, dec = d.plan.pools
    # 7.04M input tok/s ÷ (4 × 73.7k) = 23.9 prefill units, 1.94M output tok/s ÷
    # (18 × 14.8k) = 7.3 decode units: 226.9 nodes of throughput, against the
    # 226.75 nodes DeepSeek reports occupied on average (a consistency check of
    # the arithmetic: their throughput figures are averages over the same day).
    fractional = RATE / pre.point.capacity_rps * 4 + RATE / dec.point.capacity_rps * 18
    assert fractional == pytest.approx(226.75, rel=0.002)
    assert (pre.replicas, dec.replicas) == (24, 8)
    assert d.plan.gpus // 8 == 240
    assert any("GPUs 768:1152" in r for r in d.reasons)
    # With 20% headroom: 29 + 9 units, 278 nodes — DeepSeek's published peak.
    peak = solve(Problem(DEEPSEEK, DAY, headroom=1.2))
    assert peak.plan.gpus // 8 == 278


def test_more_cache_hits_shrink_prefill_only():
    d = solve(Problem(DEEPSEEK, Demand(RATE, 3619.0, 1000.0, hit_rate=0.8), headroom=1.0))
    pre, dec = d.plan.pools
    assert (pre.replicas, dec.replicas) == (11, 8)  # 24 × 0.2 / 0.437 → 11


def test_slos_the_figures_cannot_check_are_refused_by_name():
    d = solve(Problem(DEEPSEEK, DAY, Slo(ttft_p90_s=2.0), headroom=1.0))
    assert d.plan is None
    assert any("deepseek-v3-h800-prefill-ep32: the profile has no TTFT p90" in r for r in d.reasons)
    assert any(c.startswith("measure the configurations (tandem profile)") for c in d.changes)
    d = solve(Problem(DEEPSEEK, DAY, Slo(interactivity_p90=50.0), headroom=1.0))
    assert d.plan is None and d.binding == "slo"
    # the lightest decode point (one request per GPU; an assumption, see the profile's note)
    assert any("relax the P90 interactivity SLO to at most 44.57 tok/s" in c for c in d.changes)


def test_an_interactivity_slo_runs_decode_at_a_lighter_assumed_point():
    """The decode profile's points below the published one follow the model
    its note states (a fixed cost per step plus a cost per sequence): 30 tok/s
    per user holds at about 5,800 requests per unit instead of 12,686, so the
    published day needs 12 decode units instead of 8."""
    d = solve(Problem(DEEPSEEK, DAY, Slo(interactivity_p90=30.0), headroom=1.0))
    assert d.plan is not None
    pre, dec = d.plan.pools
    assert (pre.replicas, dec.replicas) == (24, 12)
    assert dec.point.interactivity_p90 == pytest.approx(30.0)
