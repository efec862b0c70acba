"""What every controller shares: the work queue contract and Kubernetes helpers.

A controller names the kinds it watches and, for each watch event, the keys
(namespace, name) of its own objects to reconcile; `reconcile` reads the
store and writes through it, level-based, and returns a delay when it wants
to look again (minReadySeconds, a progress deadline) or None. The runner
(runner.py) calls it on the API server's loop, so a reconcile is atomic: it
reads and writes with no other write in between.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from devcluster import semantics
from devcluster.kinds import Kind
from devcluster.store import ApiError, Event, Store

Json = Any
KindKey = tuple[str, str, str]
ObjRef = tuple[str, str]  # (namespace, name)

PODS: KindKey = ("", "v1", "pods")
SERVICES: KindKey = ("", "v1", "services")
NODES: KindKey = ("", "v1", "nodes")
EVENTS: KindKey = ("", "v1", "events")
DEPLOYMENTS: KindKey = ("apps", "v1", "deployments")
REPLICASETS: KindKey = ("apps", "v1", "replicasets")
DAEMONSETS: KindKey = ("apps", "v1", "daemonsets")
ENDPOINTSLICES: KindKey = ("discovery.k8s.io", "v1", "endpointslices")
LEADERWORKERSETS: KindKey = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
JOBS: KindKey = ("batch", "v1", "jobs")

# The one node every pod is bound to (node.py creates it).
NODE_NAME = "devcluster-node"


class Controller:
    """One controller: `watches` maps each watched kind to the keys it wakes."""

    name = "controller"
    primary: KindKey = PODS
    watches: tuple[KindKey, ...] = ()

    def __init__(self, store: Store) -> None:
        self.store = store

    def keys_for(self, kind: KindKey, event: Event) -> Iterable[ObjRef]:
        """The primary objects to reconcile after `event` on `kind`."""
        if kind == self.primary:
            meta = event.obj["metadata"]
            return [(meta.get("namespace", ""), meta["name"])]
        return []

    def reconcile(self, namespace: str, name: str) -> float | None:
        raise NotImplementedError

    # ---- store access ----------------------------------------------------------

    def kind(self, key: KindKey) -> Kind:
        return self.store.kinds[key]

    def served(self, key: KindKey) -> bool:
        return key in self.store.kinds

    def get(self, key: KindKey, namespace: str, name: str) -> dict | None:
        try:
            return self.store.get(self.kind(key), namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, key: KindKey, namespace: str | None, selector: str | None = None) -> list[dict]:
        return self.store.list(self.kind(key), namespace, selector)

    def write_status(self, key: KindKey, obj: dict, status: dict) -> dict:
        """Replace `obj`'s status (a no-op write when nothing changed)."""
        if obj.get("status") == status:
            return obj
        new = {**obj, "status": status}
        meta = obj["metadata"]
        return self.store.replace(
            self.kind(key), meta.get("namespace"), meta["name"], new, subresource="status"
        )

    def patch(self, key: KindKey, obj: dict, patch: dict) -> dict:
        meta = obj["metadata"]
        return self.store.patch(
            self.kind(key),
            meta.get("namespace"),
            meta["name"],
            patch,
            "application/merge-patch+json",
        )

    def delete_pod(self, pod: dict) -> None:
        """As a controller deletes: gracefully (the pod's own grace period)."""
        meta = pod["metadata"]
        try:
            self.store.delete(self.kind(PODS), meta["namespace"], meta["name"])
        except ApiError as exc:
            if exc.status != 404:
                raise

    def owned(self, key: KindKey, owner: dict, selector: str | None = None) -> list[dict]:
        """Objects of `key` in the owner's namespace whose controller is `owner`."""
        uid = owner["metadata"]["uid"]
        return [
            o
            for o in self.list(key, owner["metadata"]["namespace"], selector)
            if (ref := controller_ref(o)) is not None and ref["uid"] == uid
        ]

    def record_event(self, obj: dict, reason: str, message: str, kind: str = "Normal") -> None:
        """A core/v1 Event on `obj`, as controllers post them (`kubectl describe`)."""
        meta = obj["metadata"]
        now = semantics.now_rfc3339()
        self.store.create(
            self.kind(EVENTS),
            meta["namespace"],
            {
                "metadata": {"generateName": f"{meta['name']}."},
                "involvedObject": {
                    "apiVersion": obj["apiVersion"],
                    "kind": obj["kind"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                    "resourceVersion": meta.get("resourceVersion", ""),
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": f"{self.name}-controller"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "reportingComponent": f"{self.name}-controller",
            },
        )


# ---- object helpers ------------------------------------------------------------


def controller_ref(obj: dict) -> dict | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def owner_reference(owner: dict) -> dict:
    """The controller reference a controller puts on what it creates."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owner_keys(event: Event, kind: str) -> list[ObjRef]:
    """The controller owner of `kind` of the event's object, before and after."""
    out = []
    for obj in (event.obj, event.old):
        if obj is None:
            continue
        ref = controller_ref(obj)
        if ref is not None and ref["kind"] == kind:
            out.append((obj["metadata"].get("namespace", ""), ref["name"]))
    return out


def selector_of(label_selector: dict | None) -> str:
    """A LabelSelector object (matchLabels, matchExpressions) as selector text."""
    label_selector = label_selector or {}
    terms = [f"{k}={v}" for k, v in sorted((label_selector.get("matchLabels") or {}).items())]
    for expr in label_selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op in ("In", "NotIn"):
            terms.append(f"{key} {op.lower()} ({','.join(values)})")
        elif op == "Exists":
            terms.append(key)
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)


def condition(obj: dict, type_: str) -> dict | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def pod_ready(pod: dict) -> bool:
    cond = condition(pod, "Ready")
    return cond is not None and cond.get("status") == "True"


def pod_active(pod: dict) -> bool:
    """Counted by its controller: not terminating, not finished."""
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


def parse_time(text: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(text) if text else None


def available_in(pod: dict, min_ready_seconds: int, now: dt.datetime) -> float | None:
    """0 when the pod is available (Ready for minReadySeconds), the seconds
    until it will be when Ready but not yet long enough, None when not Ready."""
    if not pod_ready(pod):
        return None
    if min_ready_seconds <= 0:
        return 0.0
    cond = condition(pod, "Ready") or {}
    since = parse_time(cond.get("lastTransitionTime"))
    if since is None:
        return 0.0
    left = min_ready_seconds - (now - since).total_seconds()
    return max(0.0, left)


def set_condition(
    conditions: list[dict],
    type_: str,
    status: str,
    reason: str,
    message: str,
    update_time: bool = False,
) -> list[dict]:
    """`conditions` with `type_` set; lastTransitionTime moves only with the status,
    lastUpdateTime (Deployments) only when anything changes."""
    now = semantics.now_rfc3339()
    old = next((c for c in conditions if c.get("type") == type_), None)
    new = {"type": type_, "status": status, "reason": reason, "message": message}
    if old is not None and all(old.get(k) == v for k, v in new.items()):
        return [dict(c) for c in conditions]
    same_status = old is not None and old.get("status") == status
    if update_time:
        new["lastUpdateTime"] = now
    new["lastTransitionTime"] = old.get("lastTransitionTime", now) if same_status else now
    if old is None:
        return [*(dict(c) for c in conditions), new]
    return [new if c is old else dict(c) for c in conditions]


# Kubernetes' rand.SafeEncodeString alphabet: no vowels, no 0/1/3 (no words, no look-alikes).
_SAFE = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: Json, collision_count: int = 0) -> str:
    """A pod template's hash as the `pod-template-hash` label: stable over the
    template's content, in Kubernetes' safe alphabet."""
    text = json.dumps(template, sort_keys=True, separators=(",", ":")) + f"/{collision_count}"
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    out = []
    while value:
        value, digit = divmod(value, len(_SAFE))
        out.append(_SAFE[digit])
    return "".join(out) or _SAFE[0]


def int_or_percent(value: int | str | None, total: int, default: str, round_up: bool) -> int:
    """maxSurge / maxUnavailable: an int, or a percentage of `total`."""
    if value is None:
        value = default
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if not text.endswith("%"):
        return int(text)
    share = int(text[:-1]) * total
    return -(-share // 100) if round_up else share // 100


def pod_from_template(
    template: dict,
    owner: dict,
    namespace: str,
    name: str | None = None,
    generate_name: str | None = None,
    extra_labels: dict[str, str] | None = None,
    extra_annotations: dict[str, str] | None = None,
) -> dict:
    """A pod as a controller creates it from a template: labels and annotations
    copied, a controller reference to `owner`, bound to the node."""
    tmeta = template.get("metadata") or {}
    meta: dict = {
        "namespace": namespace,
        "labels": {**(tmeta.get("labels") or {}), **(extra_labels or {})},
        "ownerReferences": [owner_reference(owner)],
    }
    annotations = {**(tmeta.get("annotations") or {}), **(extra_annotations or {})}
    if annotations:
        meta["annotations"] = annotations
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = generate_name
    spec = json.loads(json.dumps(template.get("spec") or {}))
    # The scheduler's part, done at creation: there is one node.
    spec["nodeName"] = NODE_NAME
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": spec,
        "status": {"phase": "Pending", "conditions": [scheduled_condition()]},
    }


def scheduled_condition() -> dict:
    return {
        "type": "PodScheduled",
        "status": "True",
        "lastTransitionTime": semantics.now_rfc3339(),
    }
