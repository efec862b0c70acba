"""The ratio solver: how many prefill and decode groups (or aggregated
replicas) serve a demand within the SLOs and a GPU budget, and why.

Zero I/O: profiles, the demand and the limits come in as dataclasses, a
`Decision` with its reasons comes out.

How a replica's capacity is read from its profile, for this demand:

* **Prefill** work is the uncached part of each prompt: a group's capacity in
  requests/s is its profiled uncached-token rate divided by the demand's
  uncached tokens per request, ``input × (1 − hit rate)``. More hits → more
  requests per group → fewer prefill groups. TTFT at the same token rate
  scales with the uncached tokens per request (the same utilisation with
  longer jobs queues proportionally longer).
* **Decode** capacity is the profiled output-token rate divided by the output
  tokens per request. At each load the requests in flight (profiled, Little's
  law) each hold the demand's mean context, ``input + output / 2`` tokens of
  KV: loads whose KV exceeds the replica's capacity are out of reach, so
  longer contexts lower the decode capacity.
* **Aggregated** replicas do both: their profiled request rate is rescaled by
  the cost of a request, ``uncached input × k + output`` with ``k`` the
  cost of a prefill token in decode tokens, read from the prefill and decode
  profiles of the same model and hardware.
* The **SLO operating point** is the highest load whose predicted TTFT p90
  (prefill, aggregated), P90 interactivity and KV (decode, aggregated) stay
  within bounds, interpolated linearly between profiled points.
* **Phase 2** efficiency ``e`` (measured ÷ profiled throughput at equal load,
  per configuration; 1 before anything is measured) multiplies rates and
  divides latencies.

The search: for every pair of prefill and decode configurations of a model,
and every aggregated configuration, the integer sizing that meets
``demand × headroom`` with the fewest GPUs (the most goodput per GPU); when no
sizing within the budget meets it, the one that serves the most (ties: fewer
GPUs). Across candidates the same order decides.

When the budget binds, shapes of equal GPUs can serve nearly the same (2P:1D
and 1P:2D when a prefill and a decode group take about the same rate), and
which wins follows each window's measured shape. An ``Incumbent`` (the plan
in force) is kept then unless the best plan serves more by its ``margin``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from .profiles import EngineProfile, PoolRole, ProfilePoint

Limit = Literal["saturation", "profile-end", "one-point", "ttft_p90", "interactivity_p90", "kv"]
Binding = Literal["demand", "budget", "slo", "kv", "capacity", "no-profile"]
PlanKind = Literal["disaggregated", "aggregated"]

# Relative tolerance: capacities that differ by rounding alone are equal.
_EPS = 1e-9


@dataclass(frozen=True)
class Demand:
    """What the pools must serve. ``request_rate`` None sizes for the budget
    alone. ``hit_rate`` None means each configuration's own profiled hit
    rate (what it achieved on the profiled trace)."""

    request_rate: float | None
    mean_input_tokens: float
    mean_output_tokens: float
    hit_rate: float | None = None


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float | None = None
    interactivity_p90: float | None = None  # tokens/s/user


@dataclass(frozen=True)
class Incumbent:
    """The sizing in force (role → replicas, role → configuration name): kept
    while the budget binds unless the best plan serves ``margin`` more."""

    replicas: Mapping[str, int]
    configs: Mapping[str, str]
    margin: float


@dataclass(frozen=True)
class Problem:
    profiles: tuple[EngineProfile, ...]
    demand: Demand
    slo: Slo = field(default_factory=Slo)
    budget_gpus: int | None = None
    headroom: float = 1.2
    min_replicas: int = 1
    # Phase 2: measured ÷ profiled throughput per configuration name.
    efficiency: Mapping[str, float] = field(default_factory=dict)
    # Configurations the capacity check refused, with its reason.
    refused: Mapping[str, str] = field(default_factory=dict)
    incumbent: Incumbent | None = None


@dataclass(frozen=True)
class OperatingPoint:
    """One replica of a configuration at the highest load the SLOs allow."""

    config: str
    role: PoolRole
    gpus_per_replica: int
    capacity_rps: float  # per replica, at the SLO, for this demand
    saturation_rps: float  # per replica with no SLO (still within KV)
    unconstrained_rps: float  # per replica with no SLO and no KV limit
    limit: Limit
    in_flight: float | None  # requests in flight per replica at the operating point
    ttft_p90_s: float | None
    interactivity_p90: float | None
    hit_rate: float
    efficiency: float


@dataclass(frozen=True)
class Rejection:
    config: str
    reason: str
    limit: str  # "ttft_p90", "interactivity_p90", "kv", "capacity", "profile"
    # The best value the configuration reaches (lowest TTFT, highest interactivity).
    best_value: float | None = None


@dataclass(frozen=True)
class PoolPlan:
    role: PoolRole
    config: str
    replicas: int
    gpus: int
    capacity_rps: float  # replicas × per-replica capacity
    utilization: float | None  # demand ÷ capacity (None without a demand)
    point: OperatingPoint


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    pools: tuple[PoolPlan, ...]

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def capacity_rps(self) -> float:
        return min(p.capacity_rps for p in self.pools)

    def pool(self, role: PoolRole) -> PoolPlan | None:
        return next((p for p in self.pools if p.role == role), None)

    @property
    def ratio(self) -> float | None:
        """Prefill groups per decode group."""
        prefill, decode = self.pool("prefill"), self.pool("decode")
        if prefill is None or decode is None:
            return None
        return prefill.replicas / decode.replicas

    def label(self) -> str:
        if self.kind == "aggregated":
            pool = self.pools[0]
            return f"{pool.replicas}× aggregated {pool.config}"
        prefill, decode = self.pools
        return f"{prefill.replicas}P {prefill.config} + {decode.replicas}D {decode.config}"


@dataclass(frozen=True)
class Decision:
    plan: Plan | None
    meets_demand: bool
    binding: Binding
    reasons: tuple[str, ...]
    changes: tuple[str, ...]  # what would change the decision
    best_disaggregated: Plan | None = None
    best_aggregated: Plan | None = None
    rejected: tuple[Rejection, ...] = ()

    @property
    def goodput_rps(self) -> float:
        return 0.0 if self.plan is None else self.plan.capacity_rps


# -- operating points -------------------------------------------------------------


@dataclass(frozen=True)
class _Sample:
    capacity_rps: float
    in_flight: float | None
    ttft_p90_s: float | None
    interactivity_p90: float | None
    kv_tokens: float | None
    hit_rate: float


def _uncached(demand: Demand, point: ProfilePoint) -> float:
    hit = point.hit_rate if demand.hit_rate is None else demand.hit_rate
    return demand.mean_input_tokens * (1.0 - hit)


def prefill_token_cost(
    profiles: Sequence[EngineProfile], model: str, hardware: str
) -> float | None:
    """Cost of one uncached prefill token in decode tokens on this hardware:
    saturated decode tokens/s per GPU over saturated uncached prefill tokens/s
    per GPU, from the profiles of the same model and hardware (None if either
    is missing)."""

    def best(role: PoolRole, rate: str) -> float | None:
        rates = [
            max(getattr(pt, rate) for pt in p.points) / p.config.gpus_per_replica
            for p in profiles
            if p.role == role and p.config.model == model and p.config.hardware == hardware
        ]
        return max(rates) if rates else None

    prefill = best("prefill", "uncached_tokens_per_s")
    decode = best("decode", "output_tokens_per_s")
    if prefill is None or decode is None or prefill <= 0:
        return None
    return decode / prefill


def _sample(
    profile: EngineProfile, point: ProfilePoint, demand: Demand, e: float, token_cost: float | None
) -> _Sample:
    role = profile.role
    context = demand.mean_input_tokens + demand.mean_output_tokens / 2.0
    uncached_d = _uncached(demand, point)
    uncached_p = point.mean_uncached_tokens
    hit = point.hit_rate if demand.hit_rate is None else demand.hit_rate
    ttft = (
        None
        if point.ttft_p90_s is None
        else (point.ttft_p90_s * (uncached_d / uncached_p if uncached_p > 0 else 1.0) / e)
    )
    if role == "prefill":
        capacity = point.uncached_tokens_per_s * e / max(uncached_d, 1.0)
        return _Sample(capacity, point.in_flight, ttft, None, None, hit)
    interactivity = None if point.interactivity_p90 is None else point.interactivity_p90 * e
    kv = None if point.in_flight is None else point.in_flight * context
    if role == "decode":
        capacity = point.output_tokens_per_s * e / max(demand.mean_output_tokens, 1.0)
        return _Sample(capacity, point.in_flight, None, interactivity, kv, hit)
    scale = 1.0
    if token_cost is not None:
        cost_p = uncached_p * token_cost + point.mean_output_tokens
        cost_d = uncached_d * token_cost + demand.mean_output_tokens
        scale = cost_p / cost_d
    return _Sample(point.request_rate * e * scale, point.in_flight, ttft, interactivity, kv, hit)


def _violations(s: _Sample, slo: Slo, kv_capacity: int | None) -> list[tuple[Limit, float]]:
    """Each constraint as (name, margin), margin < 0 when violated; margins are
    relative so that interpolating them finds the crossing."""
    out: list[tuple[Limit, float]] = []
    if slo.ttft_p90_s is not None and s.ttft_p90_s is not None:
        out.append(("ttft_p90", 1.0 - s.ttft_p90_s / slo.ttft_p90_s))
    if slo.interactivity_p90 is not None and s.interactivity_p90 is not None:
        out.append(("interactivity_p90", s.interactivity_p90 / slo.interactivity_p90 - 1.0))
    if kv_capacity is not None and s.kv_tokens is not None:
        out.append(("kv", 1.0 - s.kv_tokens / kv_capacity))
    return out


def operating_point(
    profile: EngineProfile,
    demand: Demand,
    slo: Slo,
    efficiency: float = 1.0,
    token_cost: float | None = None,
) -> OperatingPoint | Rejection:
    """A replica's capacity for this demand at the highest load within the
    SLOs and KV, or why no load is."""
    c = profile.config
    if (
        c.role in ("decode", "aggregated")
        and slo.interactivity_p90 is not None
        and any(p.interactivity_p90 is None for p in profile.points)
    ):
        return Rejection(
            c.name,
            f"{c.name}: the profile has no P90 interactivity to check the SLO against",
            "profile",
        )
    if (
        c.role in ("prefill", "aggregated")
        and slo.ttft_p90_s is not None
        and any(p.ttft_p90_s is None for p in profile.points)
    ):
        return Rejection(
            c.name, f"{c.name}: the profile has no TTFT p90 to check the SLO against", "profile"
        )
    context = demand.mean_input_tokens + demand.mean_output_tokens / 2.0
    if c.role != "prefill" and c.kv_capacity_tokens is not None and context > c.kv_capacity_tokens:
        return Rejection(
            c.name,
            f"{c.name}: one request of {context:,.0f} tokens exceeds the "
            f"replica's KV capacity of {c.kv_capacity_tokens:,} tokens",
            "kv",
        )
    measured = [_sample(profile, p, demand, efficiency, token_cost) for p in profile.points]
    # Below the lowest profiled load: nothing in flight, latencies at their
    # lowest profiled values (they do not fall further with less load), so
    # only the KV limit can be met there by serving less.
    first = measured[0]
    idle = _Sample(
        0.0,
        None if first.in_flight is None else 0.0,
        first.ttft_p90_s,
        first.interactivity_p90,
        None if first.kv_tokens is None else 0.0,
        first.hit_rate,
    )
    samples = [idle, *measured]
    margins = [_violations(s, slo, c.kv_capacity_tokens) for s in samples]
    if any(m < 0 for _, m in margins[0]):
        return _rejection(profile, idle, margins[0], slo)
    best = samples[0]
    best_limit: Limit = "saturation"
    for i in range(1, len(samples)):
        violated = [(name, m) for name, m in margins[i] if m < 0]
        if not violated:
            if samples[i].capacity_rps > best.capacity_rps:
                best = samples[i]
            continue
        # Interpolate the crossing of the first constraint to break.
        prev = dict(margins[i - 1])
        t, limit = min((prev[name] / (prev[name] - m), name) for name, m in violated)
        crossing = _interpolate(samples[i - 1], samples[i], t)
        if crossing.capacity_rps > best.capacity_rps:
            best = crossing
            best_limit = limit
        break
    else:
        if len(measured) == 1:
            best_limit = "one-point"
        elif best is samples[-1] and best.capacity_rps > 1.05 * samples[-2].capacity_rps:
            best_limit = "profile-end"
    saturation = _saturation(samples, margins)
    return OperatingPoint(
        config=c.name,
        role=c.role,
        gpus_per_replica=c.gpus_per_replica,
        capacity_rps=best.capacity_rps,
        saturation_rps=saturation,
        unconstrained_rps=max(s.capacity_rps for s in samples),
        limit=best_limit,
        in_flight=best.in_flight,
        ttft_p90_s=best.ttft_p90_s,
        interactivity_p90=best.interactivity_p90,
        hit_rate=best.hit_rate,
        efficiency=efficiency,
    )


def _saturation(samples: list[_Sample], margins: list[list[tuple[Limit, float]]]) -> float:
    """Highest capacity within KV alone (what the replica does with no SLO)."""
    best = 0.0
    for i, s in enumerate(samples):
        kv = dict(margins[i]).get("kv")
        if kv is not None and kv < 0:
            if i:
                prev = dict(margins[i - 1])["kv"]
                best = max(best, _interpolate(samples[i - 1], s, prev / (prev - kv)).capacity_rps)
            break
        best = max(best, s.capacity_rps)
    return best


def _interpolate(a: _Sample, b: _Sample, t: float) -> _Sample:
    def lerp(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else x + (y - x) * t

    return _Sample(
        capacity_rps=a.capacity_rps + (b.capacity_rps - a.capacity_rps) * t,
        in_flight=lerp(a.in_flight, b.in_flight),
        ttft_p90_s=lerp(a.ttft_p90_s, b.ttft_p90_s),
        interactivity_p90=lerp(a.interactivity_p90, b.interactivity_p90),
        kv_tokens=lerp(a.kv_tokens, b.kv_tokens),
        hit_rate=a.hit_rate + (b.hit_rate - a.hit_rate) * t,
    )


def _rejection(
    profile: EngineProfile, s: _Sample, margins: list[tuple[Limit, float]], slo: Slo
) -> Rejection:
    name = profile.config.name
    limit = min(margins, key=lambda nm: nm[1])[0]
    if limit == "ttft_p90":
        assert s.ttft_p90_s is not None and slo.ttft_p90_s is not None
        return Rejection(
            name,
            f"{name}: TTFT p90 is {s.ttft_p90_s:.2f} s already at the lowest "
            f"profiled load (SLO {slo.ttft_p90_s:g} s)",
            limit,
            s.ttft_p90_s,
        )
    assert s.interactivity_p90 is not None and slo.interactivity_p90 is not None
    return Rejection(
        name,
        f"{name}: P90 interactivity is {s.interactivity_p90:.2f} tok/s "
        f"already at the lowest profiled load (SLO {slo.interactivity_p90:g})",
        limit,
        s.interactivity_p90,
    )


# -- sizing -----------------------------------------------------------------------


def _pool(point: OperatingPoint, replicas: int, demand_rps: float | None) -> PoolPlan:
    capacity = replicas * point.capacity_rps
    return PoolPlan(
        role=point.role,
        config=point.config,
        replicas=replicas,
        gpus=replicas * point.gpus_per_replica,
        capacity_rps=capacity,
        utilization=None if demand_rps is None else demand_rps / capacity,
        point=point,
    )


def _groups(need_rps: float, per_group_rps: float) -> int:
    return math.ceil(need_rps / per_group_rps * (1 - _EPS))


def size_disaggregated(
    prefill: OperatingPoint,
    decode: OperatingPoint,
    need_rps: float | None,
    budget: int | None,
    min_replicas: int,
    demand_rps: float | None,
) -> Plan | None:
    """The integer (P, D): with a need that fits the budget, the fewest GPUs
    meeting it; otherwise the most capacity within the budget (ties: fewer
    GPUs). None when even the minimum pools exceed the budget."""
    a, b = prefill.capacity_rps, decode.capacity_rps
    gp, gd = prefill.gpus_per_replica, decode.gpus_per_replica
    if need_rps is not None:
        p = max(min_replicas, _groups(need_rps, a))
        d = max(min_replicas, _groups(need_rps, b))
        if budget is None or p * gp + d * gd <= budget:
            return Plan(
                "disaggregated", (_pool(prefill, p, demand_rps), _pool(decode, d, demand_rps))
            )
    if budget is None:
        raise ValueError("nothing to size against: neither a request rate nor a GPU budget")
    best: tuple[float, int, int, int] | None = None  # (capacity, gpus, p, d)
    p = min_replicas
    while p * gp + min_replicas * gd <= budget:
        d_max = (budget - p * gp) // gd
        balanced = p * a / b
        for d in {
            min(d_max, max(min_replicas, math.floor(balanced))),
            min(d_max, max(min_replicas, math.ceil(balanced))),
        }:
            cap, gpus = min(p * a, d * b), p * gp + d * gd
            if best is None or _outranks(cap, gpus, best[0], best[1], None):
                best = (cap, gpus, p, d)
        p += 1
    if best is None:
        return None
    return Plan(
        "disaggregated", (_pool(prefill, best[2], demand_rps), _pool(decode, best[3], demand_rps))
    )


def size_aggregated(
    point: OperatingPoint,
    need_rps: float | None,
    budget: int | None,
    min_replicas: int,
    demand_rps: float | None,
) -> Plan | None:
    g = point.gpus_per_replica
    if need_rps is not None:
        n = max(min_replicas, _groups(need_rps, point.capacity_rps))
        if budget is None or n * g <= budget:
            return Plan("aggregated", (_pool(point, n, demand_rps),))
    if budget is None:
        raise ValueError("nothing to size against: neither a request rate nor a GPU budget")
    n = budget // g
    if n < min_replicas:
        return None
    return Plan("aggregated", (_pool(point, n, demand_rps),))


def _outranks(cap_a: float, gpus_a: int, cap_b: float, gpus_b: int, need_rps: float | None) -> bool:
    """Does (capacity a, GPUs a) beat b: meeting the need first, then fewer
    GPUs (more goodput per GPU), then more capacity; unmet, more capacity
    then fewer GPUs. Capacities within rounding count as equal."""
    meets_a = need_rps is not None and cap_a >= need_rps * (1 - _EPS)
    meets_b = need_rps is not None and cap_b >= need_rps * (1 - _EPS)
    if meets_a != meets_b:
        return meets_a
    same_cap = abs(cap_a - cap_b) <= _EPS * max(cap_a, cap_b)
    if meets_a:
        return gpus_a < gpus_b if gpus_a != gpus_b else (cap_a > cap_b and not same_cap)
    return cap_a > cap_b if not same_cap else gpus_a < gpus_b


def _better(a: Plan, b: Plan, need_rps: float | None) -> bool:
    return _outranks(a.capacity_rps, a.gpus, b.capacity_rps, b.gpus, need_rps)


# -- the decision -----------------------------------------------------------------


def _operating_points(
    problem: Problem,
) -> tuple[dict[PoolRole, list[tuple[OperatingPoint, str]]], list[Rejection]]:
    rejected: list[Rejection] = []
    points: dict[PoolRole, list[tuple[OperatingPoint, str]]] = {
        "prefill": [],
        "decode": [],
        "aggregated": [],
    }
    for profile in problem.profiles:
        c = profile.config
        if c.name in problem.refused:
            rejected.append(Rejection(c.name, problem.refused[c.name], "capacity"))
            continue
        cost = (
            prefill_token_cost(problem.profiles, c.model, c.hardware)
            if c.role == "aggregated"
            else None
        )
        op = operating_point(
            profile, problem.demand, problem.slo, problem.efficiency.get(c.name, 1.0), cost
        )
        if isinstance(op, Rejection):
            rejected.append(op)
        else:
            points[c.role].append((op, c.model))
    return points, rejected


def fixed_plan(
    problem: Problem, replicas: Mapping[str, int], configs: Mapping[str, str]
) -> Plan | Rejection:
    """What a given sizing (role → replicas, role → configuration name)
    serves within the SLOs for the problem's demand, or why it cannot."""
    points, rejected = _operating_points(problem)
    pools = []
    for role, n in replicas.items():
        name = configs[role]
        found = [op for op, _ in points.get(cast(PoolRole, role), []) if op.config == name]
        if not found:
            why = next((r for r in rejected if r.config == name), None)
            return why or Rejection(name, f"{name}: no {role} profile of that name", "profile")
        pools.append(_pool(found[0], n, problem.demand.request_rate))
    kind: PlanKind = "aggregated" if set(replicas) == {"aggregated"} else "disaggregated"
    order = {"prefill": 0, "decode": 1, "aggregated": 2}
    return Plan(kind, tuple(sorted(pools, key=lambda p: order[p.role])))


