"""The live loop's core: one call per tick, ``on_tick(now, state, inputs)``,
returning the next state and the effects to carry out. Zero I/O: the time is
passed in (a simulator replays traces on its own clock), the shell reads the
metrics and the pools before and applies the effects after.

Each tick: update each pool's Phase 2 efficiency from what it measured
(a moving average, only from windows with enough requests), solve for the
deployed configurations with the measured demand, then smooth the solver's
targets:

* **up fast, down slow** — a pool grows once ``up_cooldown_s`` has passed since
  its last change, shrinks only after ``down_cooldown_s``;
* **sustained down** — it shrinks only when the target has stayed below its size
  for ``down_window_s``, and never below the highest target of that window;
* **max step** — at most ``max_step`` groups per pool per tick (``Auto`` only:
  ``Recommend`` never moves the pools, so it recommends the target itself);
* **no new scale-up while the pool's pods are pending** (more would not schedule
  either);
* **the budget holds mid-way** — GPUs still held by terminating pods count, so
  a shift from prefill to decode shrinks prefill first and grows decode only
  once the GPUs are free; a budget cut below the current size is applied at
  once, skipping the windows, never more than the cut.

With ``simulate`` on (``Report``, ``Gate``: ``simulate.py``), a proposal that
changes the pools is judged by the simulation the shell ran on it
(``inputs.simulation``, one about this same current → proposed): the record
carries the prediction, the ``SimulationAgrees`` condition says the verdict,
and under ``Gate`` a ``Worse`` proposal is held (the pools and the
recommendation stay as they are). The shell calls ``on_tick`` once to learn
the proposal, runs the simulation, and calls it again from the same state
with the check: the loop stays pure.

Modes: ``Off`` decides nothing (the pools are left to ``kubectl scale``),
``Recommend`` publishes what to set (one event per changed recommendation),
``Auto`` writes it. ``DemandMet`` says whether the pools as they are (their
spec), not the plan, serve the measured demand within the SLOs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from .efficiency import PoolMeasurement, measure_efficiency
from .profiles import EngineProfile, PoolRole
from .simulate import CheckRequest, SimulateMode, SimulationCheck, check_request
from .solver import (
    Decision,
    Demand,
    Incumbent,
    Problem,
    Rejection,
    Slo,
    fixed_plan,
    prefill_token_cost,
    solve,
)

Mode = Literal["Off", "Recommend", "Auto"]
MODES: tuple[Mode, ...] = ("Off", "Recommend", "Auto")


@dataclass(frozen=True)
class LoopSettings:
    up_cooldown_s: float = 60.0
    down_cooldown_s: float = 600.0
    down_window_s: float = 300.0
    max_step: int = 2
    history: int = 10
    efficiency_weight: float = 0.3  # of a new measurement in the moving average
    efficiency_min_requests: int = 20
    efficiency_bounds: tuple[float, float] = (0.25, 4.0)
    # Under a binding budget, the plan in force stays unless another serves
    # this much more: a 4-interval demand window moves by up to 10% on a
    # loaded machine, enough to flip 2P:1D and 1P:2D when their groups are close.
    switch_margin: float = 0.1


@dataclass(frozen=True)
class PoolStatus:
    """One pool as observed: its EnginePool spec and its pods."""

    role: PoolRole
    config: str  # the profile configuration the pool runs
    spec_replicas: int
    pods: int  # pods that exist, starting and terminating ones too (they hold GPUs)
    ready: int
    pending: int  # pods not yet scheduled or started
    gpus_per_replica: int


@dataclass(frozen=True)
class TickInputs:
    mode: Mode
    pools: tuple[PoolStatus, ...]
    profiles: tuple[EngineProfile, ...]
    demand: Demand | None  # None: nothing measured yet
    slo: Slo = field(default_factory=Slo)
    budget_gpus: int | None = None
    headroom: float = 1.2
    min_replicas: int = 1
    measurements: tuple[PoolMeasurement, ...] = ()
    # Each pool's (minReplicas, maxReplicas): the solver's target is held inside.
    bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # Pools whose count another writer owns (an autoscaler), with why: decided, not written.
    external: Mapping[str, str] = field(default_factory=dict)
    simulate: SimulateMode = "Off"
    simulation: SimulationCheck | None = None  # the shell's check of this tick's proposal


@dataclass(frozen=True)
class DecisionRecord:
    """One tick's decision, as status keeps it."""

    at: float
    mode: Mode
    demand_rps: float | None
    mean_input_tokens: float | None
    mean_output_tokens: float | None
    hit_rate: float | None
    targets: Mapping[str, int]  # what the solver wants
    replicas: Mapping[str, int]  # what this tick writes (Auto) or recommends
    binding: str
    summary: str
    held: tuple[str, ...]  # why a target was not (yet) followed
    simulation: SimulationCheck | None = None  # what the simulation said of the proposal


