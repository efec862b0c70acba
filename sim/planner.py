"""The rate-matching controller over simulated time: the planner's own live
loop (``operators.planner.loop.on_tick``, which calls the solver) decides
the pool sizes of a running simulation, as ``operators/live.py`` does for a
TandemDeployment.

Every ``tick_s`` of simulated time the planner gets what the operator would
read: each pool's replicas and pods (ready, starting), its profile, and the
demand the routers' counters show over the last ``window_s`` (finished
requests per second, mean prompt and output tokens, hit rate). Its scale
effects are applied to the simulation: a new pod holds its GPUs at once and
takes work after ``start_s``; a removed pod takes no new work and goes when
its requests have finished. The simulator decides nothing itself.

With ``simulate`` (``Report``, ``Gate``) and a ``Simulator`` (``sim.check``'s
``SimulationChecker``, as ``tandem operator`` hands the operator), each tick
runs through the operator's own seam, ``operators.planner.checked.checked_tick``:
a proposal is simulated before it acts, and under ``Gate`` one predicted worse
is held. The check is a simulation inside the simulation, in wall time
(``CheckLimits.timeout_s``), as the operator runs it.

Not fed (yet): Phase 2's per-pool measurements (the loop's efficiency stays
at the profiles'), pool bounds, router replicas.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from common.roles import Role
from operators.planner.checked import CheckLimits, checked_tick
from operators.planner.loop import (
    LoopSettings,
    LoopState,
    Mode,
    PoolStatus,
    TickInputs,
)
from operators.planner.profiles import EngineProfile, PoolRole
from operators.planner.simulate import SimulateMode, Simulator
from operators.planner.solver import Demand, Slo
from sim.cluster import Simulation

POOL_ROLES: dict[PoolRole, Role] = {
    "prefill": Role.PREFILL,
    "decode": Role.DECODE,
    "aggregated": Role.BOTH,
}


@dataclass(frozen=True)
class PlannerSettings:
    mode: Mode = "Auto"
    tick_s: float = 15.0  # `tandem operator --scaling-seconds`
    window_s: float = 60.0  # the span of counters a demand is measured over
    start_s: float = 60.0  # a new pod's start until it serves
    budget_gpus: int | None = None
    headroom: float = 1.2
    slo: Slo = field(default_factory=Slo)
    loop: LoopSettings = field(default_factory=LoopSettings)
    simulate: SimulateMode = "Off"  # the TandemDeployment's scaling.simulation.mode
    check: CheckLimits = field(default_factory=CheckLimits)


class Planner:
    """Runs ``on_tick`` on ``sim``'s clock for the pools of ``profiles``
    (one profile per role the simulation runs)."""

    def __init__(
        self,
        sim: Simulation,
        profiles: dict[PoolRole, EngineProfile],
        settings: PlannerSettings,
        simulator: Simulator | None = None,
    ) -> None:
        self.sim = sim
        self.settings = settings
        self.simulator = simulator
        self.profiles = {role: p for role, p in profiles.items() if sim.pods_of(POOL_ROLES[role])}
        if not self.profiles:
            raise ValueError("no profile for any pool the simulation runs")
        self.state = LoopState()
        self.history: list[dict[str, Any]] = []

    def start(self) -> None:
        self.sim.loop.after(self.settings.tick_s, self._tick)

    def demand(self, now: float) -> Demand | None:
        """What the routers' counters show over the last window: finished requests."""
        since = now - self.settings.window_s
        done = [r for r in self.sim.records if r.end is not None and since < r.end <= now]
        if not done:
            return None
        prompt = sum(r.prompt_tokens for r in done)
        return Demand(
            request_rate=len(done) / min(self.settings.window_s, now),
            mean_input_tokens=prompt / len(done),
            mean_output_tokens=sum(r.out_tokens for r in done) / len(done),
            hit_rate=sum(r.cached_tokens for r in done) / prompt if prompt else None,
        )

    def pools(self) -> tuple[PoolStatus, ...]:
        sim = self.sim
        out = []
        for role, profile in self.profiles.items():
            pods = [n for n, r in sim.roles.items() if r == POOL_ROLES[role] and n in sim.engines]
            ready = [n for n in pods if n in sim.core.pods and n not in sim.draining]
            starting = [n for n in pods if n not in sim.core.pods]
            out.append(
                PoolStatus(
                    role=role,
                    config=profile.name,
                    spec_replicas=len(sim.pods_of(POOL_ROLES[role])),
                    pods=len(pods),
                    ready=len(ready),
                    pending=len(starting),
                    gpus_per_replica=sim.config.gpus_per_pod,
                )
            )
        return tuple(out)

    def _tick(self) -> None:
        sim, s = self.sim, self.settings
        now = sim.loop.now
        demand = self.demand(now)
        inputs = TickInputs(
            mode=s.mode,
            pools=self.pools(),
            profiles=tuple(self.profiles.values()),
            demand=demand,
            slo=s.slo,
            budget_gpus=s.budget_gpus,
            headroom=s.headroom,
            simulate=s.simulate,
        )
        self.state, effects = asyncio.run(
            checked_tick(now, self.state, inputs, s.loop, self.simulator, s.check)
        )
        check = effects.record.simulation if effects.record else None
        for scale in effects.scale:
            self._resize(scale.role, scale.replicas)
        self.history.append(
            {
                "at": now,
                "demand_rps": demand.request_rate if demand else None,
                "targets": dict(effects.record.targets) if effects.record else {},
                "replicas": {p.role: p.spec_replicas for p in self.pools()},
                "ratio": effects.ratio,
                "summary": effects.record.summary if effects.record else "",
                "simulation": (check.verdict, check.reason) if check else None,
            }
        )
        if sim.active_lanes:
            sim.loop.after(s.tick_s, self._tick)

    def _resize(self, role: PoolRole, replicas: int) -> None:
        pod_role = POOL_ROLES[role]
        current = self.sim.pods_of(pod_role)
        for _ in range(replicas - len(current)):
            self.sim.add_pod(pod_role, self.settings.start_s)
        # the newest go first (as the operator's scale-down ranks a starting pod first)
        for name in sorted(current, key=_pod_index)[replicas:]:
            self.sim.drain_pod(name)


def _pod_index(name: str) -> int:
    return int(name.rsplit("-", 1)[1])
