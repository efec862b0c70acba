"""The TandemDeployment spec as the operator reads it (pure, no I/O).

The API server fills the CRD's defaults before the operator sees an object;
`parse` reads a spec into frozen dataclasses (`TandemSpec`, one field per
property of the CRD), filling the same defaults (read from the CRD file
itself, so they live in one place) for a spec that did not pass through an
API server, such as a unit test's; `with_defaults` fills them into the dict
alone. `problems` re-checks the rules the CRD states in CEL, for API
servers that do not evaluate them (CEL validation rules are GA only since
Kubernetes 1.29), plus what CEL cannot see; the operator reports them in the
`Ready` condition instead of acting on a spec it cannot honour.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from common.model_source import HF, LOCAL, ModelSource, parse_source
from operators.planner.profiles import PoolRole

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_DIR = Path(__file__).parent / "crds"

ROLES: tuple[PoolRole, ...] = ("prefill", "decode", "aggregated")
T = TypeVar("T")
# The engine host's --role for each pool of a TandemDeployment.
ENGINE_ROLE = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}

Spec = dict[str, Any]  # a TandemDeployment's spec as the API server holds it


@cache
def crd_schema(plural: str) -> dict[str, Any]:
    """The openAPIV3Schema of one of the operator's CRDs."""
    doc = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _fill(schema: Mapping[str, Any], value: Any) -> None:
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


# ---- the typed spec ----------------------------------------------------------
# One frozen dataclass per object of the CRD's schema, one field per property
# (its CRD name is the field's name in camelCase unless `crd(...)` names it).
# Defaults live only in the CRD: `parse` fills them from the schema as it goes.


def crd(name: str) -> Any:
    """A field whose CRD property is not its name in camelCase."""
    return field(metadata={"crd": name})


@dataclass(frozen=True, kw_only=True)
class VolumeSpec:
    persistent_volume_claim: str | None
    host_path: str | None


@dataclass(frozen=True, kw_only=True)
class SecretRefSpec:
    name: str
    key: str


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    persistent_volume_claim: str


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    path: str | None
    source: str | None
    served_name: str | None
    dtype: str
    max_model_len: int | None
    volume: VolumeSpec | None
    cache: CacheSpec | None
    hf_token_secret_ref: SecretRefSpec | None
    download_backoff_limit: int
    hub_endpoint: str | None

    @property
    def origin(self) -> ModelSource:
        """Where the weights come from: `source`, or `path` as it always was
        (a Hub id vLLM downloads itself, or a path)."""
        if self.source is not None:
            return parse_source(self.source)
        assert self.path is not None  # the CRD requires one of the two
        return ModelSource(LOCAL, path=self.path)

    @property
    def served(self) -> str:
        """The name clients send as `model`."""
        return self.served_name or self.origin.name


@dataclass(frozen=True, kw_only=True)
class ImagesSpec:
    engine: str
    router: str
    kv_store: str
    redis: str
    pull_policy: str
    pull_secrets: tuple[Mapping[str, str], ...] | None


@dataclass(frozen=True, kw_only=True)
class ParallelismSpec:
    tensor: int
    pipeline: int
    data: int
    expert: bool
    prefill_context: int
    decode_context: int


