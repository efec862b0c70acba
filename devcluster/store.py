"""The object store behind the fake API server, with Kubernetes write semantics.

Every write bumps one cluster-wide resourceVersion; an update or patch that
names an older resourceVersion is refused with 409 Conflict; a JSON-patch
`test` op that fails gives 422. `metadata.generation` moves only when
something other than metadata and status changes. With a `/status`
subresource the main endpoint ignores status and `/status` ignores the rest;
`/scale` reads and writes the replica paths. Deletion honours finalizers
(`deletionTimestamp` first, removal once they are gone), graceful deletion
of scheduled pods, propagation policies (Background, Foreground, Orphan), and
owner-reference garbage collection, and namespaces (a deleted one
terminates: its objects are deleted, it goes once empty). Custom resources
are pruned, defaulted and validated against their CRD (schema.py), built-ins
against the real Kubernetes schemas (kubernetes-validate); unknown fields
are refused or pruned as `fieldValidation` says. Creating a CRD serves its
kinds.

Methods are synchronous: on the server's event loop each one is atomic.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import functools
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import kmock
import kubernetes_validate.utils
import referencing

from devcluster import schema as crd_schema
from devcluster import semantics
from devcluster.kinds import BUILTINS, Kind, kinds_from_crd

Json = Any
ObjKey = tuple[tuple[str, str, str], str | None, str]

KUBE_SCHEMA_VERSION = "1.32.0"


class ApiError(kmock.KubernetesError):
    """An API error, rendered as a `kind: Status` body with its HTTP code."""


def _status_details(kind: Kind | None, name: str | None, causes: list[str] | None = None) -> dict:
    details: dict = {"name": name or ""}
    if kind is not None:
        details |= {"group": kind.group, "kind": kind.plural}
    if causes:
        details["causes"] = []
        for cause in causes:
            where, _, what = cause.partition(": ")
            details["causes"].append(
                {"reason": "FieldValueInvalid", "field": where, "message": what or where}
            )
    return details


def not_found(kind: Kind, name: str) -> ApiError:
    gr = f"{kind.plural}.{kind.group}" if kind.group else kind.plural
    return ApiError(404, "NotFound", f'{gr} "{name}" not found', _status_details(kind, name))


def conflict(kind: Kind, name: str, why: str) -> ApiError:
    gr = f"{kind.plural}.{kind.group}" if kind.group else kind.plural
    message = f'Operation cannot be fulfilled on {gr} "{name}": {why}'
    return ApiError(409, "Conflict", message, _status_details(kind, name))


def invalid(kind: Kind, name: str, causes: list[str]) -> ApiError:
    message = f'{kind.kind}.{kind.group or "core"} "{name}" is invalid: ' + "; ".join(causes)
    return ApiError(422, "Invalid", message, _status_details(kind, name, causes))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message, {})


FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
NAMESPACES = ("", "v1", "namespaces")


def unknown_fields(kind: Kind, paths: list[str]) -> ApiError:
    """What kube-apiserver answers to unknown fields under fieldValidation=Strict."""
    found = ", ".join(f'unknown field "{path}"' for path in paths)
    return bad_request(
        f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
        f"strict decoding error: {found}"
    )


STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


@dataclass
class Event:
    rv: int
    type: str
    obj: dict
    old: dict | None = None


@dataclass(eq=False)
class Subscription:
    kind: Kind
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Store:
    """Objects by (kind key, namespace, name), one resourceVersion counter, event logs."""

    def __init__(self, history: int = 1000, validate_builtins: bool = True) -> None:
        self.kinds: dict[tuple[str, str, str], Kind] = {k.key: k for k in BUILTINS}
        self.objects: dict[ObjKey, dict] = {}
        self.rv = 0
        self.history = history
        self.logs: dict[tuple[str, str, str], collections.deque[Event]] = {}
        # The newest resourceVersion dropped from each kind's log: watching from
        # before it answers 410 Gone.
        self.floor: dict[tuple[str, str, str], int] = collections.defaultdict(int)
        self.subscriptions: set[Subscription] = set()
        self.validate_builtins = validate_builtins
        self.on_kinds_changed: Callable[[], None] = lambda: None
        for namespace in ("default", "kube-public", "kube-system"):
            self.create(self.kinds[NAMESPACES], None, {"metadata": {"name": namespace}})

    # ---- kinds ---------------------------------------------------------------

    def kind(self, group: str, version: str, plural: str) -> Kind:
        try:
            return self.kinds[(group, version, plural)]
        except KeyError:
            gv = f"{group}/{version}" if group else version
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({gv} {plural})",
                {},
            ) from None

    def _serve_crd(self, crd: dict) -> None:
        for kind in kinds_from_crd(crd):
            self.kinds[kind.key] = kind
        self.on_kinds_changed()

    def _unserve_crd(self, crd: dict) -> None:
        for kind in kinds_from_crd(crd):
            for key in [k for k in self.objects if k[0] == kind.key]:
                del self.objects[key]
            self.kinds.pop(kind.key, None)
        self.on_kinds_changed()

    # ---- reads ---------------------------------------------------------------

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict:
        obj = self.objects.get((kind.key, namespace if kind.namespaced else None, name))
        if obj is None:
            raise not_found(kind, name)
        return copy.deepcopy(obj)

    def list(
        self,
        kind: Kind,
        namespace: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict]:
        labels_ok, fields_ok = self.matchers(label_selector, field_selector, kind.field_selectors)
        out = []
        for (key, ns, _), obj in sorted(
            self.objects.items(), key=lambda kv: (kv[0][1] or "", kv[0][2])
        ):
            if key != kind.key or (namespace is not None and ns != namespace):
                continue
            if labels_ok(obj["metadata"].get("labels")) and fields_ok(obj):
                out.append(copy.deepcopy(obj))
        return out

    @staticmethod
    def matchers(
        label_selector: str | None,
        field_selector: str | None,
        fields: frozenset[str] = semantics.COMMON_FIELDS,
    ):
        try:
            return (
                semantics.label_matcher(label_selector),
                semantics.field_matcher(field_selector, fields),
            )
        except semantics.SelectorError as exc:
            raise bad_request(str(exc)) from None

    # ---- writes --------------------------------------------------------------

    def create(
        self,
        kind: Kind,
        namespace: str | None,
        body: dict,
        dry_run: bool = False,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
        """Store a new object. Unknown fields are refused under `field_validation`
        "Strict", pruned otherwise (one line each in `warnings` under "Warn")."""
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if kind.namespaced:
            ns = namespace or meta.get("namespace") or "default"
            if meta.get("namespace", ns) != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the "
                    "namespace sent on the request"
                )
            home = self.objects.get((NAMESPACES, None, ns))
            if home is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    {"name": ns, "kind": "namespaces"},
                )
            if home["metadata"].get("deletionTimestamp"):
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{kind.plural} "{meta.get("name") or meta.get("generateName", "")}" is '
                    f"forbidden: unable to create new content in namespace {ns} because it "
                    f"is being terminated",
                    {"name": meta.get("name", ""), "kind": kind.plural},
                )
            meta["namespace"] = ns
        else:
            ns = None
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise invalid(
                    kind, "", [("metadata.name: Required value: name or generateName is required")]
                )
        name = meta["name"]
        key = (kind.key, ns, name)
        if key in self.objects:
            gr = f"{kind.plural}.{kind.group}" if kind.group else kind.plural
            raise ApiError(
                409, "AlreadyExists", f'{gr} "{name}" already exists', _status_details(kind, name)
            )
        body["apiVersion"] = kind.api_version
        body["kind"] = kind.kind
        if kind.status and kind.custom:
            body.pop("status", None)
        for server_field in (
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
            "managedFields",
        ):
            meta.pop(server_field, None)
        body = self._admit(kind, body, None, field_validation, warnings)
        meta = body["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = semantics.now_rfc3339()
        meta["generation"] = 1
        self._defaults_on_create(kind, body)
        if dry_run:
            meta["resourceVersion"] = str(self.rv)
            return body
        self._commit(kind, key, body, "ADDED", None)
        if meta.get("ownerReferences"):
            # Created for an owner that is already gone: the collector deletes it.
            self.collect_garbage()
            if key not in self.objects:
                return copy.deepcopy(body)
        if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._serve_crd(body)
            self._set_crd_established(key)
        return copy.deepcopy(self.objects[key])

    def _set_crd_established(self, key: ObjKey) -> None:
        obj = copy.deepcopy(self.objects[key])
        obj["status"] = {
            "acceptedNames": obj["spec"]["names"],
            "storedVersions": [v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "lastTransitionTime": semantics.now_rfc3339(),
                    "message": m,
                }
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
        }
        self._commit(self.kinds[key[0]], key, obj, "MODIFIED", self.objects[key])

    def _defaults_on_create(self, kind: Kind, body: dict) -> None:
        if kind.key == ("", "v1", "services"):
            spec = body.setdefault("spec", {})
            if spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
                n = self.rv + 1
                spec["clusterIP"] = f"10.96.{(n >> 8) & 255}.{n & 255}"
        if kind.key == ("", "v1", "pods"):
            body.setdefault("status", {}).setdefault("phase", "Pending")
        if kind.key == ("", "v1", "secrets"):
            body.setdefault("type", "Opaque")
        if kind.key == NAMESPACES:
            body.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            body["status"] = {"phase": "Active"}

    def replace(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        body: dict,
        subresource: str | None = None,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
        key = self._key(kind, namespace, name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(kind, name)
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise bad_request("the name of the object does not match the name on the URL")
        rv = meta.get("resourceVersion")
        if not rv and not kind.unconditional_update:
            raise invalid(
                kind,
                name,
                [("metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")],
            )
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(kind, name, STALE)
        return self._update(kind, key, old, body, subresource, field_validation, warnings)

    def patch(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: Json,
        content_type: str,
        subresource: str | None = None,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
        key = self._key(kind, namespace, name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(kind, name)
        base = self.scale_of(kind, old) if subresource == "scale" else old
        content_type = content_type.split(";")[0].strip()
        try:
            if content_type == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise bad_request("a JSON patch must be a list of operations")
                new = semantics.json_patch(base, patch)
            elif content_type == "application/merge-patch+json":
                new = semantics.merge_patch(base, patch)
            elif content_type == "application/strategic-merge-patch+json":
                if kind.custom:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources",
                        {},
                    )
                new = semantics.strategic_merge_patch(base, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted "
                    f"media types include: application/json-patch+json, "
                    f"application/merge-patch+json, "
                    f"application/strategic-merge-patch+json; got {content_type}",
                    {},
                )
        except semantics.PatchTestFailed as exc:
            raise invalid(
                kind,
                name,
                [(f"the server rejected our request due to an error in our request: {exc}")],
            ) from None
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001  (a malformed patch document is the client's)
            raise ApiError(
                422,
                "Invalid",
                f"the patch could not be applied: {exc}",
                _status_details(kind, name),
            ) from None
        if not isinstance(new, dict):
            raise bad_request("the patch did not produce an object")
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(kind, name, STALE)
        if subresource == "scale":
            return self.scale_of(kind, self._write_scale(kind, key, old, new))
        return self._update(kind, key, old, new, subresource, field_validation, warnings)

    def replace_scale(self, kind: Kind, namespace: str | None, name: str, scale: dict) -> dict:
        key = self._key(kind, namespace, name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(kind, name)
        rv = (scale.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(kind, name, STALE)
        return self.scale_of(kind, self._write_scale(kind, key, old, scale))

    def _write_scale(self, kind: Kind, key: ObjKey, old: dict, scale: dict) -> dict:
        assert kind.scale is not None
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(
                kind,
                key[2],
                [
                    (
                        f"spec.replicas: Invalid value: {replicas!r}: must be "
                        f"greater than or equal to 0"
                    )
                ],
            )
        new = copy.deepcopy(old)
        semantics.set_path(new, kind.scale.spec_replicas, replicas)
        return self._update(kind, key, old, new, None)

    def scale_of(self, kind: Kind, obj: dict) -> dict:
        if kind.scale is None:
            raise not_found(kind, obj["metadata"]["name"] + "/scale")
        paths = kind.scale
        spec = semantics.jsonpath(obj, paths.spec_replicas)
        status = semantics.jsonpath(obj, paths.status_replicas)
        selector = ""
        if paths.label_selector:
            found = semantics.jsonpath(obj, paths.label_selector)
            selector = found[0] if found else ""
        elif paths.match_labels:
            found = semantics.jsonpath(obj, paths.match_labels)
            if found:
                selector = semantics.selector_string(found[0].get("matchLabels", {}))
        meta = obj["metadata"]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": spec[0] if spec else 0},
            "status": {"replicas": status[0] if status else 0, "selector": selector},
        }

    def _update(
        self,
        kind: Kind,
        key: ObjKey,
        old: dict,
        new: dict,
        subresource: str | None,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
        new = copy.deepcopy(new)
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
            new = merged
        elif subresource is not None:
            raise not_found(kind, f"{key[2]}/{subresource}")
        else:
            meta = new.setdefault("metadata", {})
            for server_field in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "namespace",
                "name",
            ):
                if server_field in old["metadata"]:
                    meta[server_field] = old["metadata"][server_field]
                else:
                    meta.pop(server_field, None)
            if kind.status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            if old["metadata"].get("deletionTimestamp"):
                added = set(meta.get("finalizers", [])) - set(old["metadata"].get("finalizers", []))
                if added:
                    raise invalid(
                        kind,
                        key[2],
                        [
                            (
                                "metadata.finalizers: Forbidden: no new "
                                "finalizers can be added if the object is being "
                                "deleted"
                            )
                        ],
                    )
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = self._admit(kind, new, old, field_validation, warnings)
        if _spec_changed(old, new):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new == old:
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no event
        if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._serve_crd(new)
        self._commit(kind, key, new, "MODIFIED", old)
        if kind.key == NAMESPACES:
            self._finish_namespace(key[2])
        elif new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(kind, key)
            self.collect_garbage()
        return copy.deepcopy(new)

    def delete(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        options: dict | None = None,
    ) -> dict:
        """Delete as kube-apiserver does (finalizers, propagation, namespaces).

        A pod bound to a node (`spec.nodeName`) is deleted gracefully: the
        first DELETE sets `deletionGracePeriodSeconds` (`gracePeriodSeconds`
        if given, else the pod's `terminationGracePeriodSeconds`, else 30) and
        `deletionTimestamp` to now plus that (when it should be gone), and
        leaves the object; a later DELETE may shorten the grace period (both
        fields move), never lengthen it. The kubelet's side of the contract:
        seeing `deletionTimestamp`, it runs `preStop`, sends SIGTERM, SIGKILL
        once `deletionGracePeriodSeconds` have passed since it saw the
        deletion (as the real kubelet counts, on its own clock), and when the
        pod's processes are gone removes the object with a DELETE of
        `gracePeriodSeconds=0`. `gracePeriodSeconds=0` from anyone
        (`kubectl delete --force --grace-period=0`) and pods not bound to a
        node are removed at once.
        """
        options = options or {}
        key = self._key(kind, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise not_found(kind, name)
        pre = options.get("preconditions") or {}
        current = obj["metadata"]["resourceVersion"]
        if pre.get("resourceVersion") and pre["resourceVersion"] != current:
            raise conflict(kind, name, "Precondition failed: resourceVersion")
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            raise conflict(kind, name, "Precondition failed: UID")
        if kind.key == NAMESPACES:
            return self._delete_namespace(obj)
        policy = options.get("propagationPolicy") or "Background"
        if options.get("orphanDependents"):
            policy = "Orphan"
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers", []))
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        grace = options.get("gracePeriodSeconds")
        graceful_pod = (
            kind.key == ("", "v1", "pods")
            and obj.get("spec", {}).get("nodeName")
            and (grace is None or grace > 0)
        )
        if meta.get("deletionTimestamp"):
            current_grace = meta.get("deletionGracePeriodSeconds", 0)
            if graceful_pod and grace is not None and grace < current_grace:
                shorter = copy.deepcopy(obj)
                shorter["metadata"]["deletionTimestamp"] = semantics.rfc3339_plus(
                    meta["deletionTimestamp"], grace - current_grace
                )
                shorter["metadata"]["deletionGracePeriodSeconds"] = grace
                self._commit(kind, key, shorter, "MODIFIED", obj)
                return copy.deepcopy(shorter)
            if graceful_pod or finalizers:
                return copy.deepcopy(obj)
            self._remove(kind, key)
            self.collect_garbage()
            return copy.deepcopy(obj)
        if finalizers or graceful_pod:
            new = copy.deepcopy(obj)
            new["metadata"]["finalizers"] = finalizers
            if not new["metadata"]["finalizers"]:
                new["metadata"].pop("finalizers")
            new["metadata"]["deletionTimestamp"] = semantics.now_rfc3339()
            if graceful_pod:
                default_grace = obj["spec"].get("terminationGracePeriodSeconds", 30)
                period = default_grace if grace is None else grace
                new["metadata"]["deletionGracePeriodSeconds"] = period
                # As kube-apiserver: the time by which the pod is to be gone.
                new["metadata"]["deletionTimestamp"] = semantics.rfc3339_plus(
                    new["metadata"]["deletionTimestamp"], period
                )
            else:
                new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._commit(kind, key, new, "MODIFIED", obj)
            self.collect_garbage()
            return copy.deepcopy(new)
        removed = self._remove(kind, key)
        self.collect_garbage()
        return removed

    def _delete_namespace(self, obj: dict) -> dict:
        """As the namespace controller does: Terminating, every object in it
        deleted (finalizers and graceful pods still hold theirs), then gone
        once empty."""
        name = obj["metadata"]["name"]
        if name in ("default", "kube-public", "kube-system"):
            raise ApiError(
                403,
                "Forbidden",
                f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                {"name": name, "kind": "namespaces"},
            )
        key = (NAMESPACES, None, name)
        terminating = obj
        if not obj["metadata"].get("deletionTimestamp"):
            terminating = copy.deepcopy(obj)
            terminating["metadata"]["deletionTimestamp"] = semantics.now_rfc3339()
            terminating["metadata"]["deletionGracePeriodSeconds"] = 0
            terminating["status"] = {"phase": "Terminating"}
            self._commit(self.kinds[NAMESPACES], key, terminating, "MODIFIED", obj)
            terminating = copy.deepcopy(terminating)
        for obj_key in list(self.objects):
            if obj_key[1] != name or obj_key not in self.objects:
                continue
            if not self.objects[obj_key]["metadata"].get("deletionTimestamp"):
                self.delete(self.kinds[obj_key[0]], name, obj_key[2])
        self._finish_namespace(name)
        self.collect_garbage()
        # As kube-apiserver answers: the namespace as it began terminating.
        return terminating

    def _finish_namespace(self, name: str) -> None:
        key = (NAMESPACES, None, name)
        ns = self.objects.get(key)
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if ns["metadata"].get("finalizers") or any(k[1] == name for k in self.objects):
            return
        self._remove(self.kinds[NAMESPACES], key)

    def delete_collection(
        self,
        kind: Kind,
        namespace: str | None,
        label_selector: str | None,
        field_selector: str | None,
        options: dict | None = None,
    ) -> list[dict]:
        out = []
        for obj in self.list(kind, namespace, label_selector, field_selector):
            meta = obj["metadata"]
            out.append(self.delete(kind, meta.get("namespace"), meta["name"], options))
        return out

    def _remove(self, kind: Kind, key: ObjKey) -> dict:
        obj = self.objects.pop(key)
        self.rv += 1
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._publish(kind, Event(self.rv, "DELETED", gone, obj))
        if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._unserve_crd(obj)
        if key[1] is not None:
            self._finish_namespace(key[1])
        return copy.deepcopy(gone)

    # ---- garbage collection --------------------------------------------------

    def collect_garbage(self) -> None:
        """Run the garbage collector's rules to a fixed point.

        A dependent whose owners (by uid) are all gone is deleted (background);
        an owner deleting with `orphan` first drops its dependents' references to
        it; one deleting with `foregroundDeletion` waits for its dependents.
        """
        changed = True
        while changed:
            changed = False
            live = {obj["metadata"]["uid"]: key for key, obj in self.objects.items()}
            deleting = {
                obj["metadata"]["uid"]: obj
                for obj in self.objects.values()
                if obj["metadata"].get("deletionTimestamp")
            }
            for key, obj in list(self.objects.items()):
                if key not in self.objects:
                    continue
                meta = obj["metadata"]
                kind = self.kinds[key[0]]
                owners = meta.get("ownerReferences") or []
                orphaning = [
                    o
                    for o in owners
                    if "orphan"
                    in deleting.get(o["uid"], {}).get("metadata", {}).get("finalizers", [])
                ]
                if orphaning:
                    new = copy.deepcopy(obj)
                    new["metadata"]["ownerReferences"] = [o for o in owners if o not in orphaning]
                    if not new["metadata"]["ownerReferences"]:
                        new["metadata"].pop("ownerReferences")
                    self._commit(kind, key, new, "MODIFIED", obj)
                    changed = True
                    continue
                if (
                    owners
                    and all(
                        o["uid"] not in live or _deleting_foreground(deleting.get(o["uid"]))
                        for o in owners
                    )
                    and not meta.get("deletionTimestamp")
                ):
                    self.delete(kind, key[1], key[2], {"propagationPolicy": "Background"})
                    changed = True
                    continue
                fins = meta.get("finalizers", [])
                uid = meta["uid"]
                if meta.get("deletionTimestamp") and (
                    "orphan" in fins or "foregroundDeletion" in fins
                ):
                    dependents = [
                        o
                        for o in self.objects.values()
                        if any(r["uid"] == uid for r in o["metadata"].get("ownerReferences", []))
                    ]
                    if not dependents:
                        new = copy.deepcopy(obj)
                        rest = [f for f in fins if f not in ("orphan", "foregroundDeletion")]
                        if rest:
                            new["metadata"]["finalizers"] = rest
                        else:
                            new["metadata"].pop("finalizers")
                        self._commit(kind, key, new, "MODIFIED", obj)
                        if not rest:
                            self._remove(kind, key)
                        changed = True

    # ---- internals -----------------------------------------------------------

    def _key(self, kind: Kind, namespace: str | None, name: str) -> ObjKey:
        return (kind.key, namespace if kind.namespaced else None, name)

    def _admit(
        self,
        kind: Kind,
        body: dict,
        old: dict | None,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
        name = body.get("metadata", {}).get("name", "")
        if kind.custom and kind.schema:
            admitted, dropped, errors = crd_schema.admit(kind.schema, body, old)
            # Strict decoding comes before validation, as in kube-apiserver.
            if dropped and field_validation == "Strict":
                raise unknown_fields(kind, dropped)
            if errors:
                raise invalid(kind, name, errors)
            if field_validation == "Warn" and warnings is not None:
                warnings.extend(f'unknown field "{path}"' for path in dropped)
            return admitted
        if self.validate_builtins and not kind.custom:
            probe = copy.deepcopy(body)
            for server_field in (
                "resourceVersion",
                "uid",
                "creationTimestamp",
                "generation",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ):
                probe.get("metadata", {}).pop(server_field, None)
            try:
                _builtin_validator(probe["apiVersion"], probe["kind"]).validate(probe)
            except jsonschema.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path) or "<root>"
                if exc.validator == "additionalProperties" and field_validation == "Strict":
                    known = (exc.schema or {}).get("properties", {})
                    prefix = f"{path}." if exc.path else ""
                    extra = [f"{prefix}{k}" for k in exc.instance or {} if k not in known]
                    raise unknown_fields(kind, extra) from None
                raise invalid(kind, name, [f"{path}: {exc.message}"]) from None
        return body

    def _commit(self, kind: Kind, key: ObjKey, obj: dict, event: str, old: dict | None) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self._publish(kind, Event(self.rv, event, copy.deepcopy(obj), old))

    def _publish(self, kind: Kind, event: Event) -> None:
        log = self.logs.setdefault(kind.key, collections.deque())
        log.append(event)
        while len(log) > self.history:
            self.floor[kind.key] = log.popleft().rv
        for sub in self.subscriptions:
            if sub.kind.key == kind.key:
                sub.queue.put_nowait(event)

    def compact(self) -> None:
        """Forget every kind's event history, as etcd compaction does: older watches get 410."""
        for key, log in self.logs.items():
            if log:
                self.floor[key] = log[-1].rv
            log.clear()
        for key in self.kinds:
            self.floor[key] = self.rv

    def events_since(self, kind: Kind, rv: int) -> Iterable[Event]:
        """Logged events after `rv`; ApiError 410 when they are no longer all known."""
        if rv < self.floor[kind.key]:
            raise ApiError(
                410, "Expired", f"too old resource version: {rv} ({self.floor[kind.key] + 1})", {}
            )
        return [e for e in self.logs.get(kind.key, ()) if e.rv > rv]


@functools.cache
def _builtin_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict check of one built-in kind, built once:
    its own `validate` reads the schema files again on every call (50 ms)."""
    utils = kubernetes_validate.utils
    wanted = utils.major_minor(KUBE_SCHEMA_VERSION)
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= wanted][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    # rbac.authorization.k8s.io/v1 -> rbac-v1, as kubernetes-validate names its files.
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = utils.schema_contents(
        f"{folder}/{kind.lower()}-{group_version}.json", KUBE_SCHEMA_VERSION
    )
    definitions = utils.schema_contents(f"{folder}/_definitions.json", KUBE_SCHEMA_VERSION)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _spec_changed(old: dict, new: dict) -> bool:
    def body(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    return body(old) != body(new)


def _deleting_foreground(owner: dict | None) -> bool:
    return bool(owner and "foregroundDeletion" in owner["metadata"].get("finalizers", []))
