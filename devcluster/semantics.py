"""Pure pieces of Kubernetes API semantics the fake API server needs.

Label and field selectors, the three patch types (JSON merge, JSON patch,
strategic merge for the built-in list keys), the JSONPath subset printer
columns and `/scale` paths use, and kubectl's human-readable ages.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
from typing import Any

import jsonpatch

Json = Any


class SelectorError(ValueError):
    pass


# ---- label selectors --------------------------------------------------------

_SET_OP = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(text: str | None):
    """A predicate over a labels dict for a selector such as `a=b,c!=d,e in (x,y),!f`."""
    if not text:
        return lambda labels: True
    checks = []
    for term in _split_selector(text):
        if m := _SET_OP.match(term):
            key, op, raw = m.groups()
            values = {v.strip() for v in raw.split(",") if v.strip()}
            if op == "in":
                checks.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                checks.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            checks.append(lambda lb, k=key, v=value: lb.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            checks.append(lambda lb, k=absent: k not in lb)
        elif re.fullmatch(r"[\w./-]+", term):
            checks.append(lambda lb, k=term: k in lb)
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return lambda labels: all(check(labels or {}) for check in checks)


def selector_string(match_labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


# Every kind selects on these; some kinds on more (kinds.FIELD_SELECTORS).
COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
# A field label that names another path (an Event's `source` is its component).
_FIELD_ALIASES = {"source": "source.component"}


def field_value(obj: Json, label: str) -> str:
    """The value a field selector compares: the field as text, "" when absent."""
    node = obj
    for part in _FIELD_ALIASES.get(label, label).split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def field_matcher(text: str | None, fields: frozenset[str] = COMMON_FIELDS):
    """Field selectors (`a=b`, `a==b`, `a!=b`, comma-joined) on the given field labels."""
    if not text:
        return lambda obj: True
    checks = []
    for term in _split_selector(text):
        negate = "!=" in term
        key, value = (s.strip() for s in re.split(r"!=|==|=", term, maxsplit=1))
        if key not in fields:
            raise SelectorError(f'field label not supported: "{key}"')
        checks.append(lambda o, k=key, v=value, n=negate: (field_value(o, k) == v) != n)
    return lambda obj: all(check(obj) for check in checks)


# ---- patches ----------------------------------------------------------------


def merge_patch(target: Json, patch: Json) -> Json:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class PatchTestFailed(ValueError):
    pass


def json_patch(target: Json, operations: list) -> Json:
    """RFC 6902 JSON patch; a failed `test` op raises PatchTestFailed."""
    try:
        return jsonpatch.apply_patch(target, operations, in_place=False)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchTestFailed(str(exc)) from exc


# The list fields of built-in types that strategic merge patch merges by key;
# every other list is replaced whole, as for JSON merge patch.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "conditions": "type",
    "imagePullSecrets": "name",
    "tolerations": None,
}


def strategic_merge_patch(target: Json, patch: Json) -> Json:
    """Strategic merge patch for the list keys in `_MERGE_KEYS`; `$patch: delete` entries."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and _MERGE_KEYS.get(key) and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, _MERGE_KEYS[key])
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _merge_list(current: list, patch: list, merge_key: str) -> list:
    merged = copy.deepcopy(current)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            merged.append(copy.deepcopy(item))
            continue
        index = next(
            (i for i, old in enumerate(merged) if old.get(merge_key) == item[merge_key]), None
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del merged[index]
        elif index is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[index] = strategic_merge_patch(merged[index], item)
    return merged


# ---- JSONPath (the subset printer columns and /scale paths use) -------------

_TOKEN = re.compile(r"\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w.-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


def jsonpath(obj: Json, path: str) -> list[Json]:
    """Values at `path` (`.a.b`, `.a[0]`, `.a[?(@.k=="v")].b`); [] when absent."""
    current = [obj]
    pos = 0
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {path!r} at {pos}")
        pos = m.end()
        field, index, fkey, fvalue = m.groups()
        nxt: list[Json] = []
        for value in current:
            if field is not None and isinstance(value, dict) and field in value:
                nxt.append(value[field])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                nxt.append(value[int(index)])
            elif fkey is not None and isinstance(value, list):
                for item in value:
                    found = jsonpath(item, "." + fkey)
                    if found and str(found[0]) == fvalue:
                        nxt.append(item)
        current = nxt
    return current


def set_path(obj: dict, path: str, value: Json) -> None:
    """Set a plain dotted path (`.spec.replicas`), creating parents."""
    parts = [p for p in path.split(".") if p]
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


# ---- time -------------------------------------------------------------------


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_plus(timestamp: str, seconds: float) -> str:
    """An RFC 3339 time moved by `seconds`, in the API's form."""
    moved = dt.datetime.fromisoformat(timestamp) + dt.timedelta(seconds=seconds)
    return moved.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def human_age(timestamp: str, now: dt.datetime | None = None) -> str:
    """kubectl's short age: 45s, 3m20s, 2h5m, 3d."""
    then = dt.datetime.fromisoformat(timestamp)  # RFC 3339, with or without fractions
    if then.tzinfo is None:
        then = then.replace(tzinfo=dt.UTC)
    seconds = int(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"
