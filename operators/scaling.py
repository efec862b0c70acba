"""The rate-matching controller inside the operator: one tick per
TandemDeployment, run by a kopf timer (handlers.scaling_tick).

A tick reads (the profiles' ConfigMaps that `scaling.profiles` names, the
EnginePools and their pods, the routers' counters from each router pod's
/metrics or from a Prometheus), hands them to the pure loop
(operators/planner/loop.py `on_tick`), and writes what it decided:

* `Auto`: each pool's replica count through `controller.scale_pool` (the
  EnginePool's /scale; the reconcile then drains and resizes the workload);
* `Recommend` and `Auto`: the decision with its reasons in the
  TandemDeployment's `status.scaling` (with the last decisions and the loop's
  state, so cooldowns survive a restart), each EnginePool's
  `status.recommendedReplicas`, the conditions `ScalingActive`,
  `ScalingSpecValid`, `DemandMet` and `MetricsAvailable`, Events and gauges;
* `Off`: nothing, but `ScalingActive=False` once it was on.

The functions above `tick` are pure (objects in, inputs or documents out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from operators import controller, manifests, metrics
from operators.kube import Kube
from operators.planner.capacity import ContextDemand, KvShape, MemoryBudget, check_capacity
from operators.planner.demand import demand_of, measurements_of
from operators.planner.loop import (
    Condition,
    Effects,
    LoopSettings,
    LoopState,
    PoolStatus,
    TickInputs,
    on_tick,
    plan_ratio,
)
from operators.planner.persist import rfc3339, state_from_dict, state_to_dict
from operators.planner.profiles import (
    EngineProfile,
    Parallelism,
    PoolRole,
    ProfileError,
    profile_from_configmap,
)
from operators.planner.scrape import MetricsSource, PrometheusSource, RouterScrapeSource
from operators.planner.solver import Decision, Slo
from operators.spec import API_VERSION, ROLES, ScalingSpec, TandemSpec, parse, parse_pool
from operators.status import merge_conditions

log = logging.getLogger(__name__)

Emit = Callable[[dict, str, str, str], None]  # (object, type, reason, message)


# -- pure: the spec and the objects as the loop's inputs ---------------------------

def loop_settings(scaling: ScalingSpec) -> LoopSettings:
    """The smoothing the spec asks for (its defaults are the CRD's)."""
    return LoopSettings(up_cooldown_s=float(scaling.up_cooldown_seconds),
                        down_cooldown_s=float(scaling.down_cooldown_seconds),
                        down_window_s=float(scaling.down_window_seconds),
                        max_step=scaling.max_step, history=scaling.history_limit)


def slo_of(scaling: ScalingSpec) -> Slo:
    slo = scaling.slo
    interactivity = slo.interactivity_p90
    if interactivity is None and slo.itl_p90_ms:
        interactivity = 1000.0 / slo.itl_p90_ms
    ttft = slo.ttft_p90_ms
    return Slo(ttft_p90_s=None if ttft is None else ttft / 1000.0,
               interactivity_p90=None if interactivity is None else float(interactivity))


def load_profiles(spec: TandemSpec, configmaps: Mapping[str, dict[str, Any] | None]
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
            problems.append(f"scaling.profiles.{role} is not set: name the ConfigMap holding "
                            f"the {role} pool's engine profile")
            continue
        cm = configmaps.get(name)
        if cm is None:
            problems.append(f"ConfigMap {name} (scaling.profiles.{role}) does not exist: "
                            f"write it with `tandem profile --role {role} ... -o FILE` and "
                            f"`kubectl apply -f FILE`")
            continue
        try:
            profile = profile_from_configmap(cm)
        except ProfileError as exc:
            problems.append(f"{exc}: fix the profile document")
            continue
        if profile.role != role:
            problems.append(f"ConfigMap {name} holds a {profile.role} profile, named for the "
                            f"{role} pool: name a {role} profile in scaling.profiles.{role}")
            continue
        gpus = spec.pool(role).gpus(1)
        if gpus and gpus != profile.config.gpus_per_replica:
            problems.append(f"profile {profile.name} was taken with "
                            f"{profile.config.gpus_per_replica} GPU(s) per replica, the {role} "
                            f"pool runs {gpus}: profile this configuration or name one that "
                            f"matches")
            continue
        out[role] = profile
    return out, problems


def capacity_problems(spec: TandemSpec, profiles: Mapping[str, EngineProfile]
                      ) -> list[str]:
    """Pools whose configuration cannot hold `scaling.slo.longestContextTokens`,
    each saying which term overflows and what to change: a profile whose
    replica holds less KV than the context, and, when `scaling.capacity` gives
    the model's KV shape and the GPUs' free memory, the capacity check
    (operators/planner/capacity.py) under the pool's parallelism."""
    scaling = spec.scaling
    longest = scaling.slo.longest_context_tokens
    if longest is None:
        return []
    out = [f"the {role} pool's profile {p.name}: one replica holds "
           f"{p.config.kv_capacity_tokens:,} tokens of KV, less than "
           f"scaling.slo.longestContextTokens ({longest:,}): lower it or profile a "
           f"configuration with more KV per replica"
           for role, p in profiles.items() if p.config.kv_capacity_tokens is not None
           and p.config.kv_capacity_tokens < longest]
    cap = scaling.capacity
    if cap is None:
        return out
    kind = cap.kv_kind
    if kind == "gqa" and not (cap.kv_heads and cap.head_dim):
        return [*out, "scaling.capacity.kvKind gqa needs kvHeads and headDim"]
    if kind == "mla" and not cap.latent_dim:
        return [*out, "scaling.capacity.kvKind mla needs latentDim"]
    shape = KvShape(layers=cap.layers, kind=kind, kv_bytes=float(cap.kv_bytes),
                    kv_heads=1 if cap.kv_heads is None else cap.kv_heads,
                    head_dim=cap.head_dim or 0, latent_dim=cap.latent_dim or 0,
                    compute_bytes=float(cap.compute_bytes))
    memory = MemoryBudget(float(cap.gpu_free_gib), cap.host_free_gib)
    ctx = ContextDemand(longest, sequences=cap.sequences,
                        transfer_buffer_gib=float(cap.transfer_buffer_gib),
                        host_pool_gib=float(cap.host_pool_gib))
    for role in profiles:
        par = spec.pool(role).parallelism
        verdict = check_capacity(shape, Parallelism(
            tp=par.tensor, pp=par.pipeline, dp=par.data, pcp=par.prefill_context,
            dcp=par.decode_context), memory, ctx)
        if verdict.fits:
            continue
        change = (f"{verdict.suggestion}: set it in spec.{role}.parallelism (decodeContext "
                  f"is DCP, prefillContext PCP) and profile that configuration"
                  if verdict.suggestion else
                  "lower scaling.slo.longestContextTokens or give each replica more GPUs "
                  "(parallelism.tensor, prefillContext)")
        out.append(f"the {role} pool cannot hold scaling.slo.longestContextTokens: "
                   f"{verdict.reason}. To fix: {change}")
    return out


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))


