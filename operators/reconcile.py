"""Make the cluster match the rendered objects (the I/O around operators/manifests).

Each object the operator owns carries the hash of what it last rendered
(`tandem.dev/rendered-hash`). Desired and current are compared field by
field, the desired object being a subset of the current one (the API server
adds defaults the operator never wrote). When they differ:

* the hash differs too → the spec changed: the object is updated (`Updated`);
* the hash is the same → someone else edited it: it is put back and an Event
  `ForeignEditReverted` says which fields were changed.

Updates are PUTs carrying the resourceVersion read: a concurrent write gets
409 and the object is read and compared again (`Conflict` retries), never
overwritten blind. A desired field that depends on the current object (a
count `kubectl scale` owns) is set by `adjust` from each read, so a write
landing between the read and the PUT is never undone.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client import ApiException

from operators.kube import Kube

log = logging.getLogger(__name__)

RENDERED_HASH = "tandem.dev/rendered-hash"
CONFLICT_RETRIES = 5
# Top-level fields the operator owns besides metadata.
_BODY_FIELDS = ("spec", "data", "roleRef", "subjects")


def rendered_hash(obj: dict[str, Any]) -> str:
    body = {k: obj.get(k) for k in _BODY_FIELDS if k in obj}
    body["labels"] = obj["metadata"].get("labels", {})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def differences(desired: Any, current: Any, where: str = "") -> list[str]:
    """Paths where `desired` is not contained in `current`."""
    if isinstance(desired, dict):
        if not isinstance(current, dict):
            return [where or "<root>"]
        out = []
        for key, value in desired.items():
            out += differences(value, current.get(key), f"{where}.{key}")
        return out
    if isinstance(desired, list):
        if not isinstance(current, list) or len(current) != len(desired):
            return [where]
        out = []
        for i, (d, c) in enumerate(zip(desired, current, strict=True)):
            out += differences(d, c, f"{where}[{i}]")
        return out
    return [] if desired == current else [where]


def owned_differences(desired: dict[str, Any], current: dict[str, Any]) -> list[str]:
    fields = {k: desired[k] for k in _BODY_FIELDS if k in desired}
    meta = desired["metadata"]
    fields["metadata"] = {"labels": meta.get("labels", {})}
    if meta.get("ownerReferences"):
        fields["metadata"]["ownerReferences"] = meta["ownerReferences"]
    return [d.lstrip(".") for d in differences(fields, current)]


@dataclass(frozen=True)
class Applied:
    obj: dict[str, Any]
    action: str  # created | updated | reverted | unchanged
    fields: tuple[str, ...] = ()


def _with_hash(desired: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(desired)
    out["metadata"].setdefault("annotations", {})[RENDERED_HASH] = rendered_hash(desired)
    return out


def merged(desired: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The object to PUT: current metadata (uid, resourceVersion, foreign labels) with
    the operator's labels, annotations, owner references and body fields."""
    out = copy.deepcopy(current)
    meta = out["metadata"]
    meta.setdefault("labels", {}).update(desired["metadata"].get("labels", {}))
    meta.setdefault("annotations", {}).update(desired["metadata"].get("annotations", {}))
    meta["ownerReferences"] = desired["metadata"].get("ownerReferences", [])
    for key in _BODY_FIELDS:
        if key in desired:
            out[key] = copy.deepcopy(desired[key])
        else:
            out.pop(key, None)
    if desired["kind"] == "Service":  # assigned by the API server, immutable
        for key in ("clusterIP", "clusterIPs"):
            if key in current.get("spec", {}) and key not in desired["spec"]:
                out["spec"][key] = current["spec"][key]
    return out


def _get_path(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    if value is None:
        obj.pop(last, None)
    else:
        obj[last] = value


async def apply(
    kube: Kube,
    rendered: dict[str, Any],
    keep: tuple[str, ...] = (),
    adjust: Callable[[dict[str, Any], dict[str, Any] | None], None] | None = None,
) -> Applied:
    """Create or update one object; see the module docstring. Fields at the dotted
    paths in `keep` are someone else's: whatever the object holds there stays.
    `adjust(desired, current)` edits the desired object in place after each read."""
    meta = rendered["metadata"]
    for _ in range(CONFLICT_RETRIES):
        current = await kube.get(
            rendered["apiVersion"], rendered["kind"], meta.get("namespace"), meta["name"]
        )
        desired = copy.deepcopy(rendered)
        if adjust is not None:
            adjust(desired, current)
        for path in keep:
            _set_path(desired, path, None)
        desired = _with_hash(desired)
        for path in keep:
            _set_path(desired, path, _get_path(current or {}, path))
        if current is None:
            try:
                return Applied(await kube.create(desired), "created")
            except ApiException as exc:
                if exc.status == 409:  # created meanwhile: compare with it
                    continue
                raise
        diff = owned_differences(desired, current)
        ours = current["metadata"].get("annotations", {}).get(RENDERED_HASH)
        same_render = ours == desired["metadata"]["annotations"][RENDERED_HASH]
        if not diff and same_render:
            return Applied(current, "unchanged")
        action = "reverted" if same_render else "updated"
        try:
            obj = await kube.replace(merged(desired, current))
        except ApiException as exc:
            if exc.status == 409:
                log.info("conflict writing %s/%s: reading it again", desired["kind"], meta["name"])
                continue
            raise
        return Applied(obj, action, tuple(diff))
    raise RuntimeError(
        f"{rendered['kind']}/{meta['name']}: still conflicting after {CONFLICT_RETRIES} tries"
    )
