"""The LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1, as LWS 0.6 runs groups).

When the LeaderWorkerSet CRD is installed, for each group index i below
`spec.replicas`:

* a leader pod `<name>-<i>` and `size - 1` worker pods `<name>-<i>-<j>`
  (j = 1 … size-1), from `leaderTemplate` (the worker template when absent)
  and `workerTemplate`;
* labels `leaderworkerset.sigs.k8s.io/name`, `group-index`, `worker-index`
  (0 for the leader), `group-key`, `template-revision-hash`; annotations
  `leaderworkerset.sigs.k8s.io/size` and, on workers, `leader-name`;
* `hostname` = the pod's name and `subdomain` = the LeaderWorkerSet's name,
  with the headless Service `<name>` (publishNotReadyAddresses) that LWS
  creates, so `<name>-<i>.<name>.<namespace>` names the leader;
* every container gets `LWS_LEADER_ADDRESS` (that name), `LWS_GROUP_SIZE`
  and `LWS_WORKER_INDEX`, ahead of its own env (so `$(VAR)` can use them);
* `startupPolicy: LeaderReady` creates workers only once the leader is Ready
  (`LeaderCreated`, the default, at once);
* `restartPolicy: RecreateGroupOnPodRestart` (the default) deletes the whole
  group when one of its pods fails or is deleted, and the group is created
  again; a template change replaces groups one at a time, each only while
  every other group is ready;
* status: replicas (groups), readyReplicas (groups whose pods are all
  Ready), updatedReplicas, hpaPodSelector (for `/scale`), conditions.

Simplified: LWS keeps leaders in a StatefulSet `<name>` and each group's
workers in a StatefulSet `<name>-<i>` owned by the leader pod; here leaders
are owned by the LeaderWorkerSet and workers by their leader pod directly
(deleting a leader still takes its workers). `subdomainPolicy:
UniquePerReplica`, subgroups and volumeClaimTemplates are not handled.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable

from devcluster.controllers.base import (
    LEADERWORKERSETS,
    PODS,
    SERVICES,
    Controller,
    ObjRef,
    controller_ref,
    owner_reference,
    pod_from_template,
    pod_ready,
    set_condition,
    template_hash,
)
from devcluster.store import Event

PREFIX = "leaderworkerset.sigs.k8s.io"
NAME = f"{PREFIX}/name"
GROUP_INDEX = f"{PREFIX}/group-index"
WORKER_INDEX = f"{PREFIX}/worker-index"
GROUP_KEY = f"{PREFIX}/group-key"
REVISION = f"{PREFIX}/template-revision-hash"
SIZE = f"{PREFIX}/size"
LEADER_NAME = f"{PREFIX}/leader-name"


def _with_env(template: dict, env: list[dict]) -> dict:
    out = copy.deepcopy(template)
    for container in (out.get("spec") or {}).get("containers") or []:
        own = container.get("env") or []
        names = {e["name"] for e in own}
        container["env"] = [e for e in env if e["name"] not in names] + own
    return out


class LeaderWorkerSetController(Controller):
    name = "leaderworkerset"
    primary = LEADERWORKERSETS
    watches = (LEADERWORKERSETS, PODS, SERVICES)

    def keys_for(self, kind, event: Event) -> Iterable[ObjRef]:
        if kind in (PODS, SERVICES):
            return {
                (o["metadata"]["namespace"], o["metadata"]["labels"][NAME])
                for o in (event.obj, event.old)
                if o is not None and NAME in (o["metadata"].get("labels") or {})
            }
        return super().keys_for(kind, event)

    def reconcile(self, namespace: str, name: str) -> float | None:
        if not self.served(LEADERWORKERSETS):
            return None
        lws = self.get(LEADERWORKERSETS, namespace, name)
        if lws is None or lws["metadata"].get("deletionTimestamp"):
            return None
        spec = lws.get("spec") or {}
        lwt = spec.get("leaderWorkerTemplate") or {}
        size = lwt.get("size", 1)
        replicas = spec.get("replicas", 1)
        revision = template_hash(lwt)
        self._service(lws)
        pods = [p for p in self.list(PODS, namespace, f"{NAME}={name}")]
        groups: dict[int, list[dict]] = {}
        for pod in pods:
            try:
                index = int(pod["metadata"]["labels"].get(GROUP_INDEX, ""))
            except ValueError:
                continue
            groups.setdefault(index, []).append(pod)

        def leader_of(i: int) -> dict | None:
            return next(
                (p for p in groups.get(i, []) if p["metadata"]["name"] == f"{name}-{i}"), None
            )

        def members(i: int) -> list[dict]:
            """The leader and the workers it owns (not an earlier leader's, still going)."""
            leader = leader_of(i)
            if leader is None:
                return []
            uid = leader["metadata"]["uid"]
            return [leader] + [
                p
                for p in groups.get(i, [])
                if (ref := controller_ref(p)) is not None and ref["uid"] == uid
            ]

        def group_ready(i: int) -> bool:
            group = members(i)
            return len(group) == size and all(
                pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in group
            )

        # Groups beyond replicas go, leader first (workers follow their owner).
        for i in groups:
            leader = leader_of(i)
            if i >= replicas and leader is not None:
                self.delete_pod(leader)
        rolled = False
        for i in range(replicas):
            leader = leader_of(i)
            if leader is not None and leader["metadata"].get("deletionTimestamp"):
                continue  # the group is going; created again once the leader is gone
            if leader is not None:
                broken = lwt.get("restartPolicy", "RecreateGroupOnPodRestart") == (
                    "RecreateGroupOnPodRestart"
                ) and any(
                    p["metadata"].get("deletionTimestamp")
                    or (p.get("status") or {}).get("phase") == "Failed"
                    for p in members(i)
                )
                outdated = leader["metadata"]["labels"].get(REVISION) != revision
                others_ready = all(group_ready(k) for k in range(replicas) if k != i)
                if broken or (outdated and not rolled and others_ready):
                    rolled = rolled or outdated
                    self.delete_pod(leader)
                    continue
                if outdated:
                    continue
            else:
                leader = self._create(lws, i, 0, revision)
            if spec.get("startupPolicy") == "LeaderReady" and not pod_ready(leader):
                continue
            have = {p["metadata"]["name"] for p in groups.get(i, [])}
            for j in range(1, size):
                if f"{name}-{i}-{j}" not in have:
                    self._create(lws, i, j, revision, leader)
        self._status(lws, replicas, size, revision)
        return None

    def _service(self, lws: dict) -> None:
        meta = lws["metadata"]
        if self.get(SERVICES, meta["namespace"], meta["name"]) is not None:
            return
        self.store.create(
            self.kind(SERVICES),
            meta["namespace"],
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "ownerReferences": [owner_reference(lws)],
                },
                "spec": {
                    "clusterIP": "None",
                    "selector": {NAME: meta["name"]},
                    "publishNotReadyAddresses": True,
                },
            },
        )

    def _create(
        self, lws: dict, group: int, worker: int, revision: str, leader: dict | None = None
    ) -> dict:
        meta = lws["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        lwt = (lws.get("spec") or {}).get("leaderWorkerTemplate") or {}
        size = lwt.get("size", 1)
        worker_template = lwt.get("workerTemplate") or {}
        template = worker_template if worker else lwt.get("leaderTemplate") or worker_template
        env = [
            {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-{group}.{name}.{namespace}"},
            {"name": "LWS_GROUP_SIZE", "value": str(size)},
            {"name": "LWS_WORKER_INDEX", "value": str(worker)},
        ]
        pod_name = f"{name}-{group}" if worker == 0 else f"{name}-{group}-{worker}"
        group_key = hashlib.sha1(f"{namespace}/{name}-{group}".encode()).hexdigest()
        annotations = {SIZE: str(size)}
        if worker:
            annotations[LEADER_NAME] = f"{name}-{group}"
        pod = pod_from_template(
            _with_env(template, env),
            leader if leader is not None else lws,
            namespace,
            name=pod_name,
            extra_labels={
                NAME: name,
                GROUP_INDEX: str(group),
                WORKER_INDEX: str(worker),
                GROUP_KEY: group_key,
                REVISION: revision,
            },
            extra_annotations=annotations,
        )
        pod["spec"]["hostname"] = pod_name
        pod["spec"]["subdomain"] = name
        return self.store.create(self.kind(PODS), namespace, pod)

    def _status(self, lws: dict, replicas: int, size: int, revision: str) -> None:
        name = lws["metadata"]["name"]
        pods = self.list(PODS, lws["metadata"]["namespace"], f"{NAME}={name}")
        leaders = [p for p in pods if p["metadata"]["labels"].get(WORKER_INDEX) == "0"]
        ready = 0
        for leader in leaders:
            uid = leader["metadata"]["uid"]
            group = [leader] + [
                p for p in pods if (ref := controller_ref(p)) is not None and ref["uid"] == uid
            ]
            ready += len(group) == size and all(
                pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in group
            )
        updated = sum(1 for p in leaders if p["metadata"]["labels"].get(REVISION) == revision)
        old = lws.get("status") or {}
        conditions = list(old.get("conditions") or [])
        if ready >= replicas:
            conditions = set_condition(
                conditions, "Available", "True", "AllGroupsReady", "All replicas are ready"
            )
            conditions = set_condition(
                conditions, "Progressing", "False", "GroupsReady", "All groups are ready"
            )
        else:
            conditions = set_condition(
                conditions, "Available", "False", "AllGroupsReady", "Not all replicas are ready"
            )
            conditions = set_condition(
                conditions, "Progressing", "True", "GroupsProgressing", "Replicas are progressing"
            )
        status = {
            "replicas": len(leaders),
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "hpaPodSelector": f"{NAME}={name},{WORKER_INDEX}=0",
            "conditions": conditions,
        }
        self.write_status(LEADERWORKERSETS, lws, status)
