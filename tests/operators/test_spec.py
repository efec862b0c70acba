"""The typed spec (operators/spec.py) and the CRDs cannot drift: every
property of each CRD's spec has a dataclass field and every field a
property, by name, at every level; parsing fills the CRD's defaults."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from operators.spec import (
    EnginePoolSpec,
    TandemSpec,
    crd_key,
    crd_schema,
    nested_dataclass,
    parse,
    parse_pool,
)


def mismatches(cls: type[Any], schema: dict[str, Any], where: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    fields = {crd_key(f): f for f in dataclasses.fields(cls)}
    props = schema.get("properties", {})
    out = [f"{where}.{k}: a CRD property without a field" for k in props if k not in fields]
    out += [f"{where}.{k}: a field without a CRD property" for k in fields if k not in props]
    for key, f in fields.items():
        nested, _ = nested_dataclass(hints[f.name])
        sub = props.get(key, {})
        if nested is not None:
            out += mismatches(nested, sub, f"{where}.{key}")
        elif key in props and "properties" in sub:
            out.append(f"{where}.{key}: an object of the CRD held as a plain value")
    return out


@pytest.mark.parametrize(
    "cls,plural", [(TandemSpec, "tandemdeployments"), (EnginePoolSpec, "enginepools")]
)
def test_the_dataclasses_hold_every_crd_property_and_no_other(cls, plural):
    assert mismatches(cls, crd_schema(plural)["properties"]["spec"], "spec") == []


def test_the_check_sees_a_property_the_dataclasses_lack():
    schema = crd_schema("tandemdeployments")["properties"]["spec"]
    router = schema["properties"]["router"]
    grown = {
        **schema,
        "properties": {
            **schema["properties"],
            "router": {
                **router,
                "properties": {**router["properties"], "newKnob": {"type": "string"}},
            },
        },
    }
    assert mismatches(TandemSpec, grown, "spec") == [
        "spec.router.newKnob: a CRD property without a field"
    ]


def test_parsing_fills_the_crds_defaults_and_leaves_absent_pools_out():
    spec = parse({"model": {"path": "/m"}, "decode": {"replicas": 3}})
    assert spec.roles == ["decode"] and spec.prefill is None
    assert spec.pool("decode").replicas == 3 and spec.pool("decode").max_replicas == 16
    assert spec.pool("decode").parallelism.tensor == 1
    assert spec.router.replicas == 2 and spec.router.ingress.enabled is False
    assert spec.router.api_key_secret_ref is None and spec.model.volume is None
    assert spec.kv_store.disk.size == "0GB" and spec.scaling.mode == "Off"
    assert spec.scaling.capacity is None and spec.scaling.slo.ttft_p90_ms is None
    assert dataclasses.is_dataclass(spec) and spec.pool("decode").engine_args is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.router.replicas = 3  # type: ignore[misc]
    capacity = parse(
        {
            "model": {"path": "/m"},
            "scaling": {"capacity": {"layers": 2, "kvKind": "mla", "kvBytes": 1, "gpuFreeGiB": 15}},
        }
    ).scaling.capacity
    assert capacity is not None and capacity.gpu_free_gib == 15
    assert capacity.compute_bytes == 2 and capacity.host_pool_gib == 0
    assert parse_pool({"deployment": "d", "role": "decode", "replicas": 2}).max_replicas == 16