def solve(problem: Problem) -> Decision:
    demand_rps = problem.demand.request_rate
    need = None if demand_rps is None else demand_rps * problem.headroom
    if need is None and problem.budget_gpus is None:
        raise ValueError("nothing to size against: neither a request rate nor a GPU budget")
    points, rejected = _operating_points(problem)

    best_disagg: Plan | None = None
    best_agg: Plan | None = None
    over_budget: list[str] = []
    for pre, model in points["prefill"]:
        for dec, dec_model in points["decode"]:
            if dec_model != model:
                continue
            plan = size_disaggregated(
                pre, dec, need, problem.budget_gpus, problem.min_replicas, demand_rps
            )
            if plan is None:
                over_budget.append(f"{pre.config} + {dec.config}")
            elif best_disagg is None or _better(plan, best_disagg, need):
                best_disagg = plan
    for agg, _ in points["aggregated"]:
        plan = size_aggregated(agg, need, problem.budget_gpus, problem.min_replicas, demand_rps)
        if plan is None:
            over_budget.append(agg.config)
        elif best_agg is None or _better(plan, best_agg, need):
            best_agg = plan

    candidates = [p for p in (best_disagg, best_agg) if p is not None]
    if not candidates:
        return _no_plan(problem, rejected, over_budget)
    plan = candidates[0]
    for other in candidates[1:]:
        if _better(other, plan, need):
            plan = other
    meets = need is not None and plan.capacity_rps >= need * (1 - _EPS)
    kept = None if meets else _kept_incumbent(problem, plan)
    best, plan = plan, kept or plan
    binding = _binding(plan, meets, need, problem.min_replicas)
    reasons, changes = _explain(
        problem, plan, binding, meets, need, best_disagg, best_agg, rejected
    )
    if kept is not None and problem.incumbent is not None:
        reasons.insert(
            1,
            f"kept {kept.label()}: the best, {best.label()}, serves "
            f"{_fmt_rps(best.capacity_rps)}, not {problem.incumbent.margin:.0%} more than "
            f"its {_fmt_rps(kept.capacity_rps)}",
        )
    return Decision(
        plan=plan,
        meets_demand=meets,
        binding=binding,
        reasons=tuple(reasons),
        changes=tuple(changes),
        best_disaggregated=best_disagg,
        best_aggregated=best_agg,
        rejected=tuple(rejected),
    )


