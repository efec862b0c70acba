"""The TandemDeployment spec as the operator reads it (pure, no I/O).

The API server fills the CRD's defaults before the operator sees an object;
`with_defaults` applies the same defaults (read from the CRD file itself, so
they live in one place) for a spec that did not pass through one, such as a
unit test's. `problems` re-checks the rules the CRD states in CEL, for API
servers that do not evaluate them (CEL validation rules are GA only since
Kubernetes 1.29), plus what CEL cannot see; the operator reports them in the
`Ready` condition instead of acting on a spec it cannot honour.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import yaml

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_DIR = Path(__file__).parent / "crds"

ROLES = ("prefill", "decode", "aggregated")
# The engine host's --role for each pool of a TandemDeployment.
ENGINE_ROLE = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}

Spec = dict[str, Any]


@cache
def crd_schema(plural: str) -> dict:
    """The openAPIV3Schema of one of the operator's CRDs."""
    doc = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _fill(schema: dict, value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(sub, value[key])


def with_defaults(spec: Spec) -> Spec:
    """`spec` with the CRD's defaults filled in, as the API server would."""
    out = copy.deepcopy(spec)
    _fill(crd_schema("tandemdeployments")["properties"]["spec"], out)
    return out


def pools(spec: Spec) -> list[str]:
    """The pools this deployment runs, in a fixed order."""
    return [role for role in ROLES if role in spec]


def pool_gpus(pool: dict, replicas: int | None = None) -> int:
    count = pool["replicas"] if replicas is None else replicas
    return count * pool["gpusPerPod"] * pool["nodesPerReplica"]


def problems(spec: Spec) -> list[str]:
    """What is wrong with a (defaulted) spec, each saying what to change."""
    out: list[str] = []
    for role in pools(spec):
        pool = spec[role]
        if pool["minReplicas"] > pool["maxReplicas"]:
            out.append(f"{role}.minReplicas ({pool['minReplicas']}) exceeds "
                       f"{role}.maxReplicas ({pool['maxReplicas']}): lower minReplicas or "
                       f"raise maxReplicas")
        elif not pool["minReplicas"] <= pool["replicas"] <= pool["maxReplicas"]:
            out.append(f"{role}.replicas ({pool['replicas']}) must lie between minReplicas "
                       f"({pool['minReplicas']}) and maxReplicas ({pool['maxReplicas']})")
        par = pool["parallelism"]
        if pool["nodesPerReplica"] > 1 and (
            par["tensor"] * par["pipeline"] != pool["gpusPerPod"] * pool["nodesPerReplica"]
        ):
            out.append(f"{role}: a replica over {pool['nodesPerReplica']} nodes with "
                       f"{pool['gpusPerPod']} GPUs each needs parallelism.tensor x "
                       f"parallelism.pipeline = {pool['gpusPerPod'] * pool['nodesPerReplica']} "
                       f"(now {par['tensor']} x {par['pipeline']})")
    redis = spec.get("redis", {})
    if not redis.get("managed", True) and not str(redis.get("url", "")).startswith("redis"):
        out.append("redis.managed is false, so redis.url must name the external Redis "
                   "(redis:// or rediss://)")
    budget = spec.get("scaling", {}).get("gpuBudget")
    if budget is not None:
        floor = sum(pool_gpus(spec[r], spec[r]["minReplicas"]) for r in pools(spec))
        if budget < floor:
            out.append(f"scaling.gpuBudget ({budget}) is below the {floor} GPUs the pools' "
                       f"minReplicas already take: raise gpuBudget or lower minReplicas")
    out += _scaling_problems(spec)
    ingress = spec.get("router", {}).get("ingress", {})
    if ingress.get("tlsSecretName") and not ingress.get("host"):
        out.append("router.ingress.tlsSecretName needs router.ingress.host")
    return out


def _scaling_problems(spec: Spec) -> list[str]:
    """The CRD's CEL rules on `scaling` (the rate-matching controller's block).
    A missing profile is not one: the controller reports it in its own
    condition (operators/scaling.py) and the rest of the deployment runs."""
    scaling = spec.get("scaling", {})
    out: list[str] = []
    slo = scaling.get("slo", {})
    longest, max_len = slo.get("longestContextTokens"), spec["model"].get("maxModelLen")
    if longest is not None and max_len is not None and longest > max_len:
        out.append(f"scaling.slo.longestContextTokens ({longest}) exceeds model.maxModelLen "
                   f"({max_len}): lower it or raise maxModelLen")
    if "itlP90Ms" in slo and "interactivityP90" in slo:
        out.append("scaling.slo takes itlP90Ms or interactivityP90 (tokens/s per user), not both")
    if scaling.get("downCooldownSeconds", 600) < scaling.get("upCooldownSeconds", 60):
        out.append("scaling.downCooldownSeconds must be at least scaling.upCooldownSeconds "
                   "(up fast, down slow)")
    return out
