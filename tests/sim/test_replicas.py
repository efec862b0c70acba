"""Router replicas sharing state with a lag: N real routing cores, the
shared-state writes (bindings, load) of one reaching the others later."""

from __future__ import annotations

from services.router.routing.core import PodLoad, StateWrites
from services.router.routing.policy import Binding
from sim.cluster import ClusterConfig, LaggedState, Simulation, Traffic
from sim.defaults import CPU_BLOCK_BYTES_PER_TOKEN, fitted_model
from sim.engine import EngineSettings
from sim.events import EventLoop


def test_a_replicas_writes_reach_the_others_after_the_lag():
    loop = EventLoop()
    state = LaggedState(loop, replicas=3, lag_s=2.0)
    state.write(0, StateWrites({"p": PodLoad(2, 300)}, ("s", Binding("p"))))
    assert state.read(0, "s").binding == Binding("p")  # its own at once
    assert state.read(1, "s").binding is None and state.read(1, "s").loads == {}
    loop.run(until=1.9)
    assert state.read(2, "s").binding is None
    loop.run(until=2.0)
    assert state.read(1, "s").binding == Binding("p")
    assert state.read(2, "s").loads == {"p": PodLoad(2, 300)}
    assert state.read(0, "s").loads == {}  # its own load is in its core, not here
    # loads are absolute: a later write replaces the writer's share
    state.write(1, StateWrites({"p": PodLoad(1, 0)}))
    state.write(0, StateWrites({"p": PodLoad(0, 0)}))
    loop.run()
    assert state.read(2, "s").loads == {"p": PodLoad(1, 0)}


def _run(replicas: int, lag_s: float) -> dict[str, float]:
    config = ClusterConfig(
        aggregated=4,
        engine=EngineSettings(kv_blocks=182, block_bytes=128 * CPU_BLOCK_BYTES_PER_TOKEN),
        model=fitted_model(),
        router_replicas=replicas,
        state_lag_s=lag_s,
    )
    return Simulation(config, Traffic(sessions=16, concurrency=0)).run()


def test_hit_rate_holds_without_lag_and_falls_once_it_passes_think_times():
    single = _run(1, 0.0)
    assert _run(4, 0.0)["hit_rate"] == single["hit_rate"]
    # A session's next turn is routed its previous turn's response time plus
    # its think time (median 0.11 s here) after it, a few seconds: a binding
    # that arrives later than that is missed.
    assert _run(4, 10.0)["hit_rate"] < single["hit_rate"] - 0.03


def test_of_two_bindings_of_a_session_the_later_write_wins():
    loop = EventLoop()
    state = LaggedState(loop, replicas=2, lag_s=2.0)
    state.write(0, StateWrites(binding=("s", Binding("a"))))
    loop.run(until=1.0)
    state.write(1, StateWrites(binding=("s", Binding("b"))))  # before 0's arrived
    loop.run()
    assert state.read(0, "s").binding == state.read(1, "s").binding == Binding("b")