def _kept_incumbent(problem: Problem, best: Plan) -> Plan | None:
    """The incumbent's plan when the budget binds and the best plan does not
    serve its margin more (None: follow the best)."""
    incumbent = problem.incumbent
    if incumbent is None or {p.role for p in best.pools} != set(incumbent.replicas):
        return None
    if all(incumbent.replicas[p.role] == p.replicas for p in best.pools):
        return None
    held = fixed_plan(problem, incumbent.replicas, incumbent.configs)
    if isinstance(held, Rejection):
        return None
    if problem.budget_gpus is not None and held.gpus > problem.budget_gpus:
        return None
    if best.capacity_rps > held.capacity_rps * (1 + incumbent.margin):
        return None
    return held


def _binding(plan: Plan, meets: bool, need: float | None, min_replicas: int) -> Binding:
    """What decided the size: the budget when the need is unmet; else an SLO
    (or KV) when a pool needs more groups than its saturated capacity would;
    else the demand."""
    if not meets or need is None:
        return "budget"
    for pool in plan.pools:
        pt = pool.point
        without = pt.unconstrained_rps if pt.limit == "kv" else pt.saturation_rps
        if (
            pt.limit in ("ttft_p90", "interactivity_p90", "kv")
            and max(min_replicas, _groups(need, without)) < pool.replicas
        ):
            return "kv" if pt.limit == "kv" else "slo"
    return "demand"


