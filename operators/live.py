"""The rate-matching controller's live loop: one tick per TandemDeployment,
run every --scaling-seconds by the operator's loop (handlers.py), observe →
decide → apply; `check_spec` runs on every spec change.

`KubeActuator` is the Kubernetes side of the planner's `Actuator` protocol
(operators/planner/actuator.py, whose `VirtualActuator` the simulator and
the tests use): it observes the EnginePools and their pods and applies a
tick's effects. `tick` reads the profiles and the routers' counters (each
router pod's /metrics, or a Prometheus), hands everything to the pure core
(operators/planner/loop.py `on_tick`, through operators/scaling.py), has the
actuator apply what it decided and writes the decision down:

* `Auto`: each pool's replica count through `controller.scale_pool` (the
  EnginePool's /scale; the reconcile then drains and resizes the workload);
* `Recommend` and `Auto`: the decision with its reasons in the
  TandemDeployment's `status.scaling` (with the last decisions and the loop's
  state, so cooldowns survive a restart), each EnginePool's
  `status.recommendedReplicas`, the conditions `ScalingActive`,
  `ScalingSpecValid`, `DemandMet` and `MetricsAvailable`, Events and gauges;
* `Off`: nothing, but `ScalingActive=False` once it was on.

With `scaling.simulation.mode` Report or Gate, a tick that proposes new pool
sizes has the simulator (`operators/planner/simulate.py`, given by the
launcher) predict the current and the proposed pools on the measured demand,
off the event loop and within `timeoutSeconds`, then decides again with that
prediction (Gate holds a proposal predicted worse): `planner/checked.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

from operators import controller, manifests, metrics
from operators.kube import Kube
from operators.planner.checked import CheckLimits, checked_tick
from operators.planner.demand import Window
from operators.planner.loop import Condition, Effects, PoolStatus, not_judged
from operators.planner.persist import rfc3339, state_from_dict
from operators.planner.profiles import EngineProfile
from operators.planner.scrape import MetricsSource, PrometheusSource, RouterScrapeSource
from operators.planner.simulate import Simulator
from operators.scaling import (
    capacity_problems,
    load_profiles,
    loop_settings,
    metrics_condition,
    mode_of,
    pool_status,
    scaling_document,
    tick_inputs,
)
from operators.spec import API_VERSION, ROLES, ScalingSpec, TandemSpec, parse
from operators.status import merge_conditions

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any], str, str, str], None]  # (object, type, reason, message)


class KubeActuator:
    """One TandemDeployment's pools on Kubernetes, for one tick."""

    def __init__(self, kube: Kube, body: dict[str, Any], spec: TandemSpec, emit: Emit) -> None:
        self.kube, self.body, self.spec, self.emit = kube, body, spec, emit
        self.td, self.namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        self.pools: dict[str, dict[str, Any]] = {}  # role → EnginePool, as observed
        self.profiles_by_role: dict[str, EngineProfile] = {}

    async def profiles(self) -> tuple[dict[str, EngineProfile], list[str], str]:
        """Each pool's profile from the ConfigMaps `scaling.profiles` names, what
        is wrong with them, and the condition reason for it."""
        named: set[str] = {
            name for role in ROLES if (name := getattr(self.spec.scaling.profiles, role))
        }
        configmaps = {
            n: await self.kube.get("v1", "ConfigMap", self.namespace, n) for n in sorted(named)
        }
        profiles, problems = load_profiles(self.spec, configmaps)
        reason = "ProfileUnusable"
        if not problems:
            problems, reason = capacity_problems(self.spec, profiles), "ContextDoesNotFit"
        self.profiles_by_role = profiles
        return profiles, problems, reason

    async def observe(self) -> tuple[PoolStatus, ...]:
        """Every pool that exists (the reconcile may not have created all yet)."""
        out = []
        for role in self.spec.roles:
            pool = await self.kube.get(
                API_VERSION, "EnginePool", self.namespace, manifests.pool_name(self.td, role)
            )
            if pool is None:
                continue
            selector = ",".join(
                f"{k}={v}" for k, v in sorted(manifests.pool_selector(self.td, role).items())
            )
            pods = await self.kube.list("v1", "Pod", self.namespace, selector)
            self.pools[role] = pool
            out.append(pool_status(role, pool, pods, self.profiles_by_role[role]))
        return tuple(out)

    async def apply(self, effects: Effects) -> None:
        """Scale (in order), send the Events, publish the recommendation."""
        td, namespace = self.td, self.namespace
        for s in effects.scale:
            await controller.scale_pool(
                self.kube, namespace, manifests.pool_name(td, s.role), s.replicas
            )
            log.info(
                "%s/%s: %s pool %d -> %d (%s)",
                namespace,
                td,
                s.role,
                s.previous,
                s.replicas,
                s.reason,
            )
        for event in effects.events:
            self.emit(self.body, event.type, event.reason, event.message)
        record = effects.record
        if record is None:
            return
        for role, pool in self.pools.items():
            recommended = record.replicas[role]
            metrics.SCALING_RECOMMENDED.labels(namespace, td, role).set(recommended)
            target = record.targets.get(role)
            if target is not None:
                metrics.SCALING_TARGET.labels(namespace, td, role).set(target)
            if pool.get("status", {}).get("recommendedReplicas") != recommended:
                await self.kube.patch(
                    API_VERSION,
                    "EnginePool",
                    namespace,
                    pool["metadata"]["name"],
                    {"status": {"recommendedReplicas": recommended}},
                    subresource="status",
                )
        if record.demand_rps is not None:
            metrics.SCALING_DEMAND.labels(namespace, td).set(record.demand_rps)


