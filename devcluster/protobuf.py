"""Kubernetes protobuf request bodies, decoded for the few kinds kubectl sends that way.

kubectl's typed generators (`kubectl create namespace|configmap|secret|
serviceaccount`) send `application/vnd.kubernetes.protobuf`: the magic
`k8s\\x00`, then a `runtime.Unknown` (typeMeta = 1, raw = 2) whose `raw` is
the object's own message. Only these kinds are decoded, each field by its
number in k8s.io/api's generated.proto; every other kind keeps needing JSON
(`kubectl create -f`). Empty strings and zeros are what Go's encoder writes
for unset fields, so they are dropped as JSON's `omitempty` would.
"""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"

# field number → (JSON name, type); a dict type is a nested message.
Schema = dict[int, tuple[str, Any]]

OBJECT_META: Schema = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    11: ("labels", "map"),
    12: ("annotations", "map"),
    14: ("finalizers", "strings"),
}

KINDS: dict[tuple[str, str], Schema] = {
    ("v1", "Namespace"): {
        1: ("metadata", OBJECT_META),
        2: ("spec", {1: ("finalizers", "strings")}),
    },
    ("v1", "ConfigMap"): {
        1: ("metadata", OBJECT_META),
        2: ("data", "map"),
        3: ("binaryData", "bytesmap"),
        4: ("immutable", "bool"),
    },
    ("v1", "Secret"): {
        1: ("metadata", OBJECT_META),
        2: ("data", "bytesmap"),
        3: ("type", "string"),
        4: ("stringData", "map"),
        5: ("immutable", "bool"),
    },
    ("v1", "ServiceAccount"): {
        1: ("metadata", OBJECT_META),
        4: ("automountServiceAccountToken", "bool"),
    },
}


class ProtobufError(ValueError):
    """A body this server cannot decode (malformed, or a kind it has no schema for)."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of every field in a message: varints as int, the rest as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise ProtobufError("truncated field")
            out.append((number, buf[pos : pos + length]))
            pos += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            out.append((number, buf[pos : pos + size]))
            pos += size
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a length-delimited field")
    return value.decode()


def _message(schema: Schema, buf: bytes) -> dict:
    out: dict[str, Any] = {}
    for number, value in fields(buf):
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, dict):
            nested = _message(kind, value if isinstance(value, bytes) else b"")
            if nested:
                out[name] = nested
        elif kind == "string":
            if text := _text(value):
                out[name] = text
        elif kind == "strings":
            out.setdefault(name, []).append(_text(value))
        elif kind == "bool":
            out[name] = bool(value)
        elif kind in ("map", "bytesmap"):
            entry = dict(fields(value if isinstance(value, bytes) else b""))
            key = _text(entry.get(1, b""))
            raw = entry.get(2, b"")
            if not isinstance(raw, bytes):
                raise ProtobufError("expected a length-delimited map value")
            out.setdefault(name, {})[key] = (
                base64.b64encode(raw).decode() if kind == "bytesmap" else raw.decode()
            )
    return out


def decode(body: bytes) -> dict:
    """A protobuf request body as the JSON object it stands for."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the Kubernetes protobuf magic")
    envelope = dict(fields(body[len(MAGIC) :]))
    type_meta = dict(fields(envelope.get(1, b"") or b""))  # type: ignore[arg-type]
    api_version, kind = _text(type_meta.get(1, b"")), _text(type_meta.get(2, b""))
    schema = KINDS.get((api_version, kind))
    if schema is None:
        known = ", ".join(k for _, k in KINDS)
        raise ProtobufError(
            f"this server decodes protobuf for {known} only, not {api_version} {kind}: "
            f"send JSON (kubectl create -f FILE)"
        )
    raw = envelope.get(2, b"")
    obj = _message(schema, raw if isinstance(raw, bytes) else b"")
    return {"apiVersion": api_version, "kind": kind, **obj}