@dataclass(frozen=True)
class LoopState:
    last_spec: Mapping[str, int] = field(default_factory=dict)
    last_change_at: Mapping[str, float] = field(default_factory=dict)
    below_since: Mapping[str, float] = field(default_factory=dict)
    window_max: Mapping[str, int] = field(default_factory=dict)
    efficiency: Mapping[str, float] = field(default_factory=dict)
    history: tuple[DecisionRecord, ...] = ()
    last_message: str = ""


@dataclass(frozen=True)
class ScalePool:
    role: PoolRole
    replicas: int
    previous: int
    reason: str


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Condition:
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


@dataclass(frozen=True)
class Effects:
    scale: tuple[ScalePool, ...]  # Auto only; apply in this order
    events: tuple[Event, ...]
    conditions: tuple[Condition, ...]
    record: DecisionRecord | None  # None in Off
    decision: Decision | None
    ratio: str  # "P:D" now, for `kubectl get td`


def plan_ratio(replicas: Mapping[str, int]) -> str:
    """ "P:D", or the aggregated pool's size."""
    if "prefill" in replicas and "decode" in replicas:
        return f"{replicas['prefill']}:{replicas['decode']}"
    return f"{replicas.get('aggregated', 0)} agg"


def _held_gpus(pools: tuple[PoolStatus, ...], spec: Mapping[str, int]) -> int:
    return sum(max(spec[p.role], p.pods) * p.gpus_per_replica for p in pools)


def update_efficiency(
    settings: LoopSettings,
    current: Mapping[str, float],
    pools: tuple[PoolStatus, ...],
    profiles: tuple[EngineProfile, ...],
    measurements: tuple[PoolMeasurement, ...],
) -> dict[str, float]:
    by_name = {p.name: p for p in profiles}
    out = dict(current)
    lo, hi = settings.efficiency_bounds
    for m in measurements:
        pool = next((p for p in pools if p.role == m.role), None)
        if (
            pool is None
            or pool.config not in by_name
            or m.requests < settings.efficiency_min_requests
        ):
            continue
        profile = by_name[pool.config]
        cost = (
            prefill_token_cost(profiles, profile.config.model, profile.config.hardware)
            if profile.role == "aggregated"
            else None
        )
        e = measure_efficiency(profile, m, cost)
        if e is None:
            continue
        e = min(hi, max(lo, e))
        before = out.get(pool.config)
        w = settings.efficiency_weight
        out[pool.config] = e if before is None else before + w * (e - before)
    return out