def pool_status(role: PoolRole, pool: dict[str, Any], pods: list[dict[str, Any]],
                profile: EngineProfile) -> PoolStatus:
    """One EnginePool and its pods as the loop sees them (terminating pods hold
    their GPUs until they are gone)."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return PoolStatus(role=role, config=profile.name,
                      spec_replicas=parse_pool(pool["spec"]).replicas, pods=len(pods),
                      ready=sum(1 for p in live if _ready(p)),
                      pending=sum(1 for p in live
                                  if p.get("status", {}).get("phase", "Pending") == "Pending"),
                      gpus_per_replica=profile.config.gpus_per_replica)


def scaling_document(state: LoopState, effects: Effects, mode: str) -> dict[str, Any]:
    """`status.scaling`: the decision, why, and the loop's state."""
    doc: dict[str, Any] = {"mode": mode, **state_to_dict(state)}
    record = effects.record
    if record is not None:
        doc.update(recommendation=plan_ratio(record.replicas), replicas=dict(record.replicas),
                   targets=dict(record.targets), binding=record.binding,
                   summary=record.summary, held=list(record.held),
                   lastDecisionTime=rfc3339(record.at))
    if effects.decision is not None:
        doc.update(reasons=list(effects.decision.reasons),
                   changes=list(effects.decision.changes), pools=_pool_reports(effects.decision))
    return doc


