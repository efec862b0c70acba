"""What the API server does with a custom resource's body before storing it.

Applied in the order kube-apiserver applies them to a CRD's structural schema
(`openAPIV3Schema`): prune unknown fields, fill defaults, validate the OpenAPI
constraints, then evaluate every `x-kubernetes-validations` CEL rule with a real
CEL interpreter (`cel-python`). Transition rules (those naming `oldSelf`) run
only on updates, where the old value exists, as in Kubernetes.

Also used by tests to check rendered manifests against a CRD (for example the
operator's LeaderWorkerSets against LWS's own CRD).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import celpy
import jsonschema

Json = Any


def prune(schema: dict, value: Json) -> list[str]:
    """Drop fields the schema does not declare (in place); returns their paths."""
    dropped: list[str] = []
    _prune(schema, value, "", dropped)
    return dropped


def _prune(schema: dict, value: Json, path: str, dropped: list[str]) -> None:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties", {})
        if isinstance(value, dict):
            for key in props:
                if key in value:
                    _prune(props[key], value[key], f"{path}.{key}", dropped)
        return
    if isinstance(value, dict):
        if "properties" in schema:
            props = schema["properties"]
            for key in list(value):
                if key not in props:
                    del value[key]
                    dropped.append(f"{path}.{key}".lstrip("."))
                else:
                    _prune(props[key], value[key], f"{path}.{key}", dropped)
        elif isinstance(schema.get("additionalProperties"), dict):
            for key in value:
                _prune(schema["additionalProperties"], value[key], f"{path}.{key}", dropped)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _prune(schema["items"], item, f"{path}[{i}]", dropped)


def apply_defaults(schema: dict, value: Json) -> None:
    """Fill `default`s of absent properties (in place), recursively, as the API server does."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


def _to_json_schema(schema: Json) -> Json:
    """OpenAPI v3.0 structural schema → JSON Schema (nullable, int-or-string, no x- keys)."""
    if isinstance(schema, list):
        return [_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, sub in schema.items():
        if key.startswith("x-kubernetes-") or key in ("default", "description", "example"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: _to_json_schema(s) for name, s in sub.items()}
        elif key in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[key] = _to_json_schema(sub)
        elif key != "nullable":
            out[key] = sub
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@lru_cache(maxsize=64)
def _validator(frozen: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_to_json_schema(json.loads(frozen)))


def openapi_errors(schema: dict, value: Json) -> list[str]:
    """Every OpenAPI constraint `value` breaks, as `path: message` lines."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        path = _dotted(error.absolute_path)
        errors.append(f"{path}: Invalid value: {_short(error.instance)}: {error.message}")
    return errors


def _dotted(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "<root>"


def _short(value: Json) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return repr(value)


def _rules(
    schema: dict, value: Json, old: Json, path: str
) -> Iterator[tuple[str, dict, Json, Json]]:
    """(path, rule, value, old value) for every CEL rule that applies to `value`."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value, old
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                old_sub = old.get(key) if isinstance(old, dict) else None
                yield from _rules(sub, value[key], old_sub, f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                old_sub = old.get(key) if isinstance(old, dict) else None
                yield from _rules(extra, item, old_sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, None, f"{path}[{i}]")


_ENV = celpy.Environment()


@lru_cache(maxsize=256)
def _program(rule: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(rule))


def cel_errors(schema: dict, value: Json, old: Json = None) -> list[str]:
    """Every `x-kubernetes-validations` rule `value` breaks (with `oldSelf` on updates)."""
    errors = []
    for path, rule, node, old_node in _rules(schema, value, old, ""):
        expr = rule["rule"]
        transition = re.search(r"\boldSelf\b", expr) is not None
        if transition and old_node is None:
            continue
        activation = {"self": celpy.json_to_cel(node)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old_node)
        where = path.lstrip(".") or "<root>"
        try:
            ok = _program(expr).evaluate(activation)
        except celpy.CELEvalError as exc:
            errors.append(f"{where}: Invalid value: rule {expr!r} could not be evaluated: {exc}")
            continue
        if isinstance(ok, celpy.CELEvalError):
            errors.append(f"{where}: Invalid value: rule {expr!r} could not be evaluated: {ok}")
        elif not bool(ok):
            message = rule.get("message") or f"failed rule: {expr}"
            errors.append(f"{where}: Invalid value: {_short(node)}: {message}")
    return errors


def admit(schema: dict, body: dict, old: dict | None = None) -> tuple[dict, list[str], list[str]]:
    """Prune, default and validate a custom resource: (stored body, pruned paths, errors)."""
    body = copy.deepcopy(body)
    # The API server keeps the envelope whatever the schema says about it.
    envelope = {key: body.pop(key) for key in ("apiVersion", "kind", "metadata") if key in body}
    old_rest = {k: v for k, v in (old or {}).items() if k not in envelope}
    dropped = prune(schema, body)
    apply_defaults(schema, body)
    errors = openapi_errors(schema, body)
    if not errors:
        errors = cel_errors(schema, body, old_rest if old is not None else None)
    return {**envelope, **body}, dropped, errors