def _no_plan(problem: Problem, rejected: list[Rejection], over_budget: list[str]) -> Decision:
    reasons: list[str] = []
    changes: list[str] = []
    binding: Binding
    if over_budget:
        binding = "budget"
        smallest = _smallest_gpus(problem)
        reasons.append(
            f"the GPU budget ({problem.budget_gpus}) is below the minimum pools of "
            f"every configuration ({', '.join(over_budget)})"
        )
        changes.append(f"raise the GPU budget to at least {smallest}")
    elif not problem.profiles:
        binding = "no-profile"
        reasons.append("no engine profile to size from")
        changes.append(
            "take a profile (tandem profile --role …) or write one from published "
            "figures, and list it in the scaling spec"
        )
    elif rejected and all(r.limit == "capacity" for r in rejected):
        binding = "capacity"
        reasons.extend(r.reason for r in rejected)
        changes.append(
            "use more context parallelism (DCP/PCP), a smaller KV dtype, or a "
            "shorter longest context"
        )
    else:
        binding = "slo"
        reasons.extend(r.reason for r in rejected)
        changes.extend(_slo_changes(problem, rejected))
    roles = {p.role for p in problem.profiles}
    if binding == "slo" and not ({"prefill", "decode"} <= roles or "aggregated" in roles):
        binding = "no-profile"
        reasons.append(
            f"profiles cover only {sorted(roles)}: a plan needs prefill and decode "
            f"profiles, or an aggregated one"
        )
    return Decision(
        plan=None,
        meets_demand=False,
        binding=binding,
        reasons=tuple(reasons),
        changes=tuple(changes),
        rejected=tuple(rejected),
    )


