"""The ratio solver on synthetic profiles (pure functions, no I/O, no mocks)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.planner.profiles import EngineConfig, EngineProfile, ProfilePoint
from operators.planner.solver import (
    Demand,
    Problem,
    Rejection,
    Slo,
    fixed_plan,
    operating_point,
    prefill_token_cost,
    size_disaggregated,
    solve,
)
from tests.planner.synthetic import ramp_profile

# The seeds' worked example: a prefill group serves 28 req/s, a decode group
# 65 req/s, so P × 28 = D × 65 gives P/D = 65 / 28 ≈ 2.32.
PREFILL = ramp_profile("prefill-tp1", "prefill", 28.0)
DECODE = ramp_profile("decode-tp1", "decode", 65.0)
SHAPE = {"mean_input_tokens": 2000.0, "mean_output_tokens": 200.0}
NO_SLO = Slo()


def problem(
    rate: float | None,
    budget: int | None = None,
    headroom: float = 1.0,
    profiles=(PREFILL, DECODE),
    slo: Slo = NO_SLO,
    hit: float | None = None,
    **kw,
) -> Problem:
    return Problem(
        profiles=tuple(profiles),
        demand=Demand(rate, hit_rate=hit, **SHAPE),
        slo=slo,
        budget_gpus=budget,
        headroom=headroom,
        **kw,
    )


def test_seeds_example_demand_gives_seven_to_three():
    d = solve(problem(195.0))
    assert d.plan is not None and d.meets_demand
    assert [p.replicas for p in d.plan.pools] == [7, 3]
    assert d.plan.ratio == pytest.approx(7 / 3)
    assert d.binding == "demand"
    assert any("the faster side gets fewer groups; balance at 2.32" in r for r in d.reasons)
    pre, dec = d.plan.pools
    assert pre.utilization == pytest.approx(195 / 196)
    assert dec.utilization == pytest.approx(1.0)


def test_seeds_example_budget_alone_balances_the_pools():
    d = solve(problem(None, budget=10))
    assert d.plan is not None
    assert [p.replicas for p in d.plan.pools] == [7, 3]
    assert d.plan.capacity_rps == pytest.approx(195.0)
    assert d.binding == "budget"


def test_budget_bound_says_how_many_gpus_meet_the_demand():
    d = solve(problem(1000.0, budget=10))
    assert not d.meets_demand and d.binding == "budget"
    assert d.plan is not None and d.plan.gpus <= 10
    assert d.plan.capacity_rps == pytest.approx(195.0)
    # 1000 / 28 → 36 prefill groups, 1000 / 65 → 16 decode groups.
    assert any(
        "needs 52 GPUs (36P prefill-tp1 + 16D decode-tp1): raise the budget by 42" in c
        for c in d.changes
    ), d.changes


def test_demand_bound_reports_utilization_and_the_next_step():
    d = solve(problem(100.0, headroom=1.2))
    assert d.binding == "demand" and d.meets_demand
    pre, dec = d.plan.pools
    # 120 req/s needed: ceil(120 / 28) = 5 prefill, ceil(120 / 65) = 2 decode.
    assert (pre.replicas, dec.replicas) == (5, 2)
    assert pre.utilization == pytest.approx(100 / 140)
    assert dec.utilization == pytest.approx(100 / 130)
    # The decode pool fills first: 130 / 1.2 = 108 req/s of demand.
    assert any(
        "holds up to 108 req/s" in c and "decode pool needs another group" in c for c in d.changes
    ), d.changes


def test_slo_bound_costs_prefill_groups_and_says_so():
    # TTFT p90 of the ramp: 0.2 s × (1, 1.1, 1.3, 1.8, 3, 6) at 25..100% of 28 req/s.
    # A 0.3 s SLO crosses between 75% (0.26 s) and 90% (0.36 s): 0.26 + t × 0.1 = 0.3
    # → t = 0.4 → 28 × (0.75 + 0.4 × 0.15) = 22.68 req/s per group.
    slo = Slo(ttft_p90_s=0.3)
    d = solve(problem(195.0, slo=slo))
    pre = d.plan.pool("prefill")
    assert pre.point.limit == "ttft_p90"
    assert pre.point.capacity_rps == pytest.approx(22.68)
    assert pre.replicas == math.ceil(195 / 22.68) == 9
    assert d.binding == "slo"
    assert any("limited by the TTFT p90 SLO" in r for r in d.reasons)
    assert any("without the ttft p90 SLO a group would take 28 req/s" in c for c in d.changes)


def test_an_slo_no_profile_meets_gives_no_plan_and_the_least_slo_that_would():
    d = solve(problem(100.0, slo=Slo(ttft_p90_s=0.1)))
    assert d.plan is None and d.binding == "slo"
    assert any("TTFT p90 is 0.20 s already at the lowest profiled load" in r for r in d.reasons)
    assert any("relax the TTFT p90 SLO to at least 0.20 s" in c for c in d.changes)


def test_interactivity_slo_limits_decode_groups():
    # Interactivity 60 / (1, 1.1, 1.3, ...) tok/s: 50 tok/s crosses between 54.5 and 46.2.
    d = solve(problem(195.0, slo=Slo(interactivity_p90=50.0)))
    dec = d.plan.pool("decode")
    assert dec.point.limit == "interactivity_p90"
    assert 0.5 * 65 < dec.point.capacity_rps < 0.75 * 65
    assert dec.replicas > 3


def test_more_hits_mean_fewer_prefill_groups():
    # The profile was taken at a 50% hit rate; prefill work is the uncached part.
    pre = ramp_profile("prefill", "prefill", 28.0, hit_rate=0.5)
    low = solve(problem(195.0, profiles=(pre, DECODE), hit=0.5))
    high = solve(problem(195.0, profiles=(pre, DECODE), hit=0.9))
    assert low.plan.pool("prefill").replicas == 7
    # 5× less uncached work per request: 140 req/s per group.
    assert high.plan.pool("prefill").point.capacity_rps == pytest.approx(140.0)
    assert high.plan.pool("prefill").replicas == 2
    assert high.plan.pool("decode").replicas == low.plan.pool("decode").replicas == 3
    assert high.plan.ratio < low.plan.ratio


def test_own_hit_rate_is_used_when_the_demand_gives_none():
    pre = ramp_profile("prefill", "prefill", 28.0, hit_rate=0.5)
    point = operating_point(pre, Demand(None, 2000.0, 200.0), Slo())
    assert point.capacity_rps == pytest.approx(28.0)
    assert point.hit_rate == 0.5


def test_long_contexts_cost_decode_groups_through_kv():
    # At saturation a decode replica holds in_flight = rate × 200 tokens × 3/60 s
    # = 65 × 10 = 650 requests; at 2100 tokens each (input + output / 2) that is
    # 1.37M tokens of KV. With 400K tokens the KV binds well below saturation.
    dec = ramp_profile("decode", "decode", 65.0, kv_capacity_tokens=400_000)
    d = solve(problem(195.0, profiles=(PREFILL, dec)))
    point = d.plan.pool("decode").point
    assert point.limit == "kv"
    assert point.in_flight * 2100 == pytest.approx(400_000)
    assert d.binding == "kv"
    longer = solve(Problem((PREFILL, dec), Demand(195.0, 8000.0, 200.0), headroom=1.0))
    assert longer.plan.pool("decode").replicas > d.plan.pool("decode").replicas


def test_phase2_efficiency_scales_capacity():
    d = solve(problem(195.0, efficiency={"prefill-tp1": 0.5}))
    assert d.plan.pool("prefill").point.capacity_rps == pytest.approx(14.0)
    assert d.plan.pool("prefill").replicas == 14


def test_budget_below_the_minimum_pools_names_the_least_budget():
    d = solve(problem(10.0, budget=1))
    assert d.plan is None and d.binding == "budget"
    assert "raise the GPU budget to at least 2" in d.changes


def test_capacity_refusal_removes_the_configuration():
    d = solve(problem(10.0, refused={"decode-tp1": "decode-tp1: persistent KV overflows"}))
    assert d.plan is None and d.binding == "capacity"
    assert any("persistent KV overflows" in r for r in d.reasons)


def test_picks_the_cheaper_configuration_per_gpu():
    tp2 = ramp_profile("prefill-tp2", "prefill", 50.0, gpus=2)  # 25 req/s per GPU < 28
    d = solve(problem(195.0, profiles=(PREFILL, tp2, DECODE)))
    assert d.plan.pool("prefill").config == "prefill-tp1"
    fast = ramp_profile("prefill-tp2", "prefill", 70.0, gpus=2)  # 35 req/s per GPU
    d = solve(problem(195.0, profiles=(PREFILL, fast, DECODE)))
    assert d.plan.pool("prefill").config == "prefill-tp2"
    assert d.plan.pool("prefill").replicas == 3


# -- aggregated against disaggregated: the CPU figures ------------------------------


def cpu_profile(
    name: str, role, points: list[tuple[float, float, float, float, float]], hit: float
) -> EngineProfile:
    """Points (concurrency, req/s, TTFT p90 s, interactivity tok/s, in flight) on one core,
    the small agentic trace's shape (~1.9K-token prompts, ~24-token outputs)."""
    isl, osl = 1900.0, 24.0
    out = 1.0 if role == "prefill" else osl
    pts = tuple(
        ProfilePoint(
            concurrency=c,
            request_rate=r,
            input_tokens_per_s=r * isl,
            output_tokens_per_s=r * out,
            ttft_p50_s=ttft * 0.4,
            ttft_p90_s=ttft,
            hit_rate=hit,
            in_flight=inf,
            itl_s=1 / inter,
            interactivity_p90=inter,
        )
        for c, r, ttft, inter, inf in points
    )
    return EngineProfile(
        EngineConfig(name, role, "smollm2", 1, hardware="cpu-core"), pts, source="measured"
    )