def on_tick(
    now: float, state: LoopState, inputs: TickInputs, settings: LoopSettings = LoopSettings()
) -> tuple[LoopState, Effects]:
    spec: dict[str, int] = {p.role: p.spec_replicas for p in inputs.pools}
    # Someone else (kubectl scale, a previous tick) changed a pool: its cooldown
    # starts now.
    last_change = dict(state.last_change_at)
    for role, n in spec.items():
        if state.last_spec.get(role, n) != n:
            last_change[role] = now
    state = replace(state, last_spec=spec, last_change_at=last_change)
    if inputs.mode == "Off":
        state = replace(state, below_since={}, window_max={})
        return state, Effects(
            (),
            (),
            (
                Condition(
                    "ScalingActive",
                    "False",
                    "Off",
                    "scaling mode Off: pools follow their replicas as set",
                ),
            ),
            None,
            None,
            plan_ratio(spec),
        )

    efficiency = update_efficiency(
        settings, state.efficiency, inputs.pools, inputs.profiles, inputs.measurements
    )
    state = replace(state, efficiency=efficiency)
    missing = [
        f"{p.role} pool runs {p.config!r}, which has no profile"
        for p in inputs.pools
        if p.config not in {q.name for q in inputs.profiles}
    ]
    if missing:
        return _invalid(
            now,
            state,
            inputs,
            spec,
            "NoProfile",
            "; ".join(missing),
            "write or take a profile for each pool's configuration",
            settings,
        )
    if inputs.demand is None:
        return state, Effects(
            (),
            (),
            (
                Condition("ScalingActive", "Unknown", "NoDemand", "no demand measured yet"),
                *_not_judged(inputs, "NoDemand", "no demand measured yet"),
            ),
            None,
            None,
            plan_ratio(spec),
        )
    deployed = {p.config for p in inputs.pools}
    previous = state.history[-1] if state.history else None
    in_force = dict(previous.targets) if previous and previous.targets else spec
    problem = Problem(
        profiles=tuple(p for p in inputs.profiles if p.name in deployed),
        demand=inputs.demand,
        slo=inputs.slo,
        budget_gpus=inputs.budget_gpus,
        headroom=inputs.headroom,
        min_replicas=inputs.min_replicas,
        efficiency=efficiency,
        incumbent=Incumbent(
            in_force, {p.role: p.config for p in inputs.pools}, settings.switch_margin
        ),
    )
    decision = solve(problem)
    if decision.plan is None:
        reason = {
            "slo": "SloUnattainable",
            "budget": "BudgetBelowMinimum",
            "capacity": "ContextDoesNotFit",
        }.get(decision.binding, "NoProfile")
        return _invalid(
            now,
            state,
            inputs,
            spec,
            reason,
            "; ".join(decision.reasons),
            "; ".join(decision.changes),
            settings,
            decision,
        )

    targets: dict[str, int] = {p.role: p.replicas for p in decision.plan.pools}
    bounded, held_by_bounds = _within_bounds(targets, inputs.bounds)
    state, replicas, held, reasons = _smooth(now, state, inputs, spec, bounded, settings)
    held = held_by_bounds + held
    simulation = _simulation(inputs, spec, replicas)
    if inputs.simulate == "Gate" and simulation and simulation.verdict == "Worse":
        held.append(
            f"{plan_ratio(spec)} → {plan_ratio(replicas)} held by the simulation: "
            f"{simulation.reason}"
        )
        replicas = dict(spec)
    scale = tuple(
        ScalePool(p.role, replicas[p.role], spec[p.role], reasons[p.role])
        for p in sorted(inputs.pools, key=lambda p: replicas[p.role] - spec[p.role])
        if replicas[p.role] != spec[p.role]
    )
    summary = decision.reasons[0]
    record = DecisionRecord(
        at=now,
        mode=inputs.mode,
        demand_rps=inputs.demand.request_rate,
        mean_input_tokens=inputs.demand.mean_input_tokens,
        mean_output_tokens=inputs.demand.mean_output_tokens,
        hit_rate=inputs.demand.hit_rate,
        targets=targets,
        replicas=replicas,
        binding=decision.binding,
        summary=summary,
        held=tuple(held),
        simulation=simulation,
    )
    events: list[Event] = []
    if inputs.mode == "Auto" and scale:
        events.append(
            Event(
                "Normal",
                "Scaled",
                "; ".join(f"{s.role} {s.previous} → {s.replicas} ({s.reason})" for s in scale),
            )
        )
        last_change = dict(state.last_change_at)
        for s in scale:
            last_change[s.role] = now
        state = replace(
            state,
            last_change_at=last_change,
            last_spec={**state.last_spec, **{s.role: s.replicas for s in scale}},
        )
    message = f"{plan_ratio(replicas)} — {summary}"
    # The summary carries the measured demand, which moves every tick: the
    # event is about the recommendation.
    changed = previous is None or previous.mode != "Recommend" or previous.replicas != replicas
    if inputs.mode == "Recommend" and replicas != spec and changed:
        events.append(
            Event(
                "Normal",
                "ScalingRecommended",
                f"recommend {plan_ratio(replicas)} (now {plan_ratio(spec)}): {summary}",
            )
        )
    conditions = [
        Condition("ScalingActive", "True", inputs.mode, f"scaling mode {inputs.mode}"),
        Condition("ScalingSpecValid", "True", "Valid", "a plan meets the SLOs"),
    ]
    if not decision.meets_demand and inputs.demand.request_rate is not None:
        changes = "; ".join(decision.changes)
        conditions.append(Condition("DemandMet", "False", "BudgetBound", f"{summary}. {changes}"))
        if _verdict(message) != _verdict(state.last_message):
            events.append(Event("Warning", "BudgetBound", f"{summary}. {changes}"))
    elif capped := [h for h in held_by_bounds if "above maxReplicas" in h]:
        message_capped = f"{'; '.join(capped)}: raise maxReplicas to meet the demand"
        conditions.append(Condition("DemandMet", "False", "MaxReplicas", message_capped))
        if _verdict(message) != _verdict(state.last_message):
            events.append(Event("Warning", "MaxReplicas", message_capped))
    elif short := _deployed_shortfall(problem, inputs, spec, replicas):
        conditions.append(Condition("DemandMet", "False", "BelowDemand", short))
    else:
        conditions.append(Condition("DemandMet", "True", "Met", summary))
    if inputs.simulate != "Off":
        conditions.append(_simulation_condition(inputs, simulation, record.replicas != spec))
        if inputs.simulate == "Gate" and simulation and simulation.verdict == "Worse":
            # One Event per proposal held, not per tick that holds it again.
            before = previous.simulation if previous else None
            if not (
                before
                and before.verdict == "Worse"
                and before.about(simulation.current_replicas, simulation.proposed_replicas)
            ):
                events.append(Event("Warning", "SimulationHeld", held[-1]))
    history = (*state.history, record)[-settings.history :]
    state = replace(state, history=history, last_message=message)
    return state, Effects(
        scale if inputs.mode == "Auto" else (),
        tuple(events),
        tuple(conditions),
        record,
        decision,
        plan_ratio(spec),
    )


