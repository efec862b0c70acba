"""The planner's live loop (operators.planner.loop.on_tick) sizing the pools
of a simulated P/D cluster over simulated time: the real loop and solver,
the simulator applying their scale effects."""

from __future__ import annotations

from dataclasses import replace

from operators.planner.checked import CheckLimits
from operators.planner.simulate import CheckRequest, Prediction
from sim.check import SimulationChecker
from sim.cluster import ClusterConfig, Simulation, Traffic
from sim.defaults import CPU_BLOCK_BYTES_PER_TOKEN, CPU_PROFILES, fitted_model, load_profiles
from sim.engine import EngineSettings
from sim.planner import Planner, PlannerSettings


def _run(mode, simulate="Off", simulator=None):
    config = ClusterConfig(
        aggregated=0,
        prefill=1,
        decode=1,
        engine=EngineSettings(kv_blocks=182, block_bytes=128 * CPU_BLOCK_BYTES_PER_TOKEN),
        model=fitted_model(),
    )
    sim = Simulation(config, Traffic(sessions=24, concurrency=12))
    settings = PlannerSettings(
        mode=mode,
        budget_gpus=8,
        start_s=30.0,
        simulate=simulate,
        check=CheckLimits(timeout_s=120.0),
    )
    planner = Planner(
        sim,
        load_profiles(CPU_PROFILES),
        replace(settings, loop=replace(settings.loop, up_cooldown_s=15.0)),
        simulator,
    )
    planner.start()
    return sim.run(), sim, planner


def test_auto_applies_the_loops_targets_to_the_simulated_pools():
    summary, sim, planner = _run("Auto")
    assert planner.history and all(h["targets"] for h in planner.history[1:])
    grown = [h for h in planner.history if h["replicas"] != {"prefill": 1, "decode": 1}]
    assert grown and grown[0]["replicas"] == grown[0]["targets"]
    added = set(sim.roles) - {"prefill-0", "decode-0"}
    assert added and added <= set(sim.core.pods)  # started and known to the router
    assert summary["mean_gpus"] > 2
    # The solver sizes the prefill pool for every prompt; the router prefilled
    # most of them on the decode pod (short uncached remainders), so the added
    # prefill pod idles: the gap the issue names, seen in simulation.
    local = sum(1 for r in sim.records if r.prefill_pod is None)
    assert local > len(sim.records) / 2


def test_off_decides_nothing():
    summary, sim, planner = _run("Off")
    assert all(h["targets"] == {} for h in planner.history)
    assert summary["mean_gpus"] == 2 and set(sim.engines) == {"prefill-0", "decode-0"}


def test_gate_checks_a_proposal_by_simulation_before_it_acts():
    """The operator's seam (``checked_tick``) with ``sim.check``'s simulator:
    the first proposal (1P1D -> 2P1D) is simulated, and acts as its verdict
    allows; Off asks nothing and decides the same here."""
    summary, sim, planner = _run("Auto", "Gate", SimulationChecker())
    checked = [h for h in planner.history if h["simulation"]]
    assert checked, "no proposal was simulated"
    verdict, reason = checked[0]["simulation"]
    assert verdict in ("Better", "Same", "Worse"), reason
    assert "req/s within the SLOs" in reason
    grew = checked[0]["replicas"] != {"prefill": 1, "decode": 1}
    assert grew == (verdict != "Worse")
    off, _, _ = _run("Auto")
    if verdict != "Worse":
        assert summary == {**off, "wall_s": summary["wall_s"]}


class _Pessimist:
    """A simulator that predicts every proposal serves half as much."""

    def predict(self, request: CheckRequest, deadline: float) -> tuple[Prediction, Prediction]:
        return Prediction(1.0, 1.0, request.requests), Prediction(0.5, 1.0, request.requests)


def test_gate_holds_a_proposal_predicted_worse_and_report_does_not():
    summary, sim, planner = _run("Auto", "Gate", _Pessimist())
    assert any(h["simulation"] and h["simulation"][0] == "Worse" for h in planner.history)
    assert all(h["replicas"] == {"prefill": 1, "decode": 1} for h in planner.history)
    assert summary["mean_gpus"] == 2
    summary, sim, planner = _run("Auto", "Report", _Pessimist())
    assert summary["mean_gpus"] > 2