def test_disaggregation_does_not_pay_under_kv_pressure():
    # 64 KV blocks per engine: 1P1D gave hit 76% and TTFT p90 16.8 s where two
    # aggregated engines on the same two cores gave 81% and 2.6 s at the same load.
    agg = cpu_profile(
        "agg", "aggregated", [(1, 0.25, 1.2, 20, 0.5), (2, 0.4, 2.6, 15, 1.1)], hit=0.81
    )
    pre = cpu_profile("pre", "prefill", [(1, 0.2, 3.0, 30, 0.6), (2, 0.4, 16.8, 30, 2.4)], hit=0.76)
    dec = cpu_profile("dec", "decode", [(1, 0.5, 0.5, 30, 0.4), (2, 0.8, 0.6, 25, 0.8)], hit=0.76)
    d = solve(
        Problem(
            (agg, pre, dec),
            Demand(0.8, 1900.0, 24.0),
            Slo(ttft_p90_s=5.0),
            budget_gpus=2,
            headroom=1.0,
        )
    )
    assert d.plan is not None and d.plan.kind == "aggregated"
    assert d.plan.pools[0].replicas == 2
    # P/D fits the budget but its TTFT p90 reaches 5 s at 0.23 req/s: 3 s +
    # (16.8 − 3) × t = 5 → t = 0.145 of the way from 0.2 to 0.4 req/s.
    assert d.best_disaggregated is not None
    assert d.best_disaggregated.capacity_rps == pytest.approx(0.2 + 0.2 * 2 / 13.8)
    assert d.plan.capacity_rps == pytest.approx(0.8)
    assert any(r.startswith("disaggregation does not pay here") for r in d.reasons), d.reasons


