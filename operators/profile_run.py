"""One reconcile of a TandemProfile (the I/O around operators/profile.py).

Level-based, run on its creation, on each change of its Job and on the
operator's resync timer, under the lock of its TandemDeployment (handlers.py),
so two profiles of one pool never start together:

* Pending — waiting, with the reason in the `Profiled` condition: the
  deployment is missing, scales in `Auto` mode (the controller would resize
  the pool under the measurement), another profile of the same pool runs, or
  a pool has no ready replica;
* Running — its Job was created (the run's ready replica count recorded);
* Succeeded — the Job completed: the profile read from its pod's termination
  message is written into the ConfigMap, named in the deployment's
  `scaling.profiles.<role>` when `apply`, and reported in the deployment's
  `status.profiles.<role>`;
* Failed — the Job failed (its message: the end of `tandem profile`'s log),
  its result was unusable, or the deployment has no such pool.

A finished TandemProfile is left alone: to profile again, create another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from operators import reconcile
from operators.kube import Kube
from operators.manifests import LABEL_COMPONENT, LABEL_DEPLOYMENT, pool_name
from operators.planner.profiles import ProfileError
from operators.profile import (
    COMPONENT,
    CONDITION,
    FAILED,
    KIND,
    LABEL_ROLE,
    PENDING,
    RUNNING,
    SUCCEEDED,
    ProfileSpec,
    deployment_profile_status,
    job_ended,
    job_name,
    parse_profile,
    profile_from_message,
    profile_job,
    result_configmap,
    taken_on,
    termination_message,
)
from operators.spec import API_VERSION, TandemSpec, parse
from operators.status import Condition, merge_conditions

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any], str, str, str], None]  # (object, type, reason, message)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def reconcile_profile(kube: Kube, body: dict[str, Any], emit: Emit) -> str:
    """Move one TandemProfile on; returns its phase."""
    phase = str(body.get("status", {}).get("phase", PENDING))
    if phase in (SUCCEEDED, FAILED):
        return phase
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    p = parse_profile(body["spec"])
    td = await kube.get(API_VERSION, "TandemDeployment", namespace, p.deployment)
    if td is None:
        return await _pending(
            kube, body, "DeploymentNotFound", f"no TandemDeployment {p.deployment} here"
        )
    spec = parse(td["spec"])
    if p.role not in spec.roles:
        return await _write(
            kube,
            body,
            FAILED,
            Condition(
                CONDITION,
                False,
                "NoSuchPool",
                f"TandemDeployment {p.deployment} runs no {p.role} pool "
                f"(its pools: {', '.join(spec.roles)})",
            ),
        )
    job = await kube.get("batch/v1", "Job", namespace, job_name(name))
    if job is None:
        return await _start(kube, body, td, spec, p, emit)
    ended = job_ended(job)
    if ended is None:
        return await _write(
            kube,
            body,
            RUNNING,
            Condition(
                CONDITION,
                False,
                "Running",
                f"job/{job_name(name)} is profiling the {p.role} pool "
                f"({len(p.concurrencies)} levels of {p.level_seconds:g} s at most)",
            ),
        )
    pods = await kube.list("v1", "Pod", namespace, f"job-name={job_name(name)}")
    kind, why = ended
    if kind == "Failed":
        detail = termination_message(pods, "Failed")
        message = f"job/{job_name(name)} failed ({why})" + (f": {detail}" if detail else "")
        return await _announce(
            kube, body, emit, FAILED, Condition(CONDITION, False, "JobFailed", message)
        )
    return await _finish(kube, body, td, p, termination_message(pods, "Succeeded"), emit)


async def _start(
    kube: Kube,
    body: dict[str, Any],
    td: dict[str, Any],
    spec: TandemSpec,
    p: ProfileSpec,
    emit: Emit,
) -> str:
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if spec.scaling.mode == "Auto":
        return await _pending(
            kube,
            body,
            "AutoScaling",
            f"TandemDeployment {p.deployment} scales in Auto mode: the controller would "
            f"resize the {p.role} pool under the measurement; set scaling.mode to Recommend "
            "or Off to profile, then back",
        )
    busy = [
        j["metadata"]["name"]
        for j in await kube.list(
            "batch/v1",
            "Job",
            namespace,
            f"{LABEL_DEPLOYMENT}={p.deployment},{LABEL_COMPONENT}={COMPONENT},"
            f"{LABEL_ROLE}={p.role}",
        )
        if job_ended(j) is None
    ]
    if busy:
        return await _pending(
            kube,
            body,
            "AnotherProfileRunning",
            f"job/{busy[0]} is profiling the {p.role} pool of {p.deployment}; "
            "one profile per pool at a time",
        )
    ready: dict[str, int] = {}
    for role in spec.roles:
        pool = await kube.get(API_VERSION, "EnginePool", namespace, pool_name(p.deployment, role))
        ready[role] = (pool or {}).get("status", {}).get("readyReplicas", 0)
    if not all(ready.values()):
        waiting = ", ".join(f"{r} {n} ready" for r, n in ready.items())
        return await _pending(
            kube, body, "PoolNotReady", f"waiting for a ready replica in every pool ({waiting})"
        )
    job = profile_job(name, namespace, meta["uid"], p, spec, ready[p.role])
    await kube.create(job)
    started = (
        f"job/{job_name(name)} started: {p.role} pool of {p.deployment}, {ready[p.role]} replica(s)"
    )
    return await _announce(
        kube,
        body,
        emit,
        RUNNING,
        Condition(CONDITION, False, "Running", started),
        job=job_name(name),
        replicas=ready[p.role],
        startedAt=_now(),
        takenOn=taken_on(spec, p.role),
    )


async def _finish(
    kube: Kube,
    body: dict[str, Any],
    td: dict[str, Any],
    p: ProfileSpec,
    message: str | None,
    emit: Emit,
) -> str:
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    try:
        if message is None:
            raise ValueError("its pod left no termination message")
        profile = profile_from_message(message)
        if profile.role != p.role:
            raise ValueError(f"it measured a {profile.role} pool, not {p.role}")
    except (ValueError, ProfileError) as exc:
        why = f"job/{job_name(name)} completed but its profile is unusable: {exc}"
        return await _announce(
            kube, body, emit, FAILED, Condition(CONDITION, False, "ResultUnusable", why)
        )
    await reconcile.apply(
        kube, result_configmap(profile, p, name, namespace, td["metadata"]["uid"])
    )
    if p.apply and td["spec"].get("scaling", {}).get("profiles", {}).get(p.role) != p.config_map:
        await kube.patch(
            API_VERSION,
            "TandemDeployment",
            namespace,
            p.deployment,
            {"spec": {"scaling": {"profiles": {p.role: p.config_map}}}},
        )
    # What the pool ran when the run started (recorded then; else this spec's).
    ran = body.get("status", {}).get("takenOn") or taken_on(parse(td["spec"]), p.role)
    completed = _now()
    await kube.patch(
        API_VERSION,
        "TandemDeployment",
        namespace,
        p.deployment,
        {
            "status": {
                "profiles": {
                    p.role: deployment_profile_status(
                        p,
                        name,
                        profile,
                        completed,
                        p.apply,
                        ran,
                    )
                }
            }
        },
        subresource="status",
    )
    applied = " and named in its scaling.profiles" if p.apply else ""
    text = (
        f"{len(profile.points)} points written to configmap/{p.config_map}{applied} "
        f"(job/{job_name(name)})"
    )
    return await _announce(
        kube,
        body,
        emit,
        SUCCEEDED,
        Condition(CONDITION, True, "Profiled", text),
        configMap=p.config_map,
        points=len(profile.points),
        applied=p.apply,
        completedAt=completed,
    )


# The Event (type, reason) of each step a user watches, by the phase it enters.
EVENTS = {
    RUNNING: ("Normal", "ProfileStarted"),
    SUCCEEDED: ("Normal", "Profiled"),
    FAILED: ("Warning", "ProfileFailed"),
}


async def _announce(
    kube: Kube,
    body: dict[str, Any],
    emit: Emit,
    phase: str,
    condition: Condition,
    **fields: Any,
) -> str:
    """A step a user watches (started, failed, profiled): its Event, with the
    condition's message, and the status; a run that ended gets completedAt."""
    kind, reason = EVENTS[phase]
    emit(body, kind, reason, condition.message)
    if phase in (SUCCEEDED, FAILED):
        fields.setdefault("completedAt", _now())
    return await _write(kube, body, phase, condition, **fields)


async def _pending(kube: Kube, body: dict[str, Any], reason: str, message: str) -> str:
    return await _write(kube, body, PENDING, Condition(CONDITION, False, reason, message))


async def _write(
    kube: Kube, body: dict[str, Any], phase: str, condition: Condition, **fields: Any
) -> str:
    """Merge the phase, the condition and `fields` into the status (no write
    when nothing changes)."""
    meta, status = body["metadata"], body.get("status", {})
    generation = meta.get("generation", 1)
    new = {
        "phase": phase,
        **fields,
        "conditions": merge_conditions(
            status.get("conditions", []), [condition], generation, _now()
        ),
    }
    if status != {**status, **new}:
        await kube.patch(
            API_VERSION,
            KIND,
            meta["namespace"],
            meta["name"],
            {"status": new},
            subresource="status",
        )
        if phase != status.get("phase"):
            log.info("%s/%s: %s (%s)", meta["namespace"], meta["name"], phase, condition.message)
    return phase