def _smallest_gpus(problem: Problem) -> int:
    m = problem.min_replicas
    by_role: dict[PoolRole, list[int]] = {"prefill": [], "decode": [], "aggregated": []}
    for p in problem.profiles:
        by_role[p.role].append(p.config.gpus_per_replica)
    options = [m * g for g in by_role["aggregated"]]
    if by_role["prefill"] and by_role["decode"]:
        options.append(m * (min(by_role["prefill"]) + min(by_role["decode"])))
    return min(options) if options else 0


def _round_up(x: float) -> float:
    """x to two decimals, upwards: a TTFT SLO printed from it is one the profile meets."""
    return math.ceil(x * 100 - 1e-9) / 100


def _round_down(x: float) -> float:
    """x to two decimals, downwards: an interactivity SLO printed from it is one
    the profile meets."""
    return math.floor(x * 100 + 1e-9) / 100


def _slo_changes(problem: Problem, rejected: list[Rejection]) -> list[str]:
    out = []
    ttft = [r.best_value for r in rejected if r.limit == "ttft_p90" and r.best_value]
    inter = [r.best_value for r in rejected if r.limit == "interactivity_p90" and r.best_value]
    if ttft:
        out.append(
            f"relax the TTFT p90 SLO to at least {_round_up(min(ttft)):.2f} s (the best any "
            f"profile reaches), or profile a faster prefill configuration"
        )
    if inter:
        out.append(
            f"relax the P90 interactivity SLO to at most {_round_down(max(inter)):.2f} tok/s (the "
            f"best any profile reaches), or profile a faster decode configuration"
        )
    if any(r.limit == "kv" for r in rejected):
        out.append("give decode replicas more KV capacity, or serve shorter contexts")
    if any(r.limit == "profile" for r in rejected):
        out.append(
            "measure the configurations (tandem profile) so the SLO can be checked, or "
            "drop that SLO"
        )
    return out


