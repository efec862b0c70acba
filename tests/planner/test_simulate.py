"""A scaling decision checked by simulation before it acts
(operators/planner/simulate.py, checked.py): the live loop with a fake
simulator that predicts what each test says — held under Gate when worse,
reported under Report, proceeding when better or when the check fails or
times out — and the check through status and back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest

from operators.planner.checked import CheckLimits, checked_tick
from operators.planner.loop import LoopSettings, LoopState, PoolStatus, TickInputs
from operators.planner.persist import state_from_dict, state_to_dict
from operators.planner.simulate import (
    CheckRequest,
    Prediction,
    SimulateMode,
    check_request,
    judge,
)
from operators.planner.solver import Demand, Slo
from tests.planner.synthetic import ramp_profile

PREFILL = ramp_profile("prefill-a", "prefill", 28.0)
DECODE = ramp_profile("decode-a", "decode", 65.0)
SETTINGS = LoopSettings(up_cooldown_s=0, down_cooldown_s=0, down_window_s=0, max_step=4)
# Twice what one prefill replica of 28 req/s serves: the solver wants more prefill.
DEMAND = Demand(56.0, 2000.0, 200.0)


@dataclass
class FakeSimulator:
    """Predicts ``current`` and ``proposed`` (or raises ``error``, or sleeps)."""

    current: Prediction = field(default_factory=lambda: Prediction(50.0, 1.0, 300))
    proposed: Prediction = field(default_factory=lambda: Prediction(50.0, 1.0, 300))
    error: Exception | None = None
    sleep_s: float = 0.0
    asked: list[CheckRequest] = field(default_factory=list)

    def predict(self, request: CheckRequest, deadline: float) -> tuple[Prediction, Prediction]:
        self.asked.append(request)
        time.sleep(self.sleep_s)
        if self.error is not None:
            raise self.error
        return self.current, self.proposed


def inputs(mode: str = "Auto", simulate: SimulateMode = "Gate", demand=DEMAND) -> TickInputs:
    return TickInputs(
        mode=mode,
        pools=(
            PoolStatus("prefill", "prefill-a", 1, 1, 1, 0, 1),
            PoolStatus("decode", "decode-a", 1, 1, 1, 0, 1),
        ),
        profiles=(PREFILL, DECODE),
        demand=demand,
        slo=Slo(ttft_p90_s=2.0),
        headroom=1.0,
        simulate=simulate,
    )


async def tick(sim, mode="Auto", simulate: SimulateMode = "Gate", state=None, limits=None):
    return await checked_tick(
        1000.0,
        state or LoopState(),
        inputs(mode, simulate),
        SETTINGS,
        sim,
        limits or CheckLimits(requests=200, timeout_s=5.0),
    )


def condition(effects, kind="SimulationAgrees"):
    return next(c for c in effects.conditions if c.type == kind)


async def test_a_proposal_predicted_worse_is_held_under_gate():
    sim = FakeSimulator(proposed=Prediction(30.0, 1.5, 300))
    state, effects = await tick(sim)
    assert len(sim.asked) == 1
    asked = sim.asked[0]
    assert asked.current == {"prefill": 1, "decode": 1}
    assert asked.proposed["prefill"] > 1 and asked.requests == 200
    assert effects.scale == ()
    assert effects.record.replicas == {"prefill": 1, "decode": 1}
    assert effects.record.simulation.verdict == "Worse"
    assert "held by the simulation" in effects.record.held[-1]
    c = condition(effects)
    assert (c.status, c.reason) == ("False", "Worse") and "held" in c.message
    assert [e.reason for e in effects.events] == ["SimulationHeld"]
    # The same proposal held again next tick: reused, no second simulation, no second Event.
    _, again = await tick(sim, state=state)
    assert len(sim.asked) == 1 and again.scale == ()
    assert "SimulationHeld" not in [e.reason for e in again.events]


async def test_report_says_worse_and_acts_anyway():
    sim = FakeSimulator(proposed=Prediction(30.0, 1.5, 300))
    _, effects = await tick(sim, simulate="Report")
    assert [s.role for s in effects.scale] == ["prefill"]
    c = condition(effects)
    assert (c.status, c.reason) == ("False", "Worse") and "reported only" in c.message


async def test_a_proposal_predicted_better_proceeds():
    sim = FakeSimulator(current=Prediction(28.0, 5.0, 300), proposed=Prediction(55.0, 0.4, 300))
    _, effects = await tick(sim)
    assert [s.role for s in effects.scale] == ["prefill"]
    assert effects.record.simulation.verdict == "Better"
    assert (condition(effects).status, condition(effects).reason) == ("True", "Better")


@pytest.mark.parametrize(
    "sim, says",
    [
        (FakeSimulator(error=RuntimeError("no profile fits")), "RuntimeError: no profile fits"),
        (FakeSimulator(sleep_s=2.0), "took over 0.5 s"),
        (None, "without a simulator"),
    ],
    ids=["error", "timeout", "none"],
)
async def test_a_check_that_fails_lets_the_decision_proceed(sim, says):
    _, effects = await tick(sim, limits=CheckLimits(requests=200, timeout_s=0.5))
    assert [s.role for s in effects.scale] == ["prefill"]
    assert effects.record.simulation.verdict == "Failed"
    c = condition(effects)
    assert (c.status, c.reason) == ("Unknown", "CheckFailed") and says in c.message


async def test_off_asks_nothing_and_no_change_simulates_nothing():
    sim = FakeSimulator(proposed=Prediction(1.0, 9.0, 300))
    _, effects = await tick(sim, simulate="Off")
    assert sim.asked == [] and effects.scale and effects.record.simulation is None
    assert not any(c.type == "SimulationAgrees" for c in effects.conditions)
    quiet = Demand(20.0, 2000.0, 200.0)  # 1P1D serves it: nothing proposed
    state, effects = await checked_tick(
        0.0, LoopState(), inputs(demand=quiet), SETTINGS, sim, CheckLimits()
    )
    assert sim.asked == [] and condition(effects).reason == "NoChange"


async def test_recommend_under_gate_keeps_recommending_the_current_pools():
    sim = FakeSimulator(proposed=Prediction(30.0, 1.5, 300))
    _, effects = await tick(sim, mode="Recommend")
    assert effects.record.replicas == {"prefill": 1, "decode": 1}
    assert "ScalingRecommended" not in [e.reason for e in effects.events]


async def test_the_check_survives_status_and_a_moved_demand_is_simulated_again():
    sim = FakeSimulator(proposed=Prediction(30.0, 1.5, 300))
    state, effects = await tick(sim)
    restored = state_from_dict(state_to_dict(state))
    check = effects.record.simulation
    assert replace(restored.history[-1].simulation, wall_s=check.wall_s) == check
    doc = state_to_dict(state)["history"][-1]["simulation"]
    assert doc["verdict"] == "Worse" and doc["proposed"]["goodputRps"] == 30.0
    assert doc["current"]["replicas"] == {"prefill": 1, "decode": 1}
    moved = replace(inputs(), demand=Demand(70.0, 2000.0, 200.0))
    await checked_tick(1015.0, restored, moved, SETTINGS, sim, CheckLimits())
    assert len(sim.asked) == 2


def test_the_verdict():
    request = check_request(
        {"prefill": (PREFILL, 1), "decode": (DECODE, 1)},
        {"prefill": 2},
        DEMAND,
        1.2,
        Slo(ttft_p90_s=2.0),
        300,
    )
    assert request.proposed == {"prefill": 2, "decode": 1}
    now = Prediction(10.0, 1.0, 300)
    assert judge(request, now, Prediction(10.3, 0.9, 300), 0.05).verdict == "Same"
    assert judge(request, now, Prediction(11.0, 0.9, 300), 0.05).verdict == "Better"
    assert judge(request, now, Prediction(9.0, 0.9, 300), 0.05).verdict == "Worse"
    # Goodput alike but the TTFT SLO, met now, missed by the proposal.
    late = judge(request, now, Prediction(10.0, 2.5, 300), 0.05)
    assert late.verdict == "Worse" and "TTFT p90 above the SLO" in late.reason