def _pool_reports(decision: Decision) -> list[dict[str, Any]]:
    if decision.plan is None:
        return []
    return [{"role": p.role, "profile": p.config, "replicas": p.replicas, "gpus": p.gpus,
             "capacityRps": round(p.capacity_rps, 3),
             "utilization": None if p.utilization is None else round(p.utilization, 3),
             "limit": p.point.limit} for p in decision.plan.pools]


def metrics_condition(failures: Mapping[str, str], sources: int) -> Condition:
    if sources == 0:
        return Condition("MetricsAvailable", "False", "NoRouters",
                         "no router pod with an address to scrape: decisions wait for one")
    if failures:
        detail = "; ".join(f"{url}: {why}" for url, why in sorted(failures.items()))
        return Condition("MetricsAvailable", "False", "ScrapeFailed",
                         f"{len(failures)} of {sources} metrics source(s) unreadable, scaling "
                         f"holds until all answer: {detail}")
    return Condition("MetricsAvailable", "True", "Scraped",
                     f"{sources} metrics source(s) read")


# -- I/O -------------------------------------------------------------------------

class Sources:
    """Each deployment's metrics source; a router scrape keeps its last samples
    between ticks (a window needs two)."""

    def __init__(self) -> None:
        self.by_deployment: dict[tuple[str, str], MetricsSource] = {}

    async def for_deployment(self, namespace: str, name: str, scaling: ScalingSpec
                             ) -> MetricsSource:
        key = (namespace, name)
        prom = scaling.prometheus
        current = self.by_deployment.get(key)
        if current is not None and (
                (prom is None and not isinstance(current, PrometheusSource))
                or (prom is not None and isinstance(current, PrometheusSource)
                    and current.url == prom.url.rstrip("/")
                    and current.selector == prom.selector
                    and current.window_s == prom.window_seconds)):
            return current
        if current is not None:
            await current.aclose()
        source: MetricsSource = (
            PrometheusSource(prom.url, prom.selector, prom.window_seconds)
            if prom is not None else RouterScrapeSource())
        self.by_deployment[key] = source
        return source

    async def forget(self, namespace: str, name: str) -> None:
        source = self.by_deployment.pop((namespace, name), None)
        if source is not None:
            await source.aclose()

    async def close(self) -> None:
        for key in list(self.by_deployment):
            await self.forget(*key)


