"""Engine profiles: what one replica of a configuration delivers at rising load.

A profile is Phase 1's measurement (or figures written by hand from published
GPU numbers, marked ``source: published``): one engine configuration (model,
GPUs per replica, parallelism and scheduler flags, KV capacity) and, for each
load level of the replay, the request and token rates **per replica**, TTFT
p50/p90, inter-token latency, P90 interactivity, prefix hit rate, and the
mean number of requests in the pool per replica (Little's law: rate × time in
the pool), which is the load axis the live loop compares against.

Profiles travel as ConfigMaps labelled ``tandem.dev/engine-profile`` whose
``profile.json`` key holds the document ``profile_to_dict`` writes; the
operator reads them from the TandemDeployment's namespace. Everything here is
pure: dicts in, dataclasses out, with errors that name the field at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import yaml

PoolRole = Literal["prefill", "decode", "aggregated"]
Source = Literal["measured", "published"]
ROLES: tuple[PoolRole, ...] = ("prefill", "decode", "aggregated")
SOURCES: tuple[Source, ...] = ("measured", "published")

PROFILE_KIND = "tandem-engine-profile"
PROFILE_VERSION = 1
PROFILE_LABEL = "tandem.dev/engine-profile"
PROFILE_KEY = "profile.json"


class ProfileError(ValueError):
    """A profile document that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Parallelism:
    """vLLM's parallel sizes for one replica. DCP (decode context parallel)
    splits tokens across ranks inside the TP group; PCP (prefill context
    parallel) adds ranks of its own."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    pcp: int = 1
    dcp: int = 1

    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.pcp

    def label(self) -> str:
        parts = [f"TP{self.tp}"]
        for name, value in (("PP", self.pp), ("DP", self.dp), ("PCP", self.pcp), ("DCP", self.dcp)):
            if value != 1:
                parts.append(f"{name}{value}")
        return "×".join(parts)


@dataclass(frozen=True)
class EngineConfig:
    """One way to run a replica. On CPU, ``gpus_per_replica`` counts the cores
    the replica is pinned to: it is the unit the budget is spent in."""

    name: str
    role: PoolRole
    model: str
    gpus_per_replica: int
    hardware: str = ""
    parallelism: Parallelism = field(default_factory=Parallelism)
    scheduler_flags: tuple[str, ...] = ()
    # KV capacity of one replica, in tokens (None: unknown, no KV limit applied).
    kv_capacity_tokens: int | None = None


@dataclass(frozen=True)
class ProfilePoint:
    """One load level. Rates are per replica; latencies are as clients saw them."""

    concurrency: float
    request_rate: float
    input_tokens_per_s: float  # prompt tokens, cached ones included
    output_tokens_per_s: float
    ttft_p50_s: float | None  # None only in published figures that do not give it
    ttft_p90_s: float | None
    hit_rate: float
    in_flight: float | None  # mean requests inside the pool per replica (Little's law)
    itl_s: float | None = None
    interactivity_p90: float | None = None  # tokens/s/user, 1 / P90(e2e / output tokens)

    @property
    def uncached_tokens_per_s(self) -> float:
        return self.input_tokens_per_s * (1.0 - self.hit_rate)

    @property
    def mean_input_tokens(self) -> float:
        return self.input_tokens_per_s / self.request_rate

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens_per_s / self.request_rate

    @property
    def mean_uncached_tokens(self) -> float:
        return self.mean_input_tokens * (1.0 - self.hit_rate)


@dataclass(frozen=True)
class EngineProfile:
    config: EngineConfig
    points: tuple[ProfilePoint, ...]  # rising load
    source: Source
    workload: str = ""  # the trace and how it was replayed
    note: str = ""  # where published figures come from, or how the run went
    taken_at: str = ""
    replicas_measured: int = 1

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def role(self) -> PoolRole:
        return self.config.role

    def saturation(self) -> ProfilePoint:
        """The point of highest request rate."""
        return max(self.points, key=lambda p: p.request_rate)


def validate(profile: EngineProfile) -> EngineProfile:
    """The profile itself, or ProfileError naming what is wrong."""
    c = profile.config
    where = f"profile {c.name!r}"
    if not c.name:
        raise ProfileError("profile: config.name is empty")
    if c.role not in ROLES:
        raise ProfileError(f"{where}: config.role {c.role!r} is not one of {list(ROLES)}")
    if profile.source not in SOURCES:
        raise ProfileError(f"{where}: source {profile.source!r} is not one of {list(SOURCES)}")
    if c.gpus_per_replica < 1:
        raise ProfileError(f"{where}: config.gpusPerReplica must be ≥ 1")
    p = c.parallelism
    for name in ("tp", "pp", "dp", "pcp", "dcp"):
        if getattr(p, name) < 1:
            raise ProfileError(f"{where}: config.parallelism.{name} must be ≥ 1")
    if p.tp % p.dcp:
        raise ProfileError(f"{where}: config.parallelism.dcp ({p.dcp}) must divide tp ({p.tp})")
    if c.kv_capacity_tokens is not None and c.kv_capacity_tokens < 1:
        raise ProfileError(f"{where}: config.kvCapacityTokens must be ≥ 1")
    if not profile.points:
        raise ProfileError(f"{where}: no points")
    last = -math.inf
    for i, pt in enumerate(profile.points):
        at = f"{where}: points[{i}]"
        if pt.concurrency <= last:
            raise ProfileError(f"{at}: concurrency must rise from point to point")
        last = pt.concurrency
        for name in ("request_rate", "input_tokens_per_s"):
            value = getattr(pt, name)
            if not (math.isfinite(value) and value > 0):
                raise ProfileError(f"{at}: {_camel(name)} must be a positive number")
        for name in ("ttft_p50_s", "ttft_p90_s", "in_flight"):
            if getattr(pt, name) is None and profile.source == "measured":
                raise ProfileError(f"{at}: {_camel(name)} is required in a measured profile")
        if not (math.isfinite(pt.output_tokens_per_s) and pt.output_tokens_per_s >= 0):
            raise ProfileError(f"{at}: outputTokensPerS must be ≥ 0")
        if not 0.0 <= pt.hit_rate < 1.0:
            raise ProfileError(f"{at}: hitRate must be in [0, 1)")
        if (
            pt.ttft_p90_s is not None
            and pt.ttft_p50_s is not None
            and pt.ttft_p90_s < pt.ttft_p50_s
        ):
            raise ProfileError(f"{at}: ttftP90S is below ttftP50S")
        for name in ("ttft_p50_s", "ttft_p90_s", "in_flight", "itl_s", "interactivity_p90"):
            value = getattr(pt, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ProfileError(f"{at}: {_camel(name)} must be a positive number or null")
        if c.role in ("decode", "aggregated") and pt.output_tokens_per_s <= 0:
            raise ProfileError(f"{at}: a {c.role} profile needs outputTokensPerS > 0")
    return profile


# -- documents ------------------------------------------------------------------

_POINT_FIELDS = (
    "concurrency",
    "request_rate",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "hit_rate",
    "in_flight",
    "itl_s",
    "interactivity_p90",
)
_OPTIONAL_POINT_FIELDS = ("ttft_p50_s", "ttft_p90_s", "in_flight", "itl_s", "interactivity_p90")


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def profile_to_dict(profile: EngineProfile) -> dict[str, Any]:
    c = profile.config
    p = c.parallelism
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "source": profile.source,
        "workload": profile.workload,
        "note": profile.note,
        "takenAt": profile.taken_at,
        "replicasMeasured": profile.replicas_measured,
        "config": {
            "name": c.name,
            "role": c.role,
            "model": c.model,
            "gpusPerReplica": c.gpus_per_replica,
            "hardware": c.hardware,
            "parallelism": {"tp": p.tp, "pp": p.pp, "dp": p.dp, "pcp": p.pcp, "dcp": p.dcp},
            "schedulerFlags": list(c.scheduler_flags),
            "kvCapacityTokens": c.kv_capacity_tokens,
        },
        "points": [{_camel(f): getattr(pt, f) for f in _POINT_FIELDS} for pt in profile.points],
    }


def profile_from_dict(doc: Mapping[str, Any]) -> EngineProfile:
    """Parse and validate; ProfileError names the field at fault."""
    if doc.get("kind") != PROFILE_KIND:
        raise ProfileError(f"profile: kind must be {PROFILE_KIND!r}, got {doc.get('kind')!r}")
    if doc.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"profile: version {doc.get('version')!r} is not supported "
            f"(this reader knows {PROFILE_VERSION})"
        )
    raw_config = _mapping(doc.get("config"), "config")
    raw_par = _mapping(raw_config.get("parallelism", {}), "config.parallelism")
    kv = raw_config.get("kvCapacityTokens")
    config = EngineConfig(
        name=_str(raw_config.get("name"), "config.name"),
        role=cast(PoolRole, _str(raw_config.get("role"), "config.role")),
        model=_str(raw_config.get("model"), "config.model"),
        gpus_per_replica=_int(raw_config.get("gpusPerReplica"), "config.gpusPerReplica"),
        hardware=str(raw_config.get("hardware", "")),
        parallelism=Parallelism(
            **{
                k: _int(raw_par.get(k, 1), f"config.parallelism.{k}")
                for k in ("tp", "pp", "dp", "pcp", "dcp")
            }
        ),
        scheduler_flags=tuple(str(f) for f in raw_config.get("schedulerFlags", [])),
        kv_capacity_tokens=None if kv is None else _int(kv, "config.kvCapacityTokens"),
    )
    raw_points = doc.get("points")
    if not isinstance(raw_points, list):
        raise ProfileError("profile: points must be a list")
    points = []
    for i, raw in enumerate(raw_points):
        raw = _mapping(raw, f"points[{i}]")
        values: dict[str, float | None] = {}
        for f in _POINT_FIELDS:
            key = _camel(f)
            if raw.get(key) is None and f in _OPTIONAL_POINT_FIELDS:
                values[f] = None
            else:
                values[f] = _float(raw.get(key), f"points[{i}].{key}")
        points.append(ProfilePoint(**cast(dict[str, Any], values)))
    return validate(
        EngineProfile(
            config=config,
            points=tuple(points),
            source=cast(Source, _str(doc.get("source"), "source")),
            workload=str(doc.get("workload", "")),
            note=str(doc.get("note", "")),
            taken_at=str(doc.get("takenAt", "")),
            replicas_measured=_int(doc.get("replicasMeasured", 1), "replicasMeasured"),
        )
    )


def profile_configmap(
    profile: EngineProfile, name: str, namespace: str | None = None
) -> dict[str, Any]:
    """The profile as a ConfigMap manifest the operator reads."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {PROFILE_LABEL: profile.role, "tandem.dev/profile-source": profile.source},
    }
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {PROFILE_KEY: json.dumps(profile_to_dict(profile), indent=1)},
    }


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the profile document) as literal blocks."""


def _str_block(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    )


_BlockDumper.add_representer(str, _str_block)


def manifests_yaml(manifests: Iterable[Mapping[str, Any]], header: str = "") -> str:
    """Manifests as one multi-document YAML, ``kubectl apply -f`` ready."""
    body = yaml.dump_all(
        [dict(m) for m in manifests], Dumper=_BlockDumper, sort_keys=False, width=100
    )
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return comment + body


def profiles_from_yaml(text: str) -> list[EngineProfile]:
    """Every profile ConfigMap in a (multi-document) YAML text."""
    return [
        profile_from_configmap(doc)
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, Mapping) and doc.get("kind") == "ConfigMap"
    ]


def profile_from_configmap(obj: Mapping[str, Any]) -> EngineProfile:
    name = _mapping(obj.get("metadata", {}), "metadata").get("name", "?")
    data = _mapping(obj.get("data", {}), f"ConfigMap {name}: data")
    text = data.get(PROFILE_KEY)
    if not isinstance(text, str):
        raise ProfileError(f"ConfigMap {name}: data.{PROFILE_KEY} is missing")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"ConfigMap {name}: data.{PROFILE_KEY} is not JSON ({exc})") from None
    try:
        return profile_from_dict(_mapping(doc, PROFILE_KEY))
    except ProfileError as exc:
        raise ProfileError(f"ConfigMap {name}: {exc}") from None


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(f"profile: {where} must be a mapping")
    return cast(Mapping[str, Any], value)


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProfileError(f"profile: {where} must be a non-empty string")
    return value


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"profile: {where} must be an integer")
    return value


def _float(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"profile: {where} must be a number")
    return float(value)