def test_disaggregation_pays_when_interactivity_is_the_slo():
    # Less KV pressure: 1P1D bought 1.5× the P90 interactivity at half the throughput.
    agg = cpu_profile(
        "agg", "aggregated", [(1, 0.3, 0.8, 20, 0.4), (2, 0.5, 1.5, 16, 1.0)], hit=0.85
    )
    pre = cpu_profile("pre", "prefill", [(1, 0.3, 0.6, 30, 0.3), (2, 0.5, 1.2, 30, 0.7)], hit=0.85)
    dec = cpu_profile("dec", "decode", [(1, 0.3, 0.6, 30, 0.3), (2, 0.5, 0.9, 24, 0.6)], hit=0.85)
    no_slo = solve(Problem((agg, pre, dec), Demand(None, 1900.0, 24.0), budget_gpus=2))
    assert no_slo.plan.kind == "aggregated"  # 2 × 0.5 req/s against 1 × 0.5
    assert no_slo.plan.capacity_rps == pytest.approx(2 * no_slo.best_disaggregated.capacity_rps)
    fast = solve(
        Problem(
            (agg, pre, dec), Demand(None, 1900.0, 24.0), Slo(interactivity_p90=22.0), budget_gpus=2
        )
    )
    assert fast.plan.kind == "disaggregated"
    assert any(
        "P90 interactivity is 20.00 tok/s already at the lowest" in r for r in fast.reasons
    ), fast.reasons


