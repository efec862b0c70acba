"""A decision checked by simulation before it acts (``scaling.simulation``).

The live loop proposes pool sizes from the solver, which predicts from
profiles alone; a cluster simulator (``sim/``, with the router's own routing
core inside) can predict what the current and the proposed pools would serve
of the measured traffic. This module is the seam: the ``Simulator`` protocol
the operator is given an implementation of (``tandem operator`` injects
``sim.check``'s; ``python -m operators`` runs without one), what is asked
(``CheckRequest``: each pool's profile and its current and proposed size, the
measured demand at the planned headroom, the SLOs) and what comes back
(``Prediction`` of each side), and the pure verdict that ``loop.on_tick``
applies:

* ``Worse``: the proposal serves fewer requests within the SLOs per second
  than the current pools (by more than ``tolerance``), or misses the TTFT
  SLO at P90 that the current pools meet;
* ``Better``: it serves more by more than ``tolerance``;
* ``Same`` otherwise.

Modes: ``Off`` asks nothing; ``Report`` asks and writes the prediction to
status; ``Gate`` also holds a ``Worse`` proposal (the pools stay, the
recommendation stays the current size). A check that fails or times out
holds nothing: the decision proceeds and status says why it was not checked.

``run_check`` runs the simulator off the event loop (a thread) with a
timeout; the simulator is handed the same deadline, and stops itself there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from .profiles import EngineProfile, PoolRole
from .solver import Demand, Slo

SimulateMode = Literal["Off", "Report", "Gate"]
SIMULATE_MODES: tuple[SimulateMode, ...] = ("Off", "Report", "Gate")
Verdict = Literal["Better", "Same", "Worse", "Failed"]


@dataclass(frozen=True)
class PoolSizes:
    """One pool, as the simulator needs it."""

    role: PoolRole
    profile: EngineProfile
    current: int
    proposed: int


@dataclass(frozen=True)
class CheckRequest:
    pools: tuple[PoolSizes, ...]
    demand: Demand  # as measured; the simulator offers ``demand × load``
    load: float  # the planned headroom
    slo: Slo
    requests: int = 300  # to simulate on each side

    @property
    def current(self) -> dict[str, int]:
        return {p.role: p.current for p in self.pools}

    @property
    def proposed(self) -> dict[str, int]:
        return {p.role: p.proposed for p in self.pools}


@dataclass(frozen=True)
class Prediction:
    """One side's simulated figures."""

    goodput_rps: float  # requests finished within the SLOs, per second
    ttft_p90_s: float
    requests: int  # requests simulated


class Simulator(Protocol):
    def predict(self, request: CheckRequest, deadline: float) -> tuple[Prediction, Prediction]:
        """The current pools' and the proposed pools' predictions; raise on
        failure, ``TimeoutError`` once ``time.monotonic()`` passes ``deadline``."""
        ...


@dataclass(frozen=True)
class SimulationCheck:
    """What the simulation said about one proposal (current → proposed)."""

    current_replicas: Mapping[str, int]
    proposed_replicas: Mapping[str, int]
    current: Prediction | None
    proposed: Prediction | None
    verdict: Verdict
    reason: str
    wall_s: float = 0.0
    demand: Demand | None = None  # the measured demand it simulated (times the headroom)

    def about(self, current: Mapping[str, int], proposed: Mapping[str, int]) -> bool:
        return dict(self.current_replicas) == dict(current) and dict(
            self.proposed_replicas
        ) == dict(proposed)


def judge(
    request: CheckRequest,
    current: Prediction,
    proposed: Prediction,
    tolerance: float,
    wall_s: float = 0.0,
) -> SimulationCheck:
    """The verdict on the proposal (pure)."""
    cur, new = current.goodput_rps, proposed.goodput_rps
    figures = (
        f"simulated {new:.3g} req/s within the SLOs (TTFT p90 {proposed.ttft_p90_s:.3g} s) "
        f"against {cur:.3g} req/s ({current.ttft_p90_s:.3g} s) now"
    )
    ttft_slo = request.slo.ttft_p90_s
    verdict: Verdict
    if new < cur * (1.0 - tolerance):
        verdict, why = "Worse", f"fewer requests within the SLOs: {figures}"
    elif ttft_slo is not None and proposed.ttft_p90_s > ttft_slo >= current.ttft_p90_s:
        verdict, why = "Worse", f"TTFT p90 above the SLO of {ttft_slo:.3g} s: {figures}"
    elif new > cur * (1.0 + tolerance):
        verdict, why = "Better", figures
    else:
        verdict, why = "Same", f"within {tolerance:.0%}: {figures}"
    return SimulationCheck(
        request.current, request.proposed, current, proposed, verdict, why, wall_s, request.demand
    )


def failed(request: CheckRequest, why: str, wall_s: float = 0.0) -> SimulationCheck:
    return SimulationCheck(
        request.current,
        request.proposed,
        None,
        None,
        "Failed",
        f"not checked: {why}; the decision proceeds",
        wall_s,
        request.demand,
    )


# How far the demand may move before a standing proposal is simulated again.
REUSE_TOLERANCE = 0.1


def reusable(check: SimulationCheck | None, request: CheckRequest) -> bool:
    """Whether an earlier check answers this request: the same proposal from
    the same pools, at a demand within ``REUSE_TOLERANCE`` (a standing
    recommendation is not simulated again every tick)."""
    if check is None or check.verdict == "Failed" or check.demand is None:
        return False
    if not check.about(request.current, request.proposed):
        return False
    before, now = check.demand, request.demand
    pairs = [
        (before.request_rate, now.request_rate),
        (before.mean_input_tokens, now.mean_input_tokens),
        (before.mean_output_tokens, now.mean_output_tokens),
    ]
    return (
        all(
            a is not None and b is not None and abs(a - b) <= REUSE_TOLERANCE * max(abs(b), 1e-9)
            for a, b in pairs
        )
        and abs((before.hit_rate or 0.0) - (now.hit_rate or 0.0)) <= REUSE_TOLERANCE
    )


def check_request(
    pools: Mapping[PoolRole, tuple[EngineProfile, int]],
    proposed: Mapping[str, int],
    demand: Demand,
    load: float,
    slo: Slo,
    requests: int,
) -> CheckRequest:
    """``pools``: each role's profile and current size."""
    return CheckRequest(
        tuple(
            PoolSizes(role, profile, current, proposed.get(role, current))
            for role, (profile, current) in pools.items()
        ),
        demand,
        load,
        slo,
        requests,
    )


async def run_check(
    simulator: Simulator | None, request: CheckRequest, timeout_s: float, tolerance: float
) -> SimulationCheck:
    """The simulator's verdict, run in a thread so the operator's event loop
    goes on; any failure (none given, an error, the timeout) is a ``Failed``
    check, never an exception."""
    if simulator is None:
        return failed(request, "this operator runs without a simulator (run `tandem operator`)")
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        current, proposed = await asyncio.wait_for(
            asyncio.to_thread(simulator.predict, request, deadline), timeout_s + 1.0
        )
    except TimeoutError:
        return failed(request, f"the simulation took over {timeout_s:g} s", timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure of the check lets the decision proceed
        return failed(
            request,
            f"the simulation failed: {type(exc).__name__}: {exc}",
            time.monotonic() - start,
        )
    return judge(request, current, proposed, tolerance, time.monotonic() - start)
