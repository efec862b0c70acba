"""The simulator as the controller's check of a decision (sim/check.py): a
trace fitted to the measured demand, and the current and proposed pools of
the shipped CPU profiles predicted in a sensible order (≈2 s, no engines)."""

from __future__ import annotations

import time

import pytest

from operators.planner.simulate import check_request, run_check
from operators.planner.solver import Demand, Slo
from sim.check import CheckSettings, SimulationChecker, fit_traffic
from sim.defaults import CPU_PROFILES, load_profiles

PROFILES = load_profiles(CPU_PROFILES)
# One prefill core computes about 260 uncached tokens/s: at 1 req/s of 2,000-token
# prompts with 85% cached, 1P1D falls behind and 2P2D keeps up.
SATURATING = Demand(1.0, 2000.0, 30.0, hit_rate=0.85)


def request(current: int, proposed: int, demand: Demand = SATURATING):
    return check_request(
        {"prefill": (PROFILES["prefill"], current), "decode": (PROFILES["decode"], current)},
        {"prefill": proposed, "decode": proposed},
        demand,
        1.0,
        Slo(ttft_p90_s=10.0),
        300,
    )


def test_the_trace_matches_the_measured_demand():
    fitted = fit_traffic(SATURATING, 1.2, 300, CheckSettings())
    assert fitted.mean_input_tokens == pytest.approx(2000.0, rel=0.1)
    assert fitted.mean_output_tokens == pytest.approx(30.0, rel=0.1)
    assert fitted.reuse == pytest.approx(0.85, abs=0.05)
    assert 250 <= fitted.requests <= 400
    # sessions arrive at the rate that offers 1.2 req/s
    per_session = fitted.requests / fitted.traffic.sessions
    assert fitted.traffic.session_rate * per_session == pytest.approx(1.2)


async def test_more_pools_predicted_better_under_saturating_demand_and_fewer_worse():
    checker = SimulationChecker()
    up = await run_check(checker, request(1, 2), timeout_s=60, tolerance=0.05)
    assert up.verdict == "Better", up.reason
    assert up.proposed.goodput_rps > up.current.goodput_rps
    assert up.proposed.ttft_p90_s < up.current.ttft_p90_s
    down = await run_check(checker, request(2, 1), timeout_s=60, tolerance=0.05)
    assert down.verdict == "Worse", down.reason


def test_a_passed_deadline_stops_the_simulation():
    with pytest.raises(TimeoutError):
        SimulationChecker().predict(request(1, 2), deadline=time.monotonic() - 1)