@dataclass(frozen=True, kw_only=True)
class ProbesSpec:
    """Overrides of a container's probes, field by field."""

    readiness: Mapping[str, Any] | None
    liveness: Mapping[str, Any] | None
    startup: Mapping[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    replicas: int
    min_replicas: int
    max_replicas: int
    gpus_per_pod: int
    nodes_per_replica: int
    parallelism: ParallelismSpec
    engine_args: tuple[str, ...]
    env: tuple[Mapping[str, Any], ...]
    resources: Mapping[str, Any] | None
    node_selector: Mapping[str, str] | None
    tolerations: tuple[Mapping[str, Any], ...]
    shm_size: str
    rdma: bool
    scheduler_name: str | None
    spread_across_nodes: bool
    pod_group: str | None
    termination_grace_period_seconds: int
    accelerator_resource: str
    affinity: Mapping[str, Any] | None
    priority_class_name: str | None
    runtime_class_name: str | None
    pod_annotations: Mapping[str, str] | None
    pod_labels: Mapping[str, str] | None
    volumes: tuple[Mapping[str, Any], ...] | None
    volume_mounts: tuple[Mapping[str, Any], ...] | None
    init_containers: tuple[Mapping[str, Any], ...] | None
    probes: ProbesSpec | None

    def gpus(self, replicas: int | None = None) -> int:
        """GPUs `replicas` replicas take (default: the spec's count)."""
        count = self.replicas if replicas is None else replicas
        return count * self.gpus_per_pod * self.nodes_per_replica


@dataclass(frozen=True, kw_only=True)
class IngressSpec:
    enabled: bool
    host: str | None
    hosts: tuple[str, ...] | None
    class_name: str | None
    tls_secret_name: str | None
    annotations: Mapping[str, str] | None

    @property
    def all_hosts(self) -> list[str]:
        """`host` and `hosts`, each once, in order."""
        return list(dict.fromkeys(h for h in (self.host, *(self.hosts or ())) if h))


@dataclass(frozen=True, kw_only=True)
class ServiceSpec:
    type: str
    annotations: Mapping[str, str] | None


@dataclass(frozen=True, kw_only=True)
class RouterSpec:
    replicas: int
    policy: str
    args: tuple[str, ...]
    resources: Mapping[str, Any] | None
    api_key_secret_ref: SecretRefSpec | None
    ingress: IngressSpec
    affinity: Mapping[str, Any] | None
    priority_class_name: str | None
    pod_annotations: Mapping[str, str] | None
    pod_labels: Mapping[str, str] | None
    probes: ProbesSpec | None
    service: ServiceSpec


@dataclass(frozen=True, kw_only=True)
class DiskSpec:
    size: str
    host_path: str


@dataclass(frozen=True, kw_only=True)
class KvStoreSpec:
    enabled: bool
    ram_pool: str
    disk: DiskSpec
    node_selector: Mapping[str, str] | None
    master_resources: Mapping[str, Any] | None
    client_resources: Mapping[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class RedisSpec:
    managed: bool
    url: str | None
    resources: Mapping[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class GrpcTlsSpec:
    secret_name: str
    server_name: str


@dataclass(frozen=True, kw_only=True)
class ProfilesSpec:
    prefill: str | None
    decode: str | None
    aggregated: str | None


@dataclass(frozen=True, kw_only=True)
class SloSpec:
    ttft_p90_ms: int | None
    itl_p90_ms: int | None
    interactivity_p90: float | None
    longest_context_tokens: int | None


@dataclass(frozen=True, kw_only=True)
class CapacitySpec:
    layers: int
    kv_kind: str
    kv_bytes: float
    kv_heads: int | None
    head_dim: int | None
    latent_dim: int | None
    compute_bytes: float
    gpu_free_gib: float = crd("gpuFreeGiB")
    host_free_gib: float | None = crd("hostFreeGiB")
    sequences: int
    transfer_buffer_gib: float = crd("transferBufferGiB")
    host_pool_gib: float = crd("hostPoolGiB")


@dataclass(frozen=True, kw_only=True)
class PrometheusSpec:
    url: str
    selector: str
    window_seconds: int


@dataclass(frozen=True, kw_only=True)
class SimulationSpec:
    mode: str
    requests: int
    timeout_seconds: int
    tolerance: float


@dataclass(frozen=True, kw_only=True)
class ScalingSpec:
    mode: str
    gpu_budget: int | None
    profiles: ProfilesSpec
    headroom: float
    slo: SloSpec
    capacity: CapacitySpec | None
    up_cooldown_seconds: int
    profile_max_age_hours: int
    down_cooldown_seconds: int
    down_window_seconds: int
    max_step: int
    switch_margin: float
    history_limit: int
    simulation: SimulationSpec
    prometheus: PrometheusSpec | None


@dataclass(frozen=True, kw_only=True)
class TandemSpec:
    """A TandemDeployment's spec, defaulted as the API server defaults it."""

    model: ModelSpec
    images: ImagesSpec
    prefill: PoolSpec | None
    decode: PoolSpec | None
    aggregated: PoolSpec | None
    router: RouterSpec
    kv_store: KvStoreSpec
    grpc_tls: GrpcTlsSpec | None
    redis: RedisSpec
    scaling: ScalingSpec

    @property
    def roles(self) -> list[PoolRole]:
        """The pools this deployment runs, in a fixed order."""
        return [role for role in ROLES if getattr(self, role) is not None]

    def pool(self, role: str) -> PoolSpec:
        pool: PoolSpec | None = getattr(self, role)
        if pool is None:
            raise KeyError(f"no {role} pool")
        return pool


@dataclass(frozen=True, kw_only=True)
class EnginePoolSpec:
    """An EnginePool's spec (the pool's replica count and its bounds)."""

    deployment: str
    role: str
    replicas: int
    min_replicas: int
    max_replicas: int


def crd_key(f: dataclasses.Field[Any]) -> str:
    """The CRD property a dataclass field stands for."""
    name: str | None = f.metadata.get("crd")
    if name is not None:
        return name
    head, *rest = f.name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def nested_dataclass(hint: Any) -> tuple[type[Any] | None, bool]:
    """(the dataclass a field holds or None, whether it may be None)."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    return (hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None), optional


def parse_object(cls: type[T], schema: Mapping[str, Any], doc: Mapping[str, Any]) -> T:
    """`doc` (an object of `schema`) as `cls`, with the schema's defaults."""
    hints = typing.get_type_hints(cls)
    props = schema.get("properties", {})
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = crd_key(f)
        sub = props[key]
        value = doc.get(key, copy.deepcopy(sub.get("default")))
        nested, optional = nested_dataclass(hints[f.name])
        if nested is not None:
            if value is None and not optional:
                value = {}
            value = None if value is None else parse_object(nested, sub, value)
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def parse(spec: Spec) -> TandemSpec:
    """A TandemDeployment's spec, as it comes from the API server or a test."""
    return parse_object(TandemSpec, crd_schema("tandemdeployments")["properties"]["spec"], spec)


def parse_pool(spec: Mapping[str, Any]) -> EnginePoolSpec:
    return parse_object(EnginePoolSpec, crd_schema("enginepools")["properties"]["spec"], spec)


def problems(spec: TandemSpec) -> list[str]:
    """What is wrong with a spec, each saying what to change."""
    out: list[str] = _model_problems(spec.model)
    for role in spec.roles:
        pool = spec.pool(role)
        if pool.min_replicas > pool.max_replicas:
            out.append(
                f"{role}.minReplicas ({pool.min_replicas}) exceeds "
                f"{role}.maxReplicas ({pool.max_replicas}): lower minReplicas or "
                f"raise maxReplicas"
            )
        elif not pool.min_replicas <= pool.replicas <= pool.max_replicas:
            out.append(
                f"{role}.replicas ({pool.replicas}) must lie between minReplicas "
                f"({pool.min_replicas}) and maxReplicas ({pool.max_replicas})"
            )
        par = pool.parallelism
        if pool.nodes_per_replica > 1 and (
            par.tensor * par.pipeline != pool.gpus_per_pod * pool.nodes_per_replica
        ):
            out.append(
                f"{role}: a replica over {pool.nodes_per_replica} nodes with "
                f"{pool.gpus_per_pod} GPUs each needs parallelism.tensor x "
                f"parallelism.pipeline = {pool.gpus_per_pod * pool.nodes_per_replica} "
                f"(now {par.tensor} x {par.pipeline})"
            )
    if not spec.redis.managed and not str(spec.redis.url or "").startswith("redis"):
        out.append(
            "redis.managed is false, so redis.url must name the external Redis "
            "(redis:// or rediss://)"
        )
    budget = spec.scaling.gpu_budget
    if budget is not None:
        floor = sum(spec.pool(r).gpus(spec.pool(r).min_replicas) for r in spec.roles)
        if budget < floor:
            out.append(
                f"scaling.gpuBudget ({budget}) is below the {floor} GPUs the pools' "
                f"minReplicas already take: raise gpuBudget or lower minReplicas"
            )
    out += _scaling_problems(spec)
    ingress = spec.router.ingress
    if ingress.tls_secret_name and not ingress.all_hosts:
        out.append("router.ingress.tlsSecretName needs router.ingress.host or hosts")
    return out


def _model_problems(model: ModelSpec) -> list[str]:
    """The CRD's rules on `model`."""
    if (model.path is None) == (model.source is None):
        return ["model takes path or source, one of the two"]
    if model.source is None:
        return []
    try:
        origin = parse_source(model.source)
    except ValueError as exc:
        return [str(exc)]
    out = []
    if origin.kind == HF and model.cache is None:
        out.append("an hf:// model.source needs model.cache.persistentVolumeClaim to download into")
    if origin.kind != LOCAL and model.volume is not None:
        out.append(
            "model.volume goes with model.path or a local model.source, not with hf:// or pvc://"
        )
    return out


def _scaling_problems(spec: TandemSpec) -> list[str]:
    """The CRD's CEL rules on `scaling` (the rate-matching controller's block).
    A missing profile is not one: the controller reports it in its own
    condition (operators/live.py) and the rest of the deployment runs."""
    scaling = spec.scaling
    out: list[str] = []
    slo = scaling.slo
    longest, max_len = slo.longest_context_tokens, spec.model.max_model_len
    if longest is not None and max_len is not None and longest > max_len:
        out.append(
            f"scaling.slo.longestContextTokens ({longest}) exceeds model.maxModelLen "
            f"({max_len}): lower it or raise maxModelLen"
        )
    if slo.itl_p90_ms is not None and slo.interactivity_p90 is not None:
        out.append("scaling.slo takes itlP90Ms or interactivityP90 (tokens/s per user), not both")
    if scaling.down_cooldown_seconds < scaling.up_cooldown_seconds:
        out.append(
            "scaling.downCooldownSeconds must be at least scaling.upCooldownSeconds "
            "(up fast, down slow)"
        )
    return out
