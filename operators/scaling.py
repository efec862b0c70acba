"""The rate-matching controller's view of a TandemDeployment (pure: the
spec and the objects in, the loop's inputs and status documents out).

operators/live.py runs the loop around it: it observes the pools, reads the
routers' counters, calls the pure core (operators/planner/loop.py
`on_tick`) with what these functions build, and applies what it decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from operators.planner.capacity import (
    ContextDemand,
    KvKind,
    KvShape,
    MemoryBudget,
    check_capacity,
)
from operators.planner.demand import Window, demand_of, measurements_of
from operators.planner.loop import (
    MODES,
    Condition,
    Effects,
    LoopSettings,
    LoopState,
    Mode,
    PoolStatus,
    TickInputs,
    plan_ratio,
)
from operators.planner.persist import rfc3339, simulation_to_dict, state_to_dict
from operators.planner.profiles import (
    EngineProfile,
    Parallelism,
    PoolRole,
    ProfileError,
    profile_from_configmap,
)
from operators.planner.simulate import SIMULATE_MODES, SimulateMode
from operators.planner.solver import Decision, Slo
from operators.spec import ScalingSpec, TandemSpec, parse_pool

# -- pure: the spec and the objects as the loop's inputs ---------------------------


def loop_settings(scaling: ScalingSpec) -> LoopSettings:
    """The smoothing the spec asks for (its defaults are the CRD's)."""
    return LoopSettings(
        up_cooldown_s=float(scaling.up_cooldown_seconds),
        down_cooldown_s=float(scaling.down_cooldown_seconds),
        down_window_s=float(scaling.down_window_seconds),
        max_step=scaling.max_step,
        switch_margin=float(scaling.switch_margin),
        history=scaling.history_limit,
    )


def slo_of(scaling: ScalingSpec) -> Slo:
    slo = scaling.slo
    interactivity = slo.interactivity_p90
    if interactivity is None and slo.itl_p90_ms:
        interactivity = 1000.0 / slo.itl_p90_ms
    ttft = slo.ttft_p90_ms
    return Slo(
        ttft_p90_s=None if ttft is None else ttft / 1000.0,
        interactivity_p90=None if interactivity is None else float(interactivity),
    )


def load_profiles(
    spec: TandemSpec, configmaps: Mapping[str, dict[str, Any] | None]
) -> tuple[dict[str, EngineProfile], list[str]]:
    """Each pool's profile (role → profile) from the ConfigMaps `scaling.profiles`
    names (name → object, None when absent), and what is wrong, each saying
    what to change."""
    names = spec.scaling.profiles
    out: dict[str, EngineProfile] = {}
    problems: list[str] = []
    for role in spec.roles:
        name: str | None = getattr(names, role)
        if not name:
            problems.append(
                f"scaling.profiles.{role} is not set: name the ConfigMap holding "
                f"the {role} pool's engine profile"
            )
            continue
        cm = configmaps.get(name)
        if cm is None:
            problems.append(
                f"ConfigMap {name} (scaling.profiles.{role}) does not exist: "
                f"write it with `tandem profile --role {role} ... -o FILE` and "
                f"`kubectl apply -f FILE`"
            )
            continue
        try:
            profile = profile_from_configmap(cm)
        except ProfileError as exc:
            problems.append(f"{exc}: fix the profile document")
            continue
        if profile.role != role:
            problems.append(
                f"ConfigMap {name} holds a {profile.role} profile, named for the "
                f"{role} pool: name a {role} profile in scaling.profiles.{role}"
            )
            continue
        gpus = spec.pool(role).gpus(1)
        if gpus and gpus != profile.config.gpus_per_replica:
            problems.append(
                f"profile {profile.name} was taken with "
                f"{profile.config.gpus_per_replica} GPU(s) per replica, the {role} "
                f"pool runs {gpus}: profile this configuration or name one that "
                f"matches"
            )
            continue
        out[role] = profile
    return out, problems


def capacity_problems(spec: TandemSpec, profiles: Mapping[str, EngineProfile]) -> list[str]:
    """Pools whose configuration cannot hold `scaling.slo.longestContextTokens`,
    each saying which term overflows and what to change: a profile whose
    replica holds less KV than the context, and, when `scaling.capacity` gives
    the model's KV shape and the GPUs' free memory, the capacity check
    (operators/planner/capacity.py) under the pool's parallelism."""
    scaling = spec.scaling
    longest = scaling.slo.longest_context_tokens
    if longest is None:
        return []
    out = [
        f"the {role} pool's profile {p.name}: one replica holds "
        f"{p.config.kv_capacity_tokens:,} tokens of KV, less than "
        f"scaling.slo.longestContextTokens ({longest:,}): lower it or profile a "
        f"configuration with more KV per replica"
        for role, p in profiles.items()
        if p.config.kv_capacity_tokens is not None and p.config.kv_capacity_tokens < longest
    ]
    cap = scaling.capacity
    if cap is None:
        return out
    kind = cap.kv_kind
    if kind == "gqa" and not (cap.kv_heads and cap.head_dim):
        return [*out, "scaling.capacity.kvKind gqa needs kvHeads and headDim"]
    if kind == "mla" and not cap.latent_dim:
        return [*out, "scaling.capacity.kvKind mla needs latentDim"]
    shape = KvShape(
        layers=cap.layers,
        kind=cast(KvKind, kind),
        kv_bytes=float(cap.kv_bytes),
        kv_heads=1 if cap.kv_heads is None else cap.kv_heads,
        head_dim=cap.head_dim or 0,
        latent_dim=cap.latent_dim or 0,
        compute_bytes=float(cap.compute_bytes),
    )
    memory = MemoryBudget(float(cap.gpu_free_gib), cap.host_free_gib)
    ctx = ContextDemand(
        longest,
        sequences=cap.sequences,
        transfer_buffer_gib=float(cap.transfer_buffer_gib),
        host_pool_gib=float(cap.host_pool_gib),
    )
    for role in profiles:
        par = spec.pool(role).parallelism
        verdict = check_capacity(
            shape,
            Parallelism(
                tp=par.tensor,
                pp=par.pipeline,
                dp=par.data,
                pcp=par.prefill_context,
                dcp=par.decode_context,
            ),
            memory,
            ctx,
        )
        if verdict.fits:
            continue
        change = (
            f"{verdict.suggestion}: set it in spec.{role}.parallelism (decodeContext "
            f"is DCP, prefillContext PCP) and profile that configuration"
            if verdict.suggestion
            else "lower scaling.slo.longestContextTokens or give each replica more GPUs "
            "(parallelism.tensor, prefillContext)"
        )
        out.append(
            f"the {role} pool cannot hold scaling.slo.longestContextTokens: "
            f"{verdict.reason}. To fix: {change}"
        )
    return out


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def pool_status(
    role: PoolRole, pool: dict[str, Any], pods: list[dict[str, Any]], profile: EngineProfile
) -> PoolStatus:
    """One EnginePool and its pods as the loop sees them (terminating pods hold
    their GPUs until they are gone)."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return PoolStatus(
        role=role,
        config=profile.name,
        spec_replicas=parse_pool(pool["spec"]).replicas,
        pods=len(pods),
        ready=sum(1 for p in live if _ready(p)),
        pending=sum(1 for p in live if p.get("status", {}).get("phase", "Pending") == "Pending"),
        gpus_per_replica=profile.config.gpus_per_replica,
    )


def scaling_document(state: LoopState, effects: Effects, mode: str) -> dict[str, Any]:
    """`status.scaling`: the decision, why, and the loop's state."""
    doc: dict[str, Any] = {"mode": mode, **state_to_dict(state)}
    record = effects.record
    if record is not None:
        doc.update(
            recommendation=plan_ratio(record.replicas),
            replicas=dict(record.replicas),
            targets=dict(record.targets),
            binding=record.binding,
            summary=record.summary,
            held=list(record.held),
            lastDecisionTime=rfc3339(record.at),
        )
        if record.simulation is not None:
            doc["simulation"] = simulation_to_dict(record.simulation)
    if effects.decision is not None:
        doc.update(
            reasons=list(effects.decision.reasons),
            changes=list(effects.decision.changes),
            pools=_pool_reports(effects.decision),
        )
    return doc


def _pool_reports(decision: Decision) -> list[dict[str, Any]]:
    if decision.plan is None:
        return []
    return [
        {
            "role": p.role,
            "profile": p.config,
            "replicas": p.replicas,
            "gpus": p.gpus,
            "capacityRps": round(p.capacity_rps, 3),
            "utilization": None if p.utilization is None else round(p.utilization, 3),
            "limit": p.point.limit,
        }
        for p in decision.plan.pools
    ]


def metrics_condition(failures: Mapping[str, str], sources: int) -> Condition:
    if sources == 0:
        return Condition(
            "MetricsAvailable",
            "False",
            "NoRouters",
            "no router pod with an address to scrape: decisions wait for one",
        )
    if failures:
        detail = "; ".join(f"{url}: {why}" for url, why in sorted(failures.items()))
        return Condition(
            "MetricsAvailable",
            "False",
            "ScrapeFailed",
            f"{len(failures)} of {sources} metrics source(s) unreadable, scaling "
            f"holds until all answer: {detail}",
        )
    return Condition("MetricsAvailable", "True", "Scraped", f"{sources} metrics source(s) read")


def tick_inputs(
    spec: TandemSpec,
    pools: tuple[PoolStatus, ...],
    profiles: Mapping[str, EngineProfile],
    window: Window | None,
    external: Mapping[str, str],
) -> TickInputs:
    """What the loop decides from: the spec, the pools as observed, the
    measured window (None: nothing usable measured) and the pools another
    writer owns."""
    scaling = spec.scaling
    ready = {status.role: status.ready for status in pools}
    return TickInputs(
        mode=mode_of(scaling),
        pools=pools,
        profiles=tuple(profiles.values()),
        demand=None if window is None else demand_of(window),
        slo=slo_of(scaling),
        budget_gpus=scaling.gpu_budget,
        headroom=float(scaling.headroom),
        measurements=() if window is None else measurements_of(window, ready),
        bounds={
            role: (spec.pool(role).min_replicas, spec.pool(role).max_replicas)
            for role in spec.roles
        },
        external=external,
        simulate=simulate_mode(scaling),
    )


def simulate_mode(scaling: ScalingSpec) -> SimulateMode:
    mode = scaling.simulation.mode
    if mode not in SIMULATE_MODES:
        raise ValueError(f"scaling.simulation.mode {mode!r}: one of {', '.join(SIMULATE_MODES)}")
    return mode


def mode_of(scaling: ScalingSpec) -> Mode:
    mode = scaling.mode
    if mode not in MODES:
        raise ValueError(f"scaling.mode {mode!r}: one of {', '.join(MODES)}")
    return mode
