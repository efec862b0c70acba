"""A TandemProfile as Kubernetes objects (pure): its spec, the Job that runs
`tandem profile` against one pool, the profile read back from the Job's pod,
and the statuses written.

The Job's one container runs a router of its own beside `tandem profile`,
both in the router's image: the router finds the deployment's engines the
way the deployment's routers do (EndpointSlices, under the routers'
ServiceAccount, whose rights are all the pod has) and listens on the pod's
loopback only; for a prefill or decode pool it sends every prompt to the
prefill pool (`PD_PROFILE_ROUTER_ARGS`), so each pool does only its own work.
`tandem profile` writes the profile document to the container's
terminationMessagePath, which the kubelet copies into the pod's status: the
operator reads it there and writes the ConfigMap (the same one `tandem
profile -o` writes), so the Job needs no rights on ConfigMaps.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from operators.manifests.meta import ROUTER_PORT, Manifest, Owner, dns_label, labels, meta
from operators.manifests.router import router_objects
from operators.planner.profiles import (
    EngineProfile,
    PoolRole,
    profile_configmap,
    profile_from_dict,
)
from operators.planner.profiling import PD_PROFILE_ROUTER_ARGS
from operators.spec import GROUP, VERSION, TandemSpec
from operators.status import Condition

KIND = "TandemProfile"
PLURAL = "tandemprofiles"
RESOURCE = (GROUP, VERSION, PLURAL)
COMPONENT = "profile"
LABEL_ROLE = "tandem.dev/profile-role"
LABEL_PROFILE = "tandem.dev/profile"
MESSAGE_PATH = "/dev/termination-log"
WORK_DIR = "/var/lib/tandem-profile"
# Seconds the Job's router has to find and reach the engines.
ROUTER_WAIT_S = 600
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
CONDITION = "Profiled"


@dataclass(frozen=True)
class ProfileSpec:
    deployment: str
    role: PoolRole
    concurrencies: tuple[int, ...]
    level_seconds: float
    ttft_ceiling_seconds: float
    trace_profile: str
    args: tuple[str, ...]
    config_map: str
    apply: bool
    active_deadline_seconds: int


def parse_profile(spec: Mapping[str, Any]) -> ProfileSpec:
    """The spec as the API server defaults it (the CRD validated it)."""
    deployment, role = str(spec["deployment"]), cast(PoolRole, spec["role"])
    concurrencies = tuple(sorted({int(c) for c in spec.get("concurrencies", (1, 2, 4, 8, 16, 32))}))
    level_s = float(spec.get("levelSeconds", 60))
    deadline = spec.get("activeDeadlineSeconds")
    return ProfileSpec(
        deployment=deployment,
        role=role,
        concurrencies=concurrencies,
        level_seconds=level_s,
        ttft_ceiling_seconds=float(spec.get("ttftCeilingSeconds", 60)),
        trace_profile=str(spec.get("traceProfile", "small")),
        args=tuple(str(a) for a in spec.get("args", ())),
        config_map=str(spec.get("configMap") or f"{deployment}-{role}-profile"),
        apply=bool(spec.get("apply", False)),
        active_deadline_seconds=int(
            deadline if deadline is not None else 2 * len(concurrencies) * level_s + 600
        ),
    )


def job_name(profile: str) -> str:
    return dns_label(f"{profile}-profile")


def profile_labels(p: ProfileSpec, profile: str) -> dict[str, str]:
    """LABEL_PROFILE selects a profile's Job; its owner reference names the
    profile (a long name is cut in the label)."""
    return labels(
        p.deployment, COMPONENT, **{LABEL_ROLE: p.role, LABEL_PROFILE: dns_label(profile)}
    )


def profile_command(p: ProfileSpec, td: TandemSpec, replicas: int) -> list[str]:
    """`tandem profile`'s argv against the pod's own router."""
    pool = td.pool(p.role)
    par = pool.parallelism
    return [
        "tandem",
        "profile",
        f"--url=http://127.0.0.1:{ROUTER_PORT}",
        f"--wait-ready={ROUTER_WAIT_S}",
        f"--role={p.role}",
        f"--concurrencies={','.join(str(c) for c in p.concurrencies)}",
        f"--level-s={p.level_seconds:g}",
        f"--ttft-ceiling={p.ttft_ceiling_seconds:g}",
        f"--profile={p.trace_profile}",
        f"--replicas={replicas}",
        f"--name={p.config_map}",
        f"--tokenizer={td.model.origin.model_path}",
        # A pool without GPUs (CPU engines) counts one unit per replica.
        f"--gpus-per-replica={max(1, pool.gpus_per_pod * pool.nodes_per_replica)}",
        f"--tp={par.tensor}",
        f"--pp={par.pipeline}",
        f"--dp={par.data}",
        f"--pcp={par.prefill_context}",
        f"--dcp={par.decode_context}",
        "--no-progress",
        f"--out={WORK_DIR}/runs",
        f"--output={WORK_DIR}/profile.yaml",
        f"--result-file={MESSAGE_PATH}",
        *p.args,
    ]


def profile_job(
    name: str, namespace: str, uid: str, p: ProfileSpec, td: TandemSpec, replicas: int
) -> Manifest:
    """The Job of TandemProfile `name`: the router (from the deployment's own
    router container, on loopback) in the background, `tandem profile` in
    front; the container's exit status is the profile's."""
    owner = Owner(KIND, name, uid)
    deployment = next(
        o for o in router_objects(p.deployment, namespace, td, owner) if o["kind"] == "Deployment"
    )
    pod = deployment["spec"]["template"]["spec"]
    [router] = pod["containers"]
    router_argv = [
        *router["command"],
        *router["args"],
        "--host=127.0.0.1",
        *(PD_PROFILE_ROUTER_ARGS if p.role != "aggregated" else ()),
    ]
    script = (
        f"{shlex.join(router_argv)} &\n"
        f"{shlex.join(profile_command(p, td, replicas))}\n"
        "code=$?\n"
        "kill $! 2>/dev/null\n"
        "exit $code\n"
    )
    lbls = profile_labels(p, name)
    container = {
        "name": "profile",
        "image": router["image"],
        "imagePullPolicy": router["imagePullPolicy"],
        "command": ["sh", "-c", script],
        "env": [{"name": "HOME", "value": WORK_DIR}],
        "resources": router["resources"],
        "terminationMessagePath": MESSAGE_PATH,
        # A failure's last log lines become the message (the reason shown).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [*router.get("volumeMounts", []), {"name": "work", "mountPath": WORK_DIR}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(job_name(name), namespace, owner, lbls),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": p.active_deadline_seconds,
            "template": {
                "metadata": {"labels": lbls},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": pod["serviceAccountName"],
                    "containers": [container],
                    "volumes": [*pod.get("volumes", []), {"name": "work", "emptyDir": {}}],
                },
            },
        },
    }


def job_ended(job: Mapping[str, Any]) -> tuple[str, str] | None:
    """('Complete' or 'Failed', its message) once the Job has ended, else None."""
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return str(cond["type"]), str(cond.get("message") or cond.get("reason") or "")
    return None


def termination_message(pods: Sequence[Mapping[str, Any]], phase: str) -> str | None:
    """The profile container's termination message in the Job's pod of `phase`."""
    for pod in pods:
        if pod.get("status", {}).get("phase") != phase:
            continue
        for status in pod["status"].get("containerStatuses", []):
            terminated = status.get("state", {}).get("terminated", {})
            if status.get("name") == "profile" and terminated.get("message"):
                return str(terminated["message"])
    return None


def profile_from_message(message: str) -> EngineProfile:
    """The profile `tandem profile --result-file` wrote (ValueError if unusable)."""
    try:
        doc = json.loads(message)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the Job's result is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("the Job's result is not a profile document")
    return profile_from_dict(doc)


def result_configmap(
    profile: EngineProfile, p: ProfileSpec, name: str, namespace: str, td_uid: str
) -> Manifest:
    """The profile's ConfigMap as `tandem profile -o` writes it, owned by the
    deployment it describes (it outlives the TandemProfile) and labelled with
    the run it came from."""
    cm = profile_configmap(profile, p.config_map, namespace)
    owner = Owner("TandemDeployment", p.deployment, td_uid)
    cm["metadata"] = {
        **meta(p.config_map, namespace, owner, profile_labels(p, name)),
        "labels": {**profile_labels(p, name), **cm["metadata"]["labels"]},
    }
    return cm


def deployment_profile_status(
    p: ProfileSpec,
    name: str,
    profile: EngineProfile,
    completed_at: str,
    applied: bool,
    taken_on: Mapping[str, Any],
) -> dict[str, Any]:
    """What the TandemDeployment's `status.profiles.<role>` says of the last run."""
    return {
        "tandemProfile": name,
        "configMap": p.config_map,
        "takenAt": profile.taken_at,
        "completedAt": completed_at,
        "points": len(profile.points),
        "applied": applied,
        "takenOn": dict(taken_on),
    }


