"""One reconcile of a TandemDeployment: render, apply, drain, report.

Called by the kopf handlers (handlers.py) on every change of the deployment,
of its EnginePools (`kubectl scale`, the rate-matching controller), of an
object it owns (foreign edits) or of an HPA, and on a timer. Level-based:
each pass compares everything, so a restart mid-way converges on the next.

A scale-down's progress lives on its EnginePool (`tandem.dev/scale-down`), so
the operator replica that leads after a failover finishes what the previous
one began instead of deciding it again.

Who owns a pool's replica count: `EnginePool.spec.replicas` (its `/scale`).
The TandemDeployment's `<pool>.replicas` seeds it, and a later change to that
field is copied over once (the value last copied is kept in the annotation
`tandem.dev/template-replicas`), so `kubectl scale` holds until someone
edits the template. The rate-matching controller writes
`EnginePool.spec.replicas` in `Auto` mode (`scale_pool` is its seam).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio.client import ApiException

from operators import drain, manifests, metrics, reconcile
from operators.kube import Kube
from operators.profile import stale_condition
from operators.spec import API_VERSION, TandemSpec, parse, parse_pool, problems
from operators.status import (
    Condition,
    PoolState,
    deployment_conditions,
    deployment_summary,
    merge_conditions,
    model_condition,
    pool_conditions,
)

log = logging.getLogger(__name__)

TEMPLATE_REPLICAS = "tandem.dev/template-replicas"
# A scale-down in progress, on its EnginePool (see `_reconcile_pool`).
SCALE_DOWN = "tandem.dev/scale-down"
Emit = Callable[[dict[str, Any], str, str, str], None]  # (object, type, reason, message)
# Apply one rendered object, keeping the fields at the given paths: the object written.
Apply = Callable[[dict[str, Any], tuple[str, ...]], Awaitable[dict[str, Any]]]


LWS_MISSING = (
    "LeaderWorkerSet is not installed (needed for nodesPerReplica > 1): install LWS >= 0.6"
)


class MissingApi(Exception):
    """The cluster does not serve a kind the spec needs; the message says what to install."""


@dataclass
class Outcome:
    applied: list[reconcile.Applied] = field(default_factory=list)
    pools: list[PoolState] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    model: Condition | None = None  # ModelReady, when the model is downloaded first


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def scale_pool(kube: Kube, namespace: str, pool: str, replicas: int) -> dict[str, Any]:
    """Set a pool's replica count through its /scale subresource (what `kubectl scale` does)."""
    return await kube.patch(
        API_VERSION,
        "EnginePool",
        namespace,
        pool,
        {"spec": {"replicas": replicas}},
        subresource="scale",
    )


def foreign_autoscaler(
    hpas: list[dict[str, Any]], td: str, role: str, pool_kind: str, scaling_mode: str
) -> str:
    """Why the operator must not write a pool's replica count, or ''.

    An HPA the operator did not create that scales the pool's Deployment or
    LeaderWorkerSet fights the operator over the same field; one that scales
    the EnginePool is how the pool is meant to be autoscaled, unless the
    rate-matching controller is in Auto mode and writes it too.
    """
    name = manifests.pool_name(td, role)
    for hpa in hpas:
        target = hpa.get("spec", {}).get("scaleTargetRef", {})
        owners = hpa["metadata"].get("ownerReferences", [])
        if any(o.get("kind") == "TandemDeployment" and o.get("name") == td for o in owners):
            continue
        hname = hpa["metadata"]["name"]
        if target.get("kind") == pool_kind and target.get("name") == name:
            return (
                f"HorizontalPodAutoscaler {hname} scales {pool_kind}/{name}, whose replicas "
                f"the operator sets: point it at enginepool/{name} instead, or delete it"
            )
        if (
            target.get("kind") == "EnginePool"
            and target.get("name") == name
            and scaling_mode == "Auto"
        ):
            return (
                f"HorizontalPodAutoscaler {hname} scales enginepool/{name} while "
                f"scaling.mode is Auto: set scaling.mode to Off or Recommend, or delete it"
            )
    return ""


