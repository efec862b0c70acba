"""One tick of the live loop with its proposal checked by simulation
(``scaling.simulation``, ``simulate.py``): ``on_tick`` once to learn the
proposal, the simulator on it (off the event loop, within the timeout; an
earlier check of the same proposal at about the same demand is reused), and
``on_tick`` again from the same state with the check, which holds a proposal
predicted worse under ``Gate``. The operator's tick (``operators/live.py``)
runs this; the loop itself stays pure."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .loop import Effects, LoopSettings, LoopState, TickInputs, on_tick, simulation_request
from .simulate import Simulator, reusable, run_check


@dataclass(frozen=True)
class CheckLimits:
    requests: int = 300  # simulated on each side
    timeout_s: float = 30.0
    tolerance: float = 0.05


async def checked_tick(
    now: float,
    state: LoopState,
    inputs: TickInputs,
    settings: LoopSettings,
    simulator: Simulator | None,
    check: CheckLimits = CheckLimits(),
) -> tuple[LoopState, Effects]:
    after, effects = on_tick(now, state, inputs, settings)
    request = simulation_request(inputs, effects, check.requests)
    if request is None:
        return after, effects
    last = state.history[-1].simulation if state.history else None
    outcome = (
        last
        if reusable(last, request)
        else await run_check(simulator, request, check.timeout_s, check.tolerance)
    )
    return on_tick(now, state, replace(inputs, simulation=outcome), settings)
