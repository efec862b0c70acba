"""The Job controller: run a Job's pods to completion, count them, say how it ended.

Pods are created from the template with the generated name `<job>-<5 chars>`,
a controller reference and the labels the real controller adds
(`batch.kubernetes.io/job-name`, `batch.kubernetes.io/controller-uid` and
their short forms `job-name`, `controller-uid`). Up to `parallelism`
(default 1) run at once, until `completions` (default: unset, the first
success ends it) pods have succeeded. A failed pod (phase Failed, or deleted
before it finished) counts against `backoffLimit` (default 6), and so does
each restart of a container under `restartPolicy: OnFailure`; past it the
Job fails (`BackoffLimitExceeded`) and its running pods are deleted, as they
are when `activeDeadlineSeconds` passes (`DeadlineExceeded`).
`ttlSecondsAfterFinished` deletes a finished Job (and so its pods).

Status: active, ready, succeeded, failed, startTime, completionTime (on
success), and the conditions `Complete` or `Failed` with their reason and
message. Not done: the job-tracking finalizers (finished pods are counted
while they exist; the counts never go down, so a finished pod deleted by
hand keeps its count but a later one may not be told apart from it), indexed
completions, pod failure and success policies, `suspend`, the back-off delay
before a failed pod is replaced (it is replaced at once).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from devcluster import semantics
from devcluster.controllers.base import (
    JOBS,
    PODS,
    Controller,
    ObjRef,
    condition,
    owner_keys,
    parse_time,
    pod_from_template,
    pod_ready,
    set_condition,
)
from devcluster.store import ApiError, Event

DEFAULT_BACKOFF_LIMIT = 6


def _finished(job: dict) -> str | None:
    """'Complete' or 'Failed' once the Job has ended, else None."""
    for kind in ("Complete", "Failed"):
        if (condition(job, kind) or {}).get("status") == "True":
            return kind
    return None


def _restarts(pod: dict) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(s.get("restartCount", 0) for s in statuses)


class JobController(Controller):
    name = "job"
    primary = JOBS
    watches = (JOBS, PODS)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind == PODS:
            return owner_keys(event, "Job")
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        job = self.get(JOBS, namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None
        spec = job.get("spec") or {}
        status = dict(job.get("status") or {})
        now = dt.datetime.now(dt.UTC)
        pods = self.owned(PODS, job)
        ended = _finished(job)
        if ended is not None:
            self._stop(job, pods)
            return self._expire(job, spec, now)

        phase = {p["metadata"]["uid"]: (p.get("status") or {}).get("phase") for p in pods}
        succeeded = [p for p in pods if phase[p["metadata"]["uid"]] == "Succeeded"]
        failed = [
            p
            for p in pods
            if phase[p["metadata"]["uid"]] == "Failed"
            or (
                p["metadata"].get("deletionTimestamp")
                and phase[p["metadata"]["uid"]] != "Succeeded"
            )
        ]
        active = [p for p in pods if p not in succeeded and p not in failed]
        restarts = (
            sum(_restarts(p) for p in active)
            if (spec.get("template") or {}).get("spec", {}).get("restartPolicy") == "OnFailure"
            else 0
        )
        status["succeeded"] = max(status.get("succeeded", 0), len(succeeded))
        status["failed"] = max(status.get("failed", 0), len(failed))
        status.setdefault("startTime", semantics.now_rfc3339())
        conditions = list(status.get("conditions") or [])

        completions = spec.get("completions")
        parallelism = spec.get("parallelism", 1)
        limit = spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT)
        deadline = spec.get("activeDeadlineSeconds")
        started = parse_time(status["startTime"])
        assert started is not None
        over_deadline = deadline is not None and (now - started).total_seconds() >= deadline
        done = (
            status["succeeded"] >= completions
            if completions is not None
            else status["succeeded"] > 0 and not active
        )
        if status["failed"] + restarts > limit or over_deadline:
            reason, message = (
                ("DeadlineExceeded", "Job was active longer than specified deadline")
                if over_deadline
                else ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            )
            self._stop(job, active)
            active = []
            conditions = set_condition(conditions, "Failed", "True", reason, message)
            self.record_event(job, reason, message, "Warning")
        elif done:
            conditions = set_condition(conditions, "Complete", "True", "", "")
            status["completionTime"] = semantics.now_rfc3339()
            self.record_event(job, "Completed", "Job completed")
        else:
            want = parallelism
            if completions is not None:
                want = min(parallelism, completions - status["succeeded"])
            elif status["succeeded"]:
                want = 0  # one success ends a Job without completions: no new pods
            for _ in range(max(0, want - len(active))):
                pod = self._create_pod(job, namespace, name, spec)
                active.append(pod)
        status["active"] = len(active)
        status["ready"] = sum(1 for p in active if pod_ready(p))
        if conditions:
            status["conditions"] = conditions
        written = self.write_status(JOBS, job, status)
        if _finished(written) is not None:
            return self._expire(written, spec, now)
        if deadline is not None:
            return max(0.05, deadline - (now - started).total_seconds())
        return None

    def _create_pod(self, job: dict, namespace: str, name: str, spec: dict) -> dict:
        uid = job["metadata"]["uid"]
        labels = {
            "batch.kubernetes.io/controller-uid": uid,
            "batch.kubernetes.io/job-name": name,
            "controller-uid": uid,
            "job-name": name,
        }
        pod = pod_from_template(
            spec.get("template") or {},
            job,
            namespace,
            generate_name=f"{name}-",
            extra_labels=labels,
        )
        created = self.store.create(self.kind(PODS), namespace, pod)
        self.record_event(job, "SuccessfulCreate", f"Created pod: {created['metadata']['name']}")
        return created

    def _stop(self, job: dict, pods: list[dict]) -> None:
        """Delete (gracefully) the pods of an ended Job that still run."""
        for pod in pods:
            running = (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            if running and not pod["metadata"].get("deletionTimestamp"):
                self.delete_pod(pod)
                self.record_event(
                    job, "SuccessfulDelete", f"Deleted pod: {pod['metadata']['name']}"
                )

    def _expire(self, job: dict, spec: dict, now: dt.datetime) -> float | None:
        """ttlSecondsAfterFinished: delete the Job once its time is up."""
        ttl = spec.get("ttlSecondsAfterFinished")
        if ttl is None:
            return None
        kind = _finished(job)
        since = parse_time((condition(job, kind or "") or {}).get("lastTransitionTime"))
        left = ttl - (now - since).total_seconds() if since is not None else 0.0
        if left > 0:
            return left
        meta = job["metadata"]
        try:
            self.store.delete(
                self.kind(JOBS),
                meta["namespace"],
                meta["name"],
                {"propagationPolicy": "Background"},
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
        return None
