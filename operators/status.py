"""Status of a TandemDeployment and its EnginePools (pure: observed state in, status out)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from operators.planner.loop import Condition as LoopCondition


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(
    previous: list[dict[str, Any]],
    new: Sequence[Condition | LoopCondition],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """Conditions as stored: `lastTransitionTime` moves only when the status flips.
    A condition's status is a bool or already "True", "False" or "Unknown" (the
    rate-matching controller's, operators/planner/loop.py)."""
    before = {c["type"]: c for c in previous or []}
    out = []
    for cond in new:
        status = (
            cond.status if isinstance(cond.status, str) else ("True" if cond.status else "False")
        )
        old = before.get(cond.type)
        since = now if old is None or old.get("status") != status else old["lastTransitionTime"]
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "observedGeneration": generation,
                "lastTransitionTime": since,
            }
        )
    known = {c.type for c in new}
    out += [c for c in previous or [] if c["type"] not in known]
    return out


@dataclass(frozen=True)
class PoolState:
    """What the operator saw of one pool's workload."""

    role: str
    desired: int
    replicas: int  # pods the workload has (status.replicas)
    ready: int
    draining: tuple[str, ...] = ()
    conflict: str = ""  # why the operator does not write this pool's replica count


def ratio(prefill: int, decode: int) -> str:
    if prefill == 0 or decode == 0:
        return f"{prefill}:{decode}"
    g = math.gcd(prefill, decode)
    return f"{prefill // g}:{decode // g}"


def pool_conditions(pool: PoolState) -> list[Condition]:
    ready = pool.ready >= pool.desired and pool.replicas == pool.desired
    out = [
        Condition(
            "Ready",
            ready,
            "AllReplicasReady" if ready else "ReplicasNotReady",
            f"{pool.ready}/{pool.desired} engine replicas ready",
        ),
        Condition(
            "Progressing",
            not ready,
            "Scaling" if pool.replicas != pool.desired else ("Starting" if not ready else "Stable"),
            f"{pool.replicas} replicas, {pool.desired} desired",
        ),
        Condition(
            "Draining",
            bool(pool.draining),
            "PodsTerminating" if pool.draining else "NoneDraining",
            ", ".join(pool.draining),
        ),
    ]
    out.append(
        Condition(
            "ScalingConflict",
            bool(pool.conflict),
            "ForeignAutoscaler" if pool.conflict else "NoConflict",
            pool.conflict,
        )
    )
    return out


def model_condition(source: str, job: dict[str, Any] | None) -> Condition:
    """`ModelReady` of an hf:// source from its download Job (None: not seen yet)."""
    if job is None:
        return Condition("ModelReady", False, "Downloading", f"starting the download of {source}")
    name = job["metadata"]["name"]
    status = job.get("status", {})
    done = {c["type"]: c for c in status.get("conditions", []) if c.get("status") == "True"}
    if "Complete" in done:
        return Condition("ModelReady", True, "Downloaded", f"{source} is in the cache (job/{name})")
    if "Failed" in done:
        why = done["Failed"].get("message") or done["Failed"].get("reason", "")
        return Condition(
            "ModelReady",
            False,
            "DownloadFailed",
            f"job/{name} failed ({why}): engines are not started; see "
            f"`kubectl logs job/{name}`, fix the source or its token, and delete the Job to retry",
        )
    tries = job.get("spec", {}).get("backoffLimit", 0) + 1
    return Condition(
        "ModelReady",
        False,
        "Downloading",
        f"job/{name} downloading {source}: {status.get('active', 0)} running, "
        f"{status.get('failed', 0)} of {tries} tries failed",
    )


def deployment_conditions(
    pools: list[PoolState],
    router_ready: bool,
    problems: list[str],
    errors: list[str],
    model: Condition | None = None,
) -> list[Condition]:
    """`model`: ModelReady when the model is downloaded first (else None)."""
    if problems:
        message = "the spec cannot be served: " + "; ".join(problems)
        return [
            Condition("Ready", False, "InvalidSpec", message),
            Condition("Progressing", False, "InvalidSpec", "fix the spec to continue"),
            Condition("Degraded", True, "InvalidSpec", message),
        ]
    pools_ready = all(p.ready >= p.desired and p.replicas == p.desired for p in pools)
    ready = pools_ready and router_ready and not errors and (model is None or model.status)
    waiting = [
        f"{p.role} {p.ready}/{p.desired}"
        for p in pools
        if p.ready < p.desired or p.replicas != p.desired
    ]
    if not router_ready:
        waiting.append("router")
    model_failed = model is not None and model.reason == "DownloadFailed"
    if model is not None and not model.status and not model_failed:
        waiting.insert(0, "the model download")
    conflicts = [f"{p.role}: {p.conflict}" for p in pools if p.conflict]
    degraded = conflicts + errors + ([model.message] if model is not None and model_failed else [])
    draining = [f"{p.role}: {', '.join(p.draining)}" for p in pools if p.draining]
    return [
        Condition(
            "Ready",
            ready,
            "AllReady" if ready else "Waiting",
            "serving" if ready else "waiting for " + ", ".join(waiting or ["errors"]),
        ),
        Condition(
            "Progressing", bool(waiting), "Reconciling" if waiting else "Stable", ", ".join(waiting)
        ),
        Condition(
            "Degraded",
            bool(degraded),
            "ScalingConflict"
            if conflicts
            else "ReconcileError"
            if errors
            else "DownloadFailed"
            if model_failed
            else "Healthy",
            "; ".join(degraded),
        ),
        Condition(
            "Draining",
            bool(draining),
            "PodsTerminating" if draining else "NoneDraining",
            "; ".join(draining),
        ),
        *([model] if model is not None else []),
    ]


def deployment_summary(pools: list[PoolState]) -> dict[str, Any]:
    """The printer-column fields: prefill and decode ready/desired, the P:D ratio."""
    by_role = {p.role: p for p in pools}
    out = {}
    for role in ("prefill", "decode"):
        p = by_role.get(role)
        out[role] = f"{p.ready}/{p.desired}" if p else "0/0"
    p, d = by_role.get("prefill"), by_role.get("decode")
    out["ratio"] = ratio(p.desired if p else 0, d.desired if d else 0)
    return out
