"""values.schema.json is kept in step with values.yaml and with the CRDs.

Every key values.yaml sets is declared in the schema and every property the
schema declares has its default in values.yaml; objects refuse unknown keys
(so a typo fails `helm install` naming it); values.yaml passes its own schema
(checked by Helm and by jsonschema alike). Where a value passes straight into
the TandemDeployment, the schema's constraints are the CRD's.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from operators.spec import crd_schema
from tests.helm.chart import CHART_DIR, chart

VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
# Free-form maps and lists whose entries the user names (labels, selectors,
# resources, env entries): the schema constrains their values, not their keys.
FREE_FORM = (
    "labels",
    "annotations",
    "nodeSelector",
    "requests",
    "limits",
    "resources",
    "routerFrom",
    "metricsFrom",
    "env",
    "tolerations",
    "engineArgs",
    "args",
    "keys",
)


def resolve(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def walk(schema: dict, values, path: str = ""):
    """(path, schema node, value) for every key of values.yaml, depth first."""
    schema = resolve(schema)
    yield path, schema, values
    if isinstance(values, dict) and path.rsplit(".", 1)[-1] not in FREE_FORM:
        for key, value in values.items():
            sub = schema.get("properties", {}).get(key)
            assert sub is not None, f"values.yaml sets {path}.{key}, the schema does not declare it"
            yield from walk(sub, value, f"{path}.{key}")


def test_every_value_is_declared_and_every_declared_property_has_a_default():
    for path, schema, value in walk(SCHEMA, VALUES):
        if isinstance(value, dict) and "properties" in schema:
            missing = set(schema["properties"]) - set(value)
            assert not missing, (
                f"{path or '<root>'}: the schema declares {missing}, "
                f"values.yaml has no default for them"
            )


def test_objects_refuse_unknown_keys():
    for path, schema, value in walk(SCHEMA, VALUES):
        if isinstance(value, dict) and "properties" in schema:
            assert schema.get("additionalProperties") is False, path or "<root>"


def test_every_declared_property_says_what_it_is_for():
    for path, schema, value in walk(SCHEMA, VALUES):
        if path and not isinstance(value, dict) and path.rsplit(".", 1)[-1] != "pullPolicy":
            assert schema.get("description") or "enum" in schema, f"{path} has no description"


def test_values_yaml_passes_its_schema_in_helm_and_in_jsonschema():
    chart().validate_schema({})
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(VALUES)) == []


def test_jsonschema_and_helm_agree_on_a_bad_value():
    bad = {**VALUES, "router": {**VALUES["router"], "policy": "random"}}
    assert [e.json_path for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(bad)] == [
        "$.router.policy"
    ]


TD = crd_schema("tandemdeployments")["properties"]["spec"]["properties"]


@pytest.mark.parametrize(
    "values_path,crd_path",
    [
        ("model.dtype", "model.dtype"),
        ("router.policy", "router.policy"),
        ("scaling.mode", "scaling.mode"),
        ("kvStore.ramPool", "kvStore.ramPool"),
        ("kvStore.disk.size", "kvStore.disk.size"),
        ("images.pullPolicy", "images.pullPolicy"),
        *[
            (f"{pool}.{field}", f"{pool}.{field}")
            for pool in ("prefill", "decode")
            for field in (
                "replicas",
                "minReplicas",
                "maxReplicas",
                "gpusPerPod",
                "nodesPerReplica",
                "terminationGracePeriodSeconds",
                "shmSize",
                "parallelism.tensor",
                "parallelism.pipeline",
                "parallelism.data",
                "parallelism.prefillContext",
                "parallelism.decodeContext",
            )
        ],
        ("router.replicas", "router.replicas"),
        ("scaling.gpuBudget", "scaling.gpuBudget"),
    ],
)
def test_pass_through_values_carry_the_crds_constraints(values_path, crd_path):
    node, crd = SCHEMA, {"properties": TD}
    for part in values_path.split("."):
        node = resolve(resolve(node)["properties"][part])
    for part in crd_path.split("."):
        crd = crd["properties"][part]
    for key in ("type", "enum", "minimum", "maximum", "pattern"):
        assert node.get(key) == crd.get(key), (
            f"{values_path}.{key}: chart {node.get(key)!r}, CRD {crd.get(key)!r}"
        )