class Sources:
    """Each deployment's metrics source; a router scrape keeps its last samples
    between ticks (a window needs two)."""

    def __init__(self) -> None:
        self.by_deployment: dict[tuple[str, str], MetricsSource] = {}

    async def for_deployment(
        self, namespace: str, name: str, scaling: ScalingSpec
    ) -> MetricsSource:
        key = (namespace, name)
        prom = scaling.prometheus
        current = self.by_deployment.get(key)
        if current is not None and (
            (prom is None and not isinstance(current, PrometheusSource))
            or (
                prom is not None
                and isinstance(current, PrometheusSource)
                and current.url == prom.url.rstrip("/")
                and current.selector == prom.selector
                and current.window_s == prom.window_seconds
            )
        ):
            return current
        if current is not None:
            await current.aclose()
        source: MetricsSource = (
            PrometheusSource(prom.url, prom.selector, prom.window_seconds)
            if prom is not None
            else RouterScrapeSource()
        )
        self.by_deployment[key] = source
        return source

    async def forget(self, namespace: str, name: str) -> None:
        source = self.by_deployment.pop((namespace, name), None)
        if source is not None:
            await source.aclose()

    async def close(self) -> None:
        for key in list(self.by_deployment):
            await self.forget(*key)


async def read_window(
    kube: Kube, body: dict[str, Any], sources: Sources, spec: TandemSpec, now: float, emit: Emit
) -> tuple[Window | None, Condition]:
    """The routers' counters over the last window (None unless every source
    answered: partial counts would read as a demand drop) and the
    MetricsAvailable condition."""
    td, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    source = await sources.for_deployment(namespace, td, spec.scaling)
    failures: dict[str, str] = {}
    window = None
    if isinstance(source, RouterScrapeSource):
        routers = await kube.list(
            "v1",
            "Pod",
            namespace,
            f"{manifests.LABEL_DEPLOYMENT}={td},{manifests.LABEL_COMPONENT}=router",
        )
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
    if (
        metrics_ok.status == "False"
        and condition(body, "MetricsAvailable").get("message") != metrics_ok.message
    ):
        emit(body, "Warning", "MetricsUnavailable", metrics_ok.message)
    return (window if metrics_ok.status == "True" else None), metrics_ok


def external_writers(spec: TandemSpec, td: str, hpas: list[dict[str, Any]]) -> dict[str, str]:
    """Pools an autoscaler owns: sized but not written (the reconcile reports the
    conflict as ScalingConflict); two writers would fight."""
    return {
        role: "an autoscaler scales it"
        for role in spec.roles
        if controller.foreign_autoscaler(
            hpas, td, role, manifests.workload_kind(spec.pool(role)).kind, spec.scaling.mode
        )
    }


async def tick(
    kube: Kube,
    body: dict[str, Any],
    sources: Sources,
    emit: Emit,
    now: float,
    hpas: list[dict[str, Any]],
    simulator: Simulator | None = None,
) -> Effects | None:
    """One decision for one TandemDeployment; None when its mode is Off or it
    cannot decide yet. `hpas`: the HorizontalPodAutoscalers of its namespace;
    `simulator`: what checks a proposal when `scaling.simulation` asks."""
    meta, spec = body["metadata"], parse(body["spec"])
    td, namespace = meta["name"], meta["namespace"]
    previous = body.get("status", {}).get("scaling")
    if spec.scaling.mode == "Off":
        await sources.forget(namespace, td)
        metrics.forget_scaling(namespace, td, spec.roles)
        if condition(body, "ScalingActive"):  # it was on: say it is off now
            await write_status(
                kube,
                body,
                previous,
                [
                    Condition(
                        "ScalingActive",
                        "False",
                        "Off",
                        "scaling mode Off: pools keep the replicas set",
                    )
                ],
                now,
            )
        return None
    mode = mode_of(spec.scaling)
    actuator = KubeActuator(kube, body, spec, emit)
    valid = await spec_validity(actuator, body, emit)
    if valid.status == "False":
        await write_status(kube, body, previous, spec_conditions(body, mode, valid), now)
        return None
    pools = await actuator.observe()
    if len(pools) != len(spec.roles):  # the reconcile has not created them all yet
        await write_status(kube, body, previous, spec_conditions(body, mode, valid), now)
        return None
    window, metrics_ok = await read_window(kube, body, sources, spec, now, emit)
    inputs = tick_inputs(
        spec, pools, actuator.profiles_by_role, window, external_writers(spec, td, hpas)
    )
    sim = spec.scaling.simulation
    state, effects = await checked_tick(
        now,
        state_from_dict(previous),
        inputs,
        loop_settings(spec.scaling),
        simulator,
        CheckLimits(sim.requests, float(sim.timeout_seconds), sim.tolerance),
    )
    await actuator.apply(effects)
    conditions = [*effects.conditions, metrics_ok]
    if not any(c.type == "ScalingSpecValid" for c in conditions):  # nothing measured to plan on
        conditions += spec_conditions(body, mode, valid)[1:]
    await write_status(kube, body, scaling_document(state, effects, mode), conditions, now)
    return effects