def simulation_request(inputs: TickInputs, effects: Effects, requests: int) -> CheckRequest | None:
    """What to simulate of a tick's proposal (``requests`` on each side), or
    None: simulation off, no plan, or no change proposed."""
    record = effects.record
    if inputs.simulate == "Off" or record is None or inputs.demand is None or not record.targets:
        return None
    spec = {p.role: p.spec_replicas for p in inputs.pools}
    if dict(record.replicas) == spec:
        return None
    by_name = {p.name: p for p in inputs.profiles}
    pools = {p.role: (by_name[p.config], p.spec_replicas) for p in inputs.pools}
    return check_request(
        pools, record.replicas, inputs.demand, inputs.headroom, inputs.slo, requests
    )


def _simulation(
    inputs: TickInputs, spec: Mapping[str, int], replicas: Mapping[str, int]
) -> SimulationCheck | None:
    """The shell's check of this proposal, if it checked this one."""
    check = inputs.simulation
    if inputs.simulate == "Off" or dict(replicas) == dict(spec) or check is None:
        return None
    return check if check.about(spec, replicas) else None


def _simulation_condition(
    inputs: TickInputs, check: SimulationCheck | None, proposes: bool
) -> Condition:
    kind = "SimulationAgrees"
    if check is None:
        if proposes:
            return Condition(kind, "Unknown", "NotChecked", "the proposal was not simulated")
        return Condition(kind, "Unknown", "NoChange", "no change proposed: nothing to simulate")
    if check.verdict == "Failed":
        return Condition(kind, "Unknown", "CheckFailed", check.reason)
    if check.verdict == "Worse":
        then = "held" if inputs.simulate == "Gate" else "reported only (simulation.mode Report)"
        return Condition(kind, "False", "Worse", f"{check.reason}; {then}")
    return Condition(kind, "True", check.verdict, check.reason)