def taken_on(td: TandemSpec, role: str) -> dict[str, Any]:
    """What a pool runs that its profile's figures depend on: the weights (a
    new revision is a new source), the tensor parallelism, the engine image."""
    return {
        "model": td.model.source or td.model.path or "",
        "tensorParallel": td.pool(role).parallelism.tensor,
        "image": td.images.engine,
    }


STALE = "ProfileStale"
_TAKEN_ON_NAMES = {
    "model": "model",
    "tensorParallel": "tensor parallelism",
    "image": "engine image",
}


def stale_condition(
    td: TandemSpec, profiles: Mapping[str, Mapping[str, Any]], now: datetime
) -> Condition | None:
    """ProfileStale from the deployment's `status.profiles`: True when a pool's
    profile, the one `scaling.profiles` names, was taken longer ago than
    `scaling.profileMaxAgeHours` or on another model, tensor parallelism or
    engine image than the pool runs now. None when no pool's profile was
    taken by a TandemProfile (a profile applied by hand records neither)."""
    limit = timedelta(hours=td.scaling.profile_max_age_hours)
    stale, fresh = [], []
    for role in td.roles:
        record = profiles.get(role)
        if not record or record.get("configMap") != getattr(td.scaling.profiles, role):
            continue
        why = []
        try:
            age = now - datetime.fromisoformat(str(record.get("takenAt")))
        except (ValueError, TypeError):  # no date, or one without its UTC offset
            age = None
        if age is not None and age > limit:
            why.append(
                f"taken {age / timedelta(hours=1):.0f} h ago "
                f"(scaling.profileMaxAgeHours {td.scaling.profile_max_age_hours})"
            )
        then, current = record.get("takenOn") or {}, taken_on(td, role)
        why += [
            f"{what} {then[key]!r} then, {current[key]!r} now"
            for key, what in _TAKEN_ON_NAMES.items()
            if key in then and then[key] != current[key]
        ]
        if why:
            stale.append(f"{role} ({record['configMap']}): {', '.join(why)}")
        else:
            fresh.append(role)
    if not stale and not fresh:
        return None
    if stale:
        return Condition(
            STALE,
            True,
            "Stale",
            "; ".join(stale) + ": run a new TandemProfile of the pool",
        )
    return Condition(STALE, False, "Fresh", f"{', '.join(fresh)}: profiled on what runs now")
