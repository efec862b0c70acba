"""values.schema.json is kept in step with values.yaml and with the CRDs.

Every key values.yaml sets is declared in the schema and every property the
schema declares has its default in values.yaml (but in the parts the chart
leaves to the CRD's defaults); objects refuse unknown keys (so a typo fails
`helm install` naming it); values.yaml passes its own schema (checked by Helm
and by jsonschema alike). The engine pools and `scaling` are generated from the
CRD (helm/schema_from_crd.py): the committed file is what the generator writes,
and they accept what the CRD accepts, property by property. Elsewhere, where a
value passes straight into the TandemDeployment, the constraints are the CRD's.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest
import yaml

from operators.spec import crd_schema
from tests.helm.chart import CHART_DIR, REPO, chart

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


# Parts values.yaml leaves (wholly or in part) to the CRD's defaults: the API
# server fills them, so the chart cannot pin a default the CRD has since changed.
LEFT_TO_CRD = (".aggregated", ".scaling")


def test_every_value_is_declared_and_every_declared_property_has_a_default():
    for path, schema, value in walk(SCHEMA, VALUES):
        if path.startswith(LEFT_TO_CRD):
            continue
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
        ("router.replicas", "router.replicas"),
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


def load_generator():
    path = REPO / "helm" / "schema_from_crd.py"
    spec = importlib.util.spec_from_file_location("schema_from_crd", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_schema_is_what_the_generator_writes():
    generator = load_generator()
    text = (CHART_DIR / "values.schema.json").read_text()
    assert text == generator.render(generator.generate(json.loads(text))), (
        "values.schema.json lags operators/crds/tandemdeployments.yaml: run `make chart-schema`"
    )
    assert generator.main(["--check"]) == 0


# Where the chart checks more than the CRD, on purpose (helm/schema_from_crd.py NARROWER),
# and what the chart sets itself (a pool's rdma comes from rdma.enabled, its
# podGroup from podGroups.type).
NARROWER = {
    "prefill.resources",
    "prefill.env",
    "prefill.engineArgs",
    "prefill.volumes",
    "prefill.volumeMounts",
    "prefill.initContainers",
}
CHART_SET = {"prefill.rdma", "prefill.podGroup"}
CONSTRAINTS = ("type", "enum", "minimum", "maximum", "pattern", "minLength")


def same_language(crd: dict, values: dict, path: str) -> list[str]:
    """Where the values schema at `path` accepts other values than the CRD's schema."""
    values = resolve(values)
    out = [
        f"{path}.{key}: CRD {crd.get(key)!r}, chart {values.get(key)!r}"
        for key in CONSTRAINTS
        if crd.get(key) != values.get(key)
    ]
    if sorted(crd.get("required", [])) != sorted(values.get("required", [])):
        out.append(f"{path}: required {crd.get('required')} vs {values.get('required')}")
    if crd.get("x-kubernetes-preserve-unknown-fields"):
        if "properties" in values:
            out.append(f"{path}: open in the CRD, closed in the chart")
        return out
    crd_props = {
        k: v for k, v in crd.get("properties", {}).items() if f"{path}.{k}" not in CHART_SET
    }
    if set(crd_props) != set(values.get("properties", {})):
        out.append(f"{path}: properties {sorted(crd_props)} vs {sorted(values['properties'])}")
    elif crd_props and values.get("additionalProperties") is not False:
        out.append(f"{path}: the chart takes unknown keys the API server refuses")
    for key, sub in crd_props.items():
        if f"{path}.{key}" not in NARROWER and key in values.get("properties", {}):
            out += same_language(sub, values["properties"][key], f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(crd.get(key), dict):
            out += same_language(crd[key], values.get(key) or {}, f"{path}.{key}")
    return out


@pytest.mark.parametrize("part", ["prefill", "decode", "aggregated", "scaling"])
def test_pools_and_scaling_accept_what_the_crd_accepts(part):
    # Every pool is checked against the CRD's as `prefill` (the exceptions' names).
    path = part if part == "scaling" else "prefill"
    found = same_language(TD[part], SCHEMA["properties"][part], path)
    assert not found, "\n".join(found)


def test_the_comparison_sees_a_lagging_chart():
    lagging = json.loads(json.dumps(SCHEMA))
    scaling = lagging["properties"]["scaling"]
    del scaling["properties"]["headroom"]
    scaling["properties"]["slo"]["properties"]["ttftP90Ms"]["minimum"] = 0
    scaling["properties"]["capacity"]["properties"]["kvKind"]["enum"] = ["gqa"]
    found = same_language(TD["scaling"], scaling, "scaling")
    assert len(found) == 3, found