def _deployed_shortfall(
    problem: Problem, inputs: TickInputs, spec: Mapping[str, int], replicas: Mapping[str, int]
) -> str:
    """Why the pools as deployed do not serve the measured demand within the
    SLOs, or '' when they do (the plan's headroom is not asked of them)."""
    rate = problem.demand.request_rate
    if rate is None:
        return ""
    deployed = fixed_plan(problem, spec, {p.role: p.config for p in inputs.pools})
    if isinstance(deployed, Rejection):
        serves = f"cannot meet the SLOs ({deployed.reason})"
    elif deployed.capacity_rps >= rate * (1 - 1e-9):
        return ""
    else:
        serves = f"serves {deployed.capacity_rps:.3g} req/s within the SLOs"
    then = (
        f"scaling to {plan_ratio(replicas)}"
        if inputs.mode == "Auto" and replicas != spec
        else f"recommended: {plan_ratio(replicas)}"
    )
    return f"the deployed {plan_ratio(spec)} {serves}, below the measured {rate:.3g} req/s; {then}"


# Figures in a message: measured demand, latencies scaled by it and by efficiency.
_FIGURES = re.compile(r"\d+(?:\.\d+)?")


def _verdict(message: str) -> str:
    """A Warning's message without its figures, which move with every tick's
    measurement: the Warning is posted again when the verdict changes."""
    return _FIGURES.sub("#", message)


def _invalid(
    now: float,
    state: LoopState,
    inputs: TickInputs,
    spec: Mapping[str, int],
    reason: str,
    why: str,
    change: str,
    settings: LoopSettings,
    decision: Decision | None = None,
) -> tuple[LoopState, Effects]:
    message = f"{why}. To fix: {change}" if change else why
    events = (
        ()
        if _verdict(message) == _verdict(state.last_message)
        else (Event("Warning", "ScalingSpecInvalid", message),)
    )
    record = DecisionRecord(
        at=now,
        mode=inputs.mode,
        demand_rps=None if inputs.demand is None else inputs.demand.request_rate,
        mean_input_tokens=None if inputs.demand is None else inputs.demand.mean_input_tokens,
        mean_output_tokens=None if inputs.demand is None else inputs.demand.mean_output_tokens,
        hit_rate=None if inputs.demand is None else inputs.demand.hit_rate,
        targets={},
        replicas=dict(spec),
        binding=reason,
        summary=why,
        held=("no valid plan",),
    )
    state = replace(
        state,
        last_message=message,
        below_since={},
        window_max={},
        history=(*state.history, record)[-settings.history :],
    )
    return state, Effects(
        (),
        events,
        (
            Condition("ScalingActive", "True", inputs.mode, f"scaling mode {inputs.mode}"),
            Condition("ScalingSpecValid", "False", reason, message),
            *_not_judged(inputs, reason, f"no valid plan ({why})"),
        ),
        record,
        decision,
        plan_ratio(spec),
    )


def not_judged(reason: str, why: str) -> Condition:
    """DemandMet when this tick has no plan to judge the pools by: the
    verdict of an earlier tick no longer holds."""
    return Condition("DemandMet", "Unknown", reason, f"not judged: {why}")


def _not_judged(inputs: TickInputs, reason: str, why: str) -> tuple[Condition, ...]:
    """The conditions a tick without a plan says: DemandMet, and
    SimulationAgrees when simulation is on (no proposal to check)."""
    out = [not_judged(reason, why)]
    if inputs.simulate != "Off":
        out.append(_simulation_condition(inputs, None, False))
    return tuple(out)