def _fmt_rps(x: float) -> str:
    return f"{x:,.0f} req/s" if x >= 100 else f"{x:.3g} req/s"


def _explain(
    problem: Problem,
    plan: Plan,
    binding: Binding,
    meets: bool,
    need: float | None,
    best_disagg: Plan | None,
    best_agg: Plan | None,
    rejected: list[Rejection],
) -> tuple[list[str], list[str]]:
    demand_rps = problem.demand.request_rate
    reasons: list[str] = []
    changes: list[str] = []
    if demand_rps is None:
        reasons.append(
            f"sized for the GPU budget alone ({problem.budget_gpus} GPUs): "
            f"{plan.label()} serves {_fmt_rps(plan.capacity_rps)} within the SLOs"
        )
    elif meets:
        bound = {
            "demand": "demand-bound",
            "slo": "SLO-bound (the SLOs cost groups)",
            "kv": "KV-bound (the context length costs decode groups)",
        }[binding]
        reasons.append(
            f"{bound}: {_fmt_rps(demand_rps)} × headroom {problem.headroom:g} "
            f"= {_fmt_rps(need or 0)} met by {plan.label()} on {plan.gpus} GPUs "
            f"({_fmt_rps(plan.capacity_rps / plan.gpus)} per GPU)"
        )
    else:
        reasons.append(
            f"budget-bound: {problem.budget_gpus} GPUs serve at most "
            f"{_fmt_rps(plan.capacity_rps)} ({plan.label()}) of the "
            f"{_fmt_rps(need or 0)} needed"
        )
    for pool in plan.pools:
        pt = pool.point
        limit = {
            "saturation": "saturation (throughput stops growing)",
            "profile-end": "the highest profiled load (throughput was still growing: "
            "profile further)",
            "one-point": "its one profiled operating point (no load sweep)",
            "ttft_p90": "the TTFT p90 SLO",
            "interactivity_p90": "the P90 interactivity SLO",
            "kv": "KV capacity at this context",
        }[pt.limit]
        util = "" if pool.utilization is None else f", utilization {pool.utilization:.0%}"
        reasons.append(
            f"{pool.role} ({pool.config}): {pool.replicas} × "
            f"{_fmt_rps(pt.capacity_rps)} per group, limited by {limit}{util}"
        )
        if pt.limit in ("ttft_p90", "interactivity_p90") and pt.saturation_rps > pt.capacity_rps:
            changes.append(
                f"{pool.role}: without the {pt.limit.replace('_', ' ')} SLO a group "
                f"would take {_fmt_rps(pt.saturation_rps)} instead of "
                f"{_fmt_rps(pt.capacity_rps)}"
            )
        if pt.limit == "kv" and pt.unconstrained_rps > pt.capacity_rps:
            changes.append(
                f"{pool.role}: with KV for more concurrent requests at this context a "
                f"group would take up to {_fmt_rps(pt.unconstrained_rps)} instead of "
                f"{_fmt_rps(pt.capacity_rps)}"
            )
    ratio = plan.ratio
    if ratio is not None:
        pre, dec = plan.pool("prefill"), plan.pool("decode")
        assert pre is not None and dec is not None
        gpus = (
            ""
            if pre.point.gpus_per_replica == dec.point.gpus_per_replica
            else (f"; GPUs {pre.gpus}:{dec.gpus}")
        )
        reasons.append(
            f"P/D = {pre.replicas}/{dec.replicas} = {ratio:.2f} (per-group capacities "
            f"{_fmt_rps(pre.point.capacity_rps)} prefill vs "
            f"{_fmt_rps(dec.point.capacity_rps)} decode: the faster side gets fewer "
            f"groups; balance at {dec.point.capacity_rps / pre.point.capacity_rps:.2f}"
            f"{gpus})"
        )
    if meets and demand_rps is not None:
        first = min(plan.pools, key=lambda p: p.capacity_rps)
        holds = plan.capacity_rps / problem.headroom
        changes.append(
            f"holds up to {_fmt_rps(holds)} of demand (+{holds / demand_rps - 1:.0%});"
            f" beyond it the {first.role} pool needs another group"
        )
        for pool in plan.pools:
            if pool.replicas > problem.min_replicas:
                drop = (pool.replicas - 1) * pool.point.capacity_rps / problem.headroom
                changes.append(
                    f"below {_fmt_rps(drop)} of demand the {pool.role} pool can drop a group"
                )
    elif need is not None and problem.budget_gpus is not None:
        unbounded = solve(
            Problem(
                problem.profiles,
                problem.demand,
                problem.slo,
                None,
                problem.headroom,
                problem.min_replicas,
                problem.efficiency,
                problem.refused,
            )
        )
        if unbounded.plan is not None:
            extra = unbounded.plan.gpus - problem.budget_gpus
            changes.append(
                f"meeting {_fmt_rps(need)} needs {unbounded.plan.gpus} GPUs "
                f"({unbounded.plan.label()}): raise the budget by {extra}"
            )
    _compare_kinds(plan, best_disagg, best_agg, need, reasons)
    for r in rejected:
        reasons.append(f"not used: {r.reason}")
    return reasons, changes


def _compare_kinds(
    plan: Plan,
    best_disagg: Plan | None,
    best_agg: Plan | None,
    need: float | None,
    reasons: list[str],
) -> None:
    def summary(p: Plan) -> str:
        return (
            f"{p.label()}: {_fmt_rps(p.capacity_rps)} on {p.gpus} GPUs "
            f"({_fmt_rps(p.capacity_rps / p.gpus)} per GPU)"
        )

    if plan.kind == "aggregated":
        if best_disagg is not None:
            reasons.append(
                f"disaggregation does not pay here: best P/D plan {summary(best_disagg)}"
                f" against {summary(plan)}"
            )
        else:
            reasons.append(
                "no disaggregated plan meets the SLOs (or no prefill and decode "
                "profiles of one model): aggregated it is"
            )
    elif best_agg is not None:
        reasons.append(
            f"disaggregation pays: {summary(plan)} against the best aggregated plan "
            f"{summary(best_agg)}"
        )
