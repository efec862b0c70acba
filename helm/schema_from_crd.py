"""Write the engine-pool and scaling parts of helm/tandem/values.schema.json from the CRD.

The chart passes `prefill`, `decode`, `aggregated` and `scaling` through to
the TandemDeployment's spec as they are (templates/tandemdeployment.yaml), so
what the values may hold there is what the CRD accepts: this script writes
`definitions.pool` and `properties.scaling` of the values schema from the
TandemDeployment CRD's openAPIV3Schema (operators/crds/tandemdeployments.yaml),
leaving the rest of the file, which is the chart's own, as it is. Translation
to JSON Schema (draft 7, what Helm checks):

* an object with properties refuses unknown keys (`additionalProperties:
  false`), as the API server does under kubectl's strict field validation;
  an `x-kubernetes-preserve-unknown-fields` object stays open;
* type, enum, bounds, pattern, minLength, items, required and descriptions
  are copied; defaults are not (values.yaml holds the chart's own, and the API
  server fills the CRD's into what the values leave out); CEL rules
  (`x-kubernetes-validations`) stay with the API server, which refuses the
  TandemDeployment at `helm install` with their message;
* a pool's `rdma` and `podGroup` are not values: the chart sets them from
  `rdma.enabled` and `podGroups.type`;
* NARROWER: where the chart checks more than the CRD (the Kubernetes shape of
  resources, env entries, volumes, mounts and init containers, which the CRD
  leaves open and the pod would refuse later; engine flags, which vLLM takes
  as `--name[=value]`);
* DESCRIPTIONS: for the pool fields the CRD leaves undescribed.

    python helm/schema_from_crd.py           # rewrite values.schema.json
    python helm/schema_from_crd.py --check   # exit 1 if it is out of date

It also writes `definitions.extraModel`, an extraModels entry, from the
parts of the schema an entry may give (EXTRA_MODEL_KEYS), each with its
objects' `required` dropped: an entry states only what differs.

`make chart-schema` runs the first; tests/helm/test_values_schema.py the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "operators" / "crds" / "tandemdeployments.yaml"
VALUES_SCHEMA = ROOT / "helm" / "tandem" / "values.schema.json"
COMMENT = (
    "generated from operators/crds/tandemdeployments.yaml by `make chart-schema` "
    "(helm/schema_from_crd.py): change the CRD, not this"
)
COPIED = ("type", "enum", "minimum", "maximum", "pattern", "minLength", "description")
# The values an extraModels entry may give for its own TandemDeployment.
EXTRA_MODEL_KEYS = (
    "model",
    "prefill",
    "decode",
    "aggregated",
    "router",
    "scaling",
    "autoscaling",
    "kvStore",
)
# Pool properties the chart sets itself rather than taking from the pool's values.
CHART_SET = {"rdma", "podGroup"}
NARROWER: dict[str, dict[str, Any]] = {
    "resources": {"$ref": "#/definitions/resources"},
    "env": {
        "type": "array",
        "description": "extra environment variables of the engine container",
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}},
            "description": "a container env entry (name plus value or valueFrom)",
        },
    },
    "engineArgs": {
        "type": "array",
        "description": "extra vLLM engine flags, e.g. --long-prefill-token-threshold=2048",
        "items": {"type": "string", "pattern": "^--"},
    },
    "volumes": {
        "type": "array",
        "description": "extra volumes of the engine pods (a pod spec's volumes)",
        "items": {"type": "object", "required": ["name"]},
    },
    "volumeMounts": {
        "type": "array",
        "description": "extra mounts of the engine containers (leader and Ray workers), of volumes",
        "items": {"type": "object", "required": ["name", "mountPath"]},
    },
    "initContainers": {
        "type": "array",
        "description": "init containers of the engine pods, run before the engine",
        "items": {"type": "object", "required": ["name", "image"]},
    },
}
DESCRIPTIONS = {
    "replicas": "replicas the pool starts with (kubectl scale enginepool/... changes it)",
    "minReplicas": "lowest size scaling may choose",
    "maxReplicas": "highest size scaling may choose",
    "parallelism": "vLLM's parallel sizes within one replica",
    "tensor": "tensor parallel size",
    "pipeline": "pipeline parallel size",
    "data": "data parallel size",
    "nodeSelector": "node labels the pool's pods must run on",
    "tolerations": "tolerations of the pool's pods",
}


def translate(node: dict[str, Any], describe: dict[str, str] | None = None) -> dict[str, Any]:
    """One node of the CRD's openAPIV3Schema as the values schema's JSON Schema."""
    out = {key: node[key] for key in COPIED if key in node}
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if "items" in node:
        out["items"] = translate(node["items"], describe)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = translate(node["additionalProperties"])
    if "properties" in node:
        out["additionalProperties"] = False
        props = {}
        for name, sub in node["properties"].items():
            prop = translate(sub, describe)
            if describe is not None and "description" not in prop and name in describe:
                prop["description"] = describe[name]
            props[name] = prop
        out["properties"] = props
    if "required" in node:
        out["required"] = list(node["required"])
    return out


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec: dict[str, Any] = schema["properties"]["spec"]
    return spec


def pool() -> dict[str, Any]:
    crd_pool = spec_schema()["properties"]["prefill"]
    out = translate(crd_pool, DESCRIPTIONS)
    for name in CHART_SET:
        del out["properties"][name]
    out["properties"].update(NARROWER)
    out["description"] = "an engine pool (the TandemDeployment's pool, less rdma and podGroup)"
    return {"$comment": COMMENT, **out}


def scaling() -> dict[str, Any]:
    return {"$comment": COMMENT, **translate(spec_schema()["properties"]["scaling"])}


def pool_roles() -> list[str]:
    """The spec's engine pools: the properties whose schema is the prefill pool's."""
    props = spec_schema()["properties"]
    return [name for name, sub in props.items() if sub == props["prefill"]]


def partial(node: Any, whole: bool = False) -> Any:
    """`node` with the `required` of its objects dropped: an extraModels entry
    states only what differs from the release's values. Kept where a schema
    is whole: list entries, and the conditions of `if` and `not`."""
    if isinstance(node, list):
        return [partial(sub, whole) for sub in node]
    if not isinstance(node, dict):
        return node
    return {
        key: partial(sub, whole or key in ("items", "if", "not"))
        for key, sub in node.items()
        if whole or key != "required"
    }


def extra_model(props: dict[str, Any]) -> dict[str, Any]:
    """An extraModels entry: a name, and the per-model parts of the values, each partial."""
    return {
        "$comment": "generated by `make chart-schema` (helm/schema_from_crd.py) from the "
        "properties it names: change those, not this",
        "type": "object",
        "description": "a further model: its name and what differs from the release's values",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {
            "name": {
                "type": "string",
                "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                "maxLength": 20,
                "description": "the TandemDeployment is <fullname>-<name>",
            },
            **{key: partial(props[key]) for key in EXTRA_MODEL_KEYS},
        },
    }


def generate(current: dict[str, Any]) -> dict[str, Any]:
    """`current` (the values schema) with its pool and scaling parts written
    from the CRD, and the extraModels entry from those and the chart's parts."""
    out = json.loads(json.dumps(current))
    out["definitions"]["pool"] = pool()
    roles = pool_roles()
    props: dict[str, Any] = {}
    for name, sub in out["properties"].items():
        if name in roles:  # every pool where the first one was
            props.update({role: {"$ref": "#/definitions/pool"} for role in roles})
        else:
            props[name] = scaling() if name == "scaling" else sub
    out["properties"] = props
    out["definitions"]["extraModel"] = extra_model(props)
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args(argv)
    text = VALUES_SCHEMA.read_text()
    want = render(generate(json.loads(text)))
    if args.check:
        if text != want:
            print(f"{VALUES_SCHEMA} is stale: run `make chart-schema`", file=sys.stderr)
            return 1
        return 0
    VALUES_SCHEMA.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