def _within_bounds(
    targets: Mapping[str, int],
    bounds: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, int], list[str]]:
    out, held = dict(targets), []
    for role, target in targets.items():
        lo, hi = bounds.get(role, (0, target))
        if target > hi:
            held.append(f"{role}: target {target} is above maxReplicas {hi}")
        elif target < lo:
            held.append(f"{role}: target {target} is below minReplicas {lo}")
        out[role] = max(lo, min(hi, target))
    return out, held


def _smooth(
    now: float,
    state: LoopState,
    inputs: TickInputs,
    spec: Mapping[str, int],
    targets: Mapping[str, int],
    s: LoopSettings,
) -> tuple[LoopState, dict[str, int], list[str], dict[str, str]]:
    below_since = dict(state.below_since)
    window_max = dict(state.window_max)
    step = s.max_step if inputs.mode == "Auto" else max([*spec.values(), *targets.values(), 0])
    replicas = dict(spec)
    held: list[str] = []
    reasons: dict[str, str] = {}
    budget = inputs.budget_gpus
    over_budget = (
        budget is not None and sum(spec[p.role] * p.gpus_per_replica for p in inputs.pools) > budget
    )

    for role, why in inputs.external.items():
        if targets.get(role, spec.get(role)) != spec.get(role):
            held.append(f"{role}: {spec.get(role)} → {targets.get(role)} not written: {why}")
    for pool in inputs.pools:
        role, current, target = pool.role, spec[pool.role], targets[pool.role]
        since_change = now - state.last_change_at.get(role, -float("inf"))
        if role in inputs.external:
            continue
        if target >= current:
            below_since.pop(role, None)
            window_max.pop(role, None)
            continue
        if over_budget:
            # The budget was cut: follow the plan down at once (it fits the budget).
            replicas[role] = target
            reasons[role] = f"GPU budget cut to {budget}"
            continue
        start = below_since.setdefault(role, now)
        window_max[role] = max(window_max.get(role, target), target)
        if now - start < s.down_window_s:
            held.append(
                f"{role}: {current} → {target} waits for the target to stay lower "
                f"{s.down_window_s - (now - start):.0f} s more"
            )
        elif since_change < s.down_cooldown_s:
            held.append(
                f"{role}: scale-down cooldown, {s.down_cooldown_s - since_change:.0f} s left"
            )
        else:
            replicas[role] = max(window_max[role], current - step)
            reasons[role] = (
                f"target {target} below {current} for {now - start:.0f} s; the "
                f"window's highest target is {window_max[role]}"
            )

    # Scale-ups, the largest relative shortfall first, while the GPUs held
    # (terminating pods included) stay within the budget.
    ups = sorted(
        (
            p
            for p in inputs.pools
            if targets[p.role] > spec[p.role] and p.role not in inputs.external
        ),
        key=lambda p: -(targets[p.role] / max(spec[p.role], 1)),
    )
    for pool in ups:
        role, current, target = pool.role, spec[pool.role], targets[pool.role]
        since_change = now - state.last_change_at.get(role, -float("inf"))
        if pool.pending:
            held.append(f"{role}: {current} → {target} waits: {pool.pending} pod(s) pending")
            continue
        if since_change < s.up_cooldown_s:
            held.append(f"{role}: scale-up cooldown, {s.up_cooldown_s - since_change:.0f} s left")
            continue
        want = min(target, current + step)
        if budget is not None:
            room = budget - _held_gpus(inputs.pools, {**replicas, role: current})
            want = min(want, current + max(0, room) // pool.gpus_per_replica)
        if want <= current:
            held.append(
                f"{role}: {current} → {target} waits for GPUs to free within the budget of {budget}"
            )
            continue
        replicas[role] = want
        reasons[role] = f"target {target}"
        if want < target:
            held.append(f"{role}: stepping {current} → {want} of {target}")
    return replace(state, below_since=below_since, window_max=window_max), replicas, held, reasons