# The reasons the spec-level check gives (the others come from planning on a demand).
SPEC_REASONS = ("ProfileUnusable", "ContextDoesNotFit")


def active(mode: str) -> Condition:
    return Condition("ScalingActive", "True", mode, f"scaling mode {mode}")


async def spec_validity(actuator: KubeActuator, body: dict[str, Any], emit: Emit) -> Condition:
    """ScalingSpecValid from the spec and the profiles alone (no metrics): each
    pool's profile usable, the longest context held."""
    _, problems, reason = await actuator.profiles()
    if not problems:
        return Condition(
            "ScalingSpecValid",
            "True",
            "Valid",
            "the profiles are usable and hold the longest context; the SLOs are "
            "checked against the measured demand",
        )
    message = "; ".join(problems)
    if condition(body, "ScalingSpecValid").get("message") != message:
        emit(body, "Warning", "ScalingSpecInvalid", message)
    return Condition("ScalingSpecValid", "False", reason, message)


def spec_conditions(body: dict[str, Any], mode: str, valid: Condition) -> list[Condition]:
    """ScalingActive and, unless a plan's verdict on this same spec stands
    (an SLO no profile meets, or met: no new demand measured, nothing to
    revise it), the spec-level ScalingSpecValid; when that is False, no plan
    judges the demand either."""
    if valid.status == "False":
        why = f"the scaling spec is not valid ({valid.reason})"
        return [active(mode), valid, not_judged(valid.reason, why)]
    before = condition(body, "ScalingSpecValid")
    plan_verdict = (
        bool(before)
        and before.get("reason") not in SPEC_REASONS
        and before.get("observedGeneration") == body["metadata"].get("generation", 1)
    )
    return [active(mode)] if plan_verdict else [active(mode), valid]


async def check_spec(kube: Kube, body: dict[str, Any], emit: Emit, now: float) -> None:
    """On every change of the spec, whatever the metrics: say at once whether
    the scaling spec can be planned on (a fixed spec clears the condition
    before any router answers)."""
    spec = parse(body["spec"])
    if spec.scaling.mode == "Off":
        return
    mode = mode_of(spec.scaling)
    valid = await spec_validity(KubeActuator(kube, body, spec, emit), body, emit)
    await write_status(
        kube, body, body.get("status", {}).get("scaling"), spec_conditions(body, mode, valid), now
    )


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(
        (c for c in body.get("status", {}).get("conditions", []) if c.get("type") == kind), {}
    )


async def write_status(
    kube: Kube,
    body: dict[str, Any],
    scaling: dict[str, Any] | None,
    conditions: list[Condition],
    now: float,
) -> None:
    """Replace `status.scaling` (a merge patch would keep keys the loop
    dropped) and merge the conditions, in one JSON patch."""
    meta, status = body["metadata"], body.get("status", {})
    generation = meta.get("generation", 1)
    merged = merge_conditions(status.get("conditions", []), conditions, generation, rfc3339(now))
    if status.get("scaling") == scaling and status.get("conditions") == merged:
        return
    ops: list[dict[str, Any]]
    if not status:
        ops = [
            {
                "op": "add",
                "path": "/status",
                "value": {
                    "conditions": merged,
                    **({"scaling": scaling} if scaling is not None else {}),
                },
            }
        ]
    else:
        ops = [{"op": "add", "path": "/status/conditions", "value": merged}]
        if scaling is not None:
            ops.append({"op": "add", "path": "/status/scaling", "value": scaling})
    await kube.patch(
        API_VERSION,
        "TandemDeployment",
        meta["namespace"],
        meta["name"],
        ops,
        subresource="status",
        content_type="application/json-patch+json",
    )