async def reconcile_deployment(
    kube: Kube, body: dict[str, Any], emit: Emit, hpas: list[dict[str, Any]]
) -> Outcome:
    """`hpas`: the HorizontalPodAutoscalers of the deployment's namespace."""
    started = time.monotonic()
    meta = body["metadata"]
    td, namespace, spec = meta["name"], meta["namespace"], parse(body["spec"])
    owner = manifests.Owner("TandemDeployment", td, meta["uid"])
    out = Outcome(problems=problems(spec))
    if out.problems:
        emit(body, "Warning", "InvalidSpec", "; ".join(out.problems))
        await _write_status(kube, body, out, spec, router_ready=False)
        return out

    async def apply(obj: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
        applied = await reconcile.apply(kube, obj, keep)
        out.applied.append(applied)
        metrics.OBJECTS_WRITTEN.labels(obj["kind"], applied.action).inc()
        ref = f"{obj['kind']}/{obj['metadata']['name']}"
        if applied.action == "reverted":
            emit(
                body,
                "Warning",
                "ForeignEditReverted",
                f"{ref} was changed outside the operator ({', '.join(applied.fields)}); put back",
            )
        elif applied.action in ("created", "updated"):
            emit(body, "Normal", applied.action.capitalize(), ref)
        return applied.obj

    # Each part on its own: one that fails (an API the cluster lacks) is
    # reported in Degraded and leaves the others reconciled.
    try:
        for obj in manifests.shared_objects(td, namespace, spec, owner):
            await apply(obj)
    except ApiException as exc:
        out.errors.append(f"API error {exc.status}: {exc.reason}")
        log.warning("reconcile of %s/%s failed: %s", namespace, td, exc)
    # An hf:// model is downloaded once before any engine starts: until its
    # Job completed the pools are left as they are (none at first; on a new
    # revision, the old engines keep serving the old weights).
    if (job := manifests.model_download_job(td, namespace, spec, owner)) is not None:
        try:
            out.model = model_condition(spec.model.source or "", await apply(job))
        except ApiException as exc:
            out.errors.append(f"model download: API error {exc.status}: {exc.reason}")
            out.model = model_condition(spec.model.source or "", None)
        if not out.model.status:
            if out.model.reason == "DownloadFailed":
                emit(body, "Warning", "DownloadFailed", out.model.message)
            return await _finish(kube, body, out, spec, namespace, td, started)
    mode = spec.scaling.mode
    for role, pool_obj in zip(
        spec.roles, manifests.engine_pools(td, namespace, spec, owner), strict=True
    ):
        try:
            workload = manifests.workload_kind(spec.pool(role))
            existing = await kube.get(
                workload.api_version, workload.kind, namespace, manifests.pool_name(td, role)
            )
            pool = await _ensure_pool(
                kube,
                pool_obj,
                spec.pool(role).replicas,
                None if existing is None else existing.get("spec", {}).get("replicas"),
            )
            out.pools.append(
                await _reconcile_pool(
                    kube, td, namespace, spec, role, pool, owner, hpas, mode, apply, emit
                )
            )
        except (ApiException, MissingApi) as exc:
            why = (
                str(exc) if isinstance(exc, MissingApi) else f"API error {exc.status}: {exc.reason}"
            )
            out.errors.append(f"{role} pool: {why}")
            out.pools.append(PoolState(role, parse_pool(pool_obj["spec"]).replicas, 0, 0))
            log.warning("reconcile of %s/%s, %s pool, failed: %s", namespace, td, role, exc)
    return await _finish(kube, body, out, spec, namespace, td, started)


async def _finish(
    kube: Kube,
    body: dict[str, Any],
    out: Outcome,
    spec: TandemSpec,
    namespace: str,
    td: str,
    started: float,
) -> Outcome:
    router = await kube.get("apps/v1", "Deployment", namespace, f"{td}-router")
    router_ready = router is not None and (
        router.get("status", {}).get("readyReplicas", 0) >= spec.router.replicas
    )
    await _write_status(kube, body, out, spec, router_ready)
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    metrics.RECONCILES.labels("error" if out.errors else "ok").inc()
    return out


async def _ensure_pool(
    kube: Kube, desired: dict[str, Any], template_replicas: int, workload_replicas: int | None
) -> dict[str, Any]:
    """Create the EnginePool, or update it without taking its replica count from the
    template unless the template's count itself changed (see the module docstring).
    A pool created while its workload exists (the EnginePool was deleted: the
    workload, owned by the TandemDeployment, stayed) starts at the workload's size,
    so deleting a pool loses neither its pods nor its scaled count."""
    desired["metadata"].setdefault("annotations", {})[TEMPLATE_REPLICAS] = str(template_replicas)

    def count_from_scale(want: dict[str, Any], current: dict[str, Any] | None) -> None:
        if current is None:
            if workload_replicas is not None:
                want["spec"]["replicas"] = workload_replicas
        elif current["metadata"].get("annotations", {}).get(TEMPLATE_REPLICAS) == str(
            template_replicas
        ):
            want["spec"]["replicas"] = current["spec"]["replicas"]
        # Keep the count within the bounds even when it was set by /scale.
        want["spec"]["replicas"] = max(
            want["spec"]["minReplicas"], min(want["spec"]["maxReplicas"], want["spec"]["replicas"])
        )

    return (await reconcile.apply(kube, desired, adjust=count_from_scale)).obj


async def _reconcile_pool(
    kube: Kube,
    td: str,
    namespace: str,
    spec: TandemSpec,
    role: str,
    pool: dict[str, Any],
    owner: manifests.Owner,
    hpas: list[dict[str, Any]],
    mode: str,
    apply: Apply,
    emit: Emit,
) -> PoolState:
    """`owner`, the TandemDeployment, owns the pool's workload: deleting the
    EnginePool must not collect its engines (all at once, undrained).

    A scale-down is recorded on the EnginePool (annotation `tandem.dev/scale-down`:
    from, to, generation, whether the deletion costs are set) before anything
    else is written, and cleared once the workload is at the target with no pod
    above it. Whoever leads the next pass reads it there, not in memory: a
    leader that died mid-way is followed by one that resumes the same decision
    (the costs already set stay, no second marking) and completes it."""
    workload = manifests.workload_kind(spec.pool(role))
    kind = workload.kind
    name = manifests.pool_name(td, role)
    current = await kube.get(workload.api_version, kind, namespace, name)
    current_replicas = (current or {}).get("spec", {}).get("replicas")
    desired = parse_pool(pool["spec"]).replicas
    conflict = foreign_autoscaler(hpas, td, role, kind, mode)
    if conflict and current_replicas is not None:
        desired = current_replicas  # leave the count to the autoscaler, report it
    selector = manifests.pool_selector(td, role)
    label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    record = scale_down_record(pool)
    if current_replicas is not None and desired < current_replicas:
        if record is None or record.get("to") != desired:
            record = {
                "from": current_replicas,
                "to": desired,
                "generation": pool["metadata"].get("generation", 1),
                "costsSet": False,
                "startedAt": _now(),
            }
            await _write_record(kube, namespace, name, record)
        if record.get("costsSet"):
            log.info(
                "%s/%s: resuming the scale-down %s -> %s with the deletion costs set before",
                namespace,
                name,
                record.get("from"),
                desired,
            )
        else:
            await _mark_cheapest(kube, namespace, td, label_selector, emit, pool)
            record = {**record, "costsSet": True}
            await _write_record(kube, namespace, name, record)
    for obj in manifests.pool_workload(td, namespace, spec, role, desired, owner):
        # In a conflict the count is the autoscaler's, whatever it is when written.
        keep = ("spec.replicas",) if conflict and obj["kind"] == kind else ()
        try:
            written = await apply(obj, keep)
        except ApiException as exc:
            if exc.status == 404 and obj["kind"] == manifests.LEADER_WORKER_SET.kind:
                raise MissingApi(LWS_MISSING) from exc
            raise
        if obj["kind"] == kind:
            current = written
    pods = await kube.list("v1", "Pod", namespace, label_selector)
    draining = tuple(
        sorted(p["metadata"]["name"] for p in pods if p["metadata"].get("deletionTimestamp"))
    )
    if record is not None and (
        record.get("to") != desired
        or ((current or {}).get("spec", {}).get("replicas") == desired and len(pods) <= desired)
    ):
        # Over (its pods gone) or overtaken by another count: cleared before the
        # Event, so a leader that dies between the two never reports it twice.
        await _write_record(kube, namespace, name, None)
        if record.get("to") == desired:
            emit(
                pool,
                "Normal",
                "ScaledDown",
                f"{role} pool {record.get('from')} -> {desired}: the removed pods drained "
                f"and are gone (started {record.get('startedAt')})",
            )
    status = (current or {}).get("status", {})
    state = PoolState(
        role=role,
        desired=desired,
        replicas=status.get("replicas", 0),
        ready=status.get("readyReplicas", 0),
        draining=draining,
        conflict=conflict,
    )
    pool_status = {
        "observedGeneration": pool["metadata"].get("generation", 1),
        "replicas": state.replicas,
        "readyReplicas": state.ready,
        "selector": label_selector,
        "workload": f"{kind}/{name}",
        "draining": list(draining),
        "drainingCount": len(draining),
        "conditions": merge_conditions(
            pool.get("status", {}).get("conditions", []),
            pool_conditions(state),
            pool["metadata"].get("generation", 1),
            _now(),
        ),
    }
    if pool.get("status") != {**pool.get("status", {}), **pool_status}:
        await kube.patch(
            API_VERSION,
            "EnginePool",
            namespace,
            name,
            {"status": pool_status},
            subresource="status",
        )
    if conflict:
        emit(pool, "Warning", "ScalingConflict", conflict)
    return state


def scale_down_record(pool: dict[str, Any]) -> dict[str, Any] | None:
    """The scale-down in progress on an EnginePool, as the annotation records it."""
    raw = pool["metadata"].get("annotations", {}).get(SCALE_DOWN)
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        log.warning(
            "%s: unreadable %s annotation %r: ignored", pool["metadata"]["name"], SCALE_DOWN, raw
        )
        return None
    return record if isinstance(record, dict) else None


async def _write_record(
    kube: Kube, namespace: str, pool: str, record: dict[str, Any] | None
) -> None:
    value = None if record is None else json.dumps(record, sort_keys=True)
    await kube.patch(
        API_VERSION,
        "EnginePool",
        namespace,
        pool,
        {"metadata": {"annotations": {SCALE_DOWN: value}}},
    )


async def _mark_cheapest(
    kube: Kube, namespace: str, td: str, label_selector: str, emit: Emit, pool: dict[str, Any]
) -> None:
    """Set each pod's deletion cost from the routers' loads before a scale-down."""
    pods = await kube.list("v1", "Pod", namespace, label_selector)
    routers = await kube.list(
        "v1",
        "Pod",
        namespace,
        f"{manifests.LABEL_DEPLOYMENT}={td},{manifests.LABEL_COMPONENT}=router",
    )
    urls = [f"{url}/metrics" for url in router_urls(routers)]
    loads = await drain.router_loads(urls)
    addresses = {
        p["metadata"]["name"]: f"{p['status']['podIP']}:{_port(p, 'grpc', manifests.GRPC_PORT)}"
        for p in pods
        if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp")
    }
    costs = drain.deletion_costs(addresses, loads)
    for pod_name, cost in costs.items():
        await kube.patch(
            "v1",
            "Pod",
            namespace,
            pod_name,
            {"metadata": {"annotations": {manifests.DELETION_COST: str(cost)}}},
        )
    if costs:
        cheapest = min(costs, key=lambda n: costs[n])
        emit(
            pool,
            "Normal",
            "DeletionCostsSet",
            f"scale-down: deletion costs {dict(sorted(costs.items()))}; cheapest {cheapest} "
            f"(from {len(loads)} router(s))",
        )


def router_urls(routers: list[dict[str, Any]]) -> list[str]:
    """http://IP:PORT of each router pod that has an address."""
    return [
        f"http://{p['status']['podIP']}:{_port(p, 'http', manifests.ROUTER_PORT)}"
        for p in routers
        if p.get("status", {}).get("podIP")
    ]


def _port(pod: dict[str, Any], name: str, default: int) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == name:
                return int(port["containerPort"])
    return default


async def _write_status(
    kube: Kube, body: dict[str, Any], out: Outcome, spec: TandemSpec, router_ready: bool
) -> None:
    meta = body["metadata"]
    generation = meta.get("generation", 1)
    conditions = deployment_conditions(out.pools, router_ready, out.problems, out.errors, out.model)
    # The profiles' age moves with the clock: each resync judges it again.
    stale = stale_condition(spec, body.get("status", {}).get("profiles", {}), datetime.now(UTC))
    if stale is not None:
        conditions.append(stale)
    status = {
        "observedGeneration": generation,
        **deployment_summary(out.pools),
        "conditions": merge_conditions(
            body.get("status", {}).get("conditions", []), conditions, generation, _now()
        ),
    }
    if body.get("status") != {**body.get("status", {}), **status}:
        await kube.patch(
            API_VERSION,
            "TandemDeployment",
            meta["namespace"],
            meta["name"],
            {"status": status},
            subresource="status",
        )