async def tick(kube: Kube, body: dict, sources: Sources, emit: Emit, now: float) -> Effects | None:
    """One decision for one TandemDeployment; None when its mode is Off."""
    meta, spec = body["metadata"], parse(body["spec"])
    td, namespace = meta["name"], meta["namespace"]
    scaling = spec.scaling
    mode = scaling.mode
    previous = body.get("status", {}).get("scaling")
    state = state_from_dict(previous)
    if mode == "Off":
        await sources.forget(namespace, td)
        metrics.forget_scaling(namespace, td, spec.roles)
        if not _condition(body, "ScalingActive"):
            return None  # never scaled: nothing to say
        await _write(kube, body, previous, [Condition(
            "ScalingActive", "False", "Off", "scaling mode Off: pools keep the replicas set")], now)
        return None

    names = {getattr(scaling.profiles, role) for role in ROLES} - {None}
    configmaps = {n: await kube.get("v1", "ConfigMap", namespace, n) for n in sorted(names)}
    profiles, problems = load_profiles(spec, configmaps)
    reason = "ProfileUnusable"
    if not problems:
        problems, reason = capacity_problems(spec, profiles), "ContextDoesNotFit"
    if problems:
        message = "; ".join(problems)
        if _condition(body, "ScalingSpecValid").get("message") != message:
            emit(body, "Warning", "ScalingSpecInvalid", message)
        await _write(kube, body, previous, [
            Condition("ScalingActive", "True", mode, f"scaling mode {mode}"),
            Condition("ScalingSpecValid", "False", reason, message)], now)
        return None

    observed = []
    for role in spec.roles:
        pool = await kube.get(API_VERSION, "EnginePool", namespace, manifests.pool_name(td, role))
        if pool is None:  # the reconcile has not created it yet
            return None
        selector = ",".join(f"{k}={v}" for k, v in
                            sorted(manifests.pool_selector(td, role).items()))
        pods = await kube.list("v1", "Pod", namespace, selector)
        observed.append((pool, pool_status(role, pool, pods, profiles[role])))

    source = await sources.for_deployment(namespace, td, scaling)
    failures: dict[str, str] = {}
    window = None
    if isinstance(source, RouterScrapeSource):
        routers = await kube.list("v1", "Pod", namespace,
                                  f"{manifests.LABEL_DEPLOYMENT}={td},"
                                  f"{manifests.LABEL_COMPONENT}=router")
        source.urls = controller.router_urls(routers)
        count = len(source.urls)
        if source.urls:
            window = await source.window(now)
            failures = source.failures
    else:
        count = 1
        try:
            window = await source.window(now)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            failures = {"prometheus": str(exc) or type(exc).__name__}
    metrics_ok = metrics_condition(failures, count)
    if metrics_ok.status == "False" \
            and _condition(body, "MetricsAvailable").get("message") != metrics_ok.message:
        emit(body, "Warning", "MetricsUnavailable", metrics_ok.message)
    # Partial counts would read as a demand drop: no demand (hold) until all answer.
    usable = window if metrics_ok.status == "True" else None
    ready = {status.role: status.ready for _, status in observed}
    # A pool an autoscaler owns is sized but not written (the reconcile reports the
    # conflict as ScalingConflict); two writers would fight.
    hpas = await kube.list("autoscaling/v2", "HorizontalPodAutoscaler", namespace)
    external = {role: "an autoscaler scales it" for role in spec.roles
                if controller.foreign_autoscaler(
                    hpas, td, role, manifests.workload_kind(spec.pool(role)).kind, mode)}
    inputs = TickInputs(
        mode=mode, pools=tuple(status for _, status in observed),
        profiles=tuple(profiles.values()),
        demand=None if usable is None else demand_of(usable), slo=slo_of(scaling),
        budget_gpus=scaling.gpu_budget, headroom=float(scaling.headroom),
        measurements=() if usable is None else measurements_of(usable, ready),
        bounds={role: (spec.pool(role).min_replicas, spec.pool(role).max_replicas)
                for role in spec.roles}, external=external)
    state, effects = on_tick(now, state, inputs, loop_settings(scaling))

    for s in effects.scale:
        await controller.scale_pool(kube, namespace, manifests.pool_name(td, s.role), s.replicas)
        log.info("%s/%s: %s pool %d -> %d (%s)", namespace, td, s.role, s.previous, s.replicas,
                 s.reason)
    for event in effects.events:
        emit(body, event.type, event.reason, event.message)
    if effects.record is not None:
        for pool, status in observed:
            recommended = effects.record.replicas[status.role]
            metrics.SCALING_RECOMMENDED.labels(namespace, td, status.role).set(recommended)
            target = effects.record.targets.get(status.role)
            if target is not None:
                metrics.SCALING_TARGET.labels(namespace, td, status.role).set(target)
            if pool.get("status", {}).get("recommendedReplicas") != recommended:
                await kube.patch(API_VERSION, "EnginePool", namespace, pool["metadata"]["name"],
                                 {"status": {"recommendedReplicas": recommended}},
                                 subresource="status")
        if effects.record.demand_rps is not None:
            metrics.SCALING_DEMAND.labels(namespace, td).set(effects.record.demand_rps)
    await _write(kube, body, scaling_document(state, effects, mode),
                 [*effects.conditions, metrics_ok], now)
    return effects


def _condition(body: dict, kind: str) -> dict:
    return next((c for c in body.get("status", {}).get("conditions", [])
                 if c.get("type") == kind), {})


async def _write(kube: Kube, body: dict, scaling: dict | None,
                 conditions: list[Condition], now: float) -> None:
    """Replace `status.scaling` (a merge patch would keep keys the loop
    dropped) and merge the conditions, in one JSON patch."""
    meta, status = body["metadata"], body.get("status", {})
    generation = meta.get("generation", 1)
    merged = merge_conditions(status.get("conditions", []), conditions, generation,
                              rfc3339(now))
    if status.get("scaling") == scaling and status.get("conditions") == merged:
        return
    if not status:
        ops = [{"op": "add", "path": "/status",
                "value": {"conditions": merged,
                          **({"scaling": scaling} if scaling is not None else {})}}]
    else:
        ops = [{"op": "add", "path": "/status/conditions", "value": merged}]
        if scaling is not None:
            ops.append({"op": "add", "path": "/status/scaling", "value": scaling})
    await kube.patch(API_VERSION, "TandemDeployment", meta["namespace"], meta["name"], ops,
                     subresource="status", content_type="application/json-patch+json")