def test_aggregated_capacity_is_rescaled_by_request_cost():
    pre = ramp_profile("pre", "prefill", 10.0, hardware="h")  # 20K uncached tok/s
    dec = ramp_profile("dec", "decode", 20.0, hardware="h")  # 4K output tok/s
    agg = ramp_profile("agg", "aggregated", 5.0, hardware="h")
    # A prefill token costs 4000 / 20000 = 0.2 decode tokens.
    assert prefill_token_cost((pre, dec, agg), "m", "h") == pytest.approx(0.2)
    same = operating_point(agg, Demand(None, 2000.0, 200.0), Slo(), token_cost=0.2)
    assert same.capacity_rps == pytest.approx(5.0)
    # Cost per request 2000 × 0.2 + 200 = 600 in the profile; 1000 × 0.2 + 400 = 600.
    moved = operating_point(agg, Demand(None, 1000.0, 400.0), Slo(), token_cost=0.2)
    assert moved.capacity_rps == pytest.approx(5.0)
    heavier = operating_point(agg, Demand(None, 2000.0, 800.0), Slo(), token_cost=0.2)
    assert heavier.capacity_rps == pytest.approx(5.0 * 600 / 1200)


# -- properties ------------------------------------------------------------------

rates = st.floats(min_value=0.5, max_value=200.0, allow_nan=False)
gpus = st.integers(min_value=1, max_value=4)


@settings(max_examples=150, deadline=None)
@given(
    a=rates,
    b=rates,
    ga=gpus,
    gd=gpus,
    demand=st.floats(1.0, 500.0),
    more=st.floats(0.0, 500.0),
    budget=st.one_of(st.none(), st.integers(2, 80)),
)
def test_more_demand_never_lowers_total_capacity(a, b, ga, gd, demand, more, budget):
    profiles = (ramp_profile("p", "prefill", a, gpus=ga), ramp_profile("d", "decode", b, gpus=gd))
    lo = solve(problem(demand, budget=budget, profiles=profiles))
    hi = solve(problem(demand + more, budget=budget, profiles=profiles))
    if lo.plan is None:
        assert hi.plan is None
        return
    assert hi.plan.capacity_rps >= lo.plan.capacity_rps * (1 - 1e-9)


@settings(max_examples=150, deadline=None)
@given(
    a=rates,
    b=rates,
    g=gpus,
    demand=st.one_of(st.none(), st.floats(1.0, 500.0)),
    budget=st.integers(2, 80),
)
def test_the_faster_side_never_gets_more_groups_at_equal_cost(a, b, g, demand, budget):
    profiles = (ramp_profile("p", "prefill", a, gpus=g), ramp_profile("d", "decode", b, gpus=g))
    d = solve(problem(demand, budget=budget, profiles=profiles))
    if d.plan is None:
        assert budget < 2 * g and d.binding == "budget"
        return
    pre, dec = d.plan.pool("prefill"), d.plan.pool("decode")
    if a > b:
        assert pre.replicas <= dec.replicas
    elif b > a:
        assert dec.replicas <= pre.replicas


@settings(max_examples=150, deadline=None)
@given(
    a=rates,
    b=rates,
    c=rates,
    ga=gpus,
    gd=gpus,
    gc=gpus,
    demand=st.one_of(st.none(), st.floats(1.0, 1000.0)),
    budget=st.integers(1, 60),
    slo=st.one_of(st.none(), st.floats(0.15, 2.0)),
)
def test_budget_is_never_exceeded(a, b, c, ga, gd, gc, demand, budget, slo):
    profiles = (
        ramp_profile("p", "prefill", a, gpus=ga),
        ramp_profile("d", "decode", b, gpus=gd),
        ramp_profile("agg", "aggregated", c, gpus=gc),
    )
    d = solve(problem(demand, budget=budget, profiles=profiles, slo=Slo(ttft_p90_s=slo)))
    if d.plan is None:
        assert d.binding in ("budget", "slo")
        return
    assert d.plan.gpus <= budget
    assert all(p.replicas >= 1 for p in d.plan.pools)


@settings(max_examples=100, deadline=None)
@given(a=rates, b=rates, ga=gpus, gd=gpus, budget=st.integers(2, 40))
def test_integer_search_matches_brute_force(a, b, ga, gd, budget):
    pre = operating_point(ramp_profile("p", "prefill", a, gpus=ga), Demand(None, 2000, 200), Slo())
    dec = operating_point(ramp_profile("d", "decode", b, gpus=gd), Demand(None, 2000, 200), Slo())
    plan = size_disaggregated(pre, dec, None, budget, 1, None)
    best = (
        max(
            (min(p * a, d * b), -(p * ga + d * gd))
            for p in range(1, budget + 1)
            for d in range(1, budget + 1)
            if p * ga + d * gd <= budget
        )
        if ga + gd <= budget
        else None
    )
    if best is None:
        assert plan is None
        return
    assert plan.capacity_rps == pytest.approx(best[0])
    assert plan.gpus == -best[1]


def test_fixed_plan_says_what_a_given_sizing_serves():
    plan = fixed_plan(
        problem(100.0),
        {"prefill": 2, "decode": 1},
        {"prefill": "prefill-tp1", "decode": "decode-tp1"},
    )
    assert plan.capacity_rps == pytest.approx(56.0) and plan.ratio == 2.0
    assert plan.pool("prefill").utilization == pytest.approx(100 / 56)
    refused = fixed_plan(
        problem(100.0, slo=Slo(ttft_p90_s=0.1)),
        {"prefill": 1, "decode": 1},
        {"prefill": "prefill-tp1", "decode": "decode-tp1"},
    )
    assert isinstance(refused, Rejection) and refused.limit == "ttft_p90"


def test_the_slo_to_relax_to_is_one_the_profiles_reach():
    # Seen live on CPU: the best P90 interactivity was 2.47 tok/s against an SLO of
    # 2.5, and the decision read "is 2.5 tok/s (SLO 2.5) ... relax to at most 2.5".
    slow = ramp_profile("slow-decode", "decode", 65.0, interactivity=2.47)
    d = solve(problem(100.0, profiles=(PREFILL, slow), slo=Slo(interactivity_p90=2.5)))
    assert d.plan is None
    assert any("P90 interactivity is 2.47 tok/s already" in r for r in d.reasons), d.reasons
    (change,) = [c for c in d.changes if "interactivity SLO" in c]
    match = re.search(r"at most ([\d.]+) tok/s", change)
    assert match and float(match.group(1)) <= 2.47, change

    late = ramp_profile("late-prefill", "prefill", 28.0, ttft_s=0.2049)
    d = solve(problem(100.0, profiles=(late, DECODE), slo=Slo(ttft_p90_s=0.2)))
    (change,) = [c for c in d.changes if "TTFT p90 SLO" in c]
    match = re.search(r"at least ([\d.]+) s", change)
    assert match and float(match.group(1)) >= 0.2049, change
