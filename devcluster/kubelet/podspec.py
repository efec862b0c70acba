"""From a pod's spec to what runs: images, environment, volumes.

Images are not pulled or run: a container runs on the host's file system, with
the project's virtualenv's bin first on PATH. IMAGES maps an image repository
(registry and tag stripped) to what its Dockerfile sets: ENTRYPOINT and CMD,
composed with the container's `command`/`args` as Kubernetes does, and ENV
(PYTHONUNBUFFERED and kin, under the pod's own env; Tandem's images also get
PYTHONPATH=the checkout the cluster runs from, so pods run its code). A
container of an image not listed needs a `command`. Redis's runs with
`--protected-mode no`, the image's own build default.

| image repository             | ENTRYPOINT     | CMD                    | from                    |
|------------------------------|----------------|------------------------|-------------------------|
| tandem-serving/tandem        |                | `tandem --help`        | the venv                |
| tandem-serving/tandem-engine |                | `tandem-engine --help` | the venv (vLLM CPU)     |
| library/redis, redis         | `redis-server` |                        | the host's redis-server |
| library/python, python       |                | `python3`              | the venv's python       |
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

_UNBUFFERED = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
# repository → (ENTRYPOINT, CMD, ENV); docker/*.Dockerfile for Tandem's. Redis's
# entrypoint script runs `redis-server "$@"` when the first argument is a flag,
# and the image builds redis-server with protected mode off by default (other
# pods reach it without a password); the host's redis-server has it on.
IMAGES: dict[str, tuple[list[str], list[str], dict[str, str]]] = {
    "tandem-serving/tandem": ([], ["tandem", "--help"], _UNBUFFERED),
    "tandem-serving/tandem-engine": ([], ["tandem-engine", "--help"], {"PYTHONUNBUFFERED": "1"}),
    "library/redis": (["redis-server", "--protected-mode", "no"], [], {}),
    "redis": (["redis-server", "--protected-mode", "no"], [], {}),
    "library/python": ([], ["python3"], {}),
    "python": ([], ["python3"], {}),
}

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class PodSpecError(Exception):
    """A container cannot start as specified (reason, message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# The checkout this cluster runs from: Tandem's images are it and the venv.
CHECKOUT = Path(__file__).resolve().parents[2]


def image_env(image: str) -> dict[str, str]:
    repo = image_repository(image)
    entry = IMAGES.get(repo)
    env = dict(entry[2]) if entry else {}
    if repo.startswith("tandem-serving/"):
        env["PYTHONPATH"] = str(CHECKOUT)
    return env


def image_repository(image: str) -> str:
    """`ghcr.io/a/b:1.0@sha256:…` → `a/b`; `redis:7` → `redis`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name.rsplit(":", 1)[0]
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    return "/".join(parts)


def argv_of(container: dict, env: dict[str, str]) -> list[str]:
    """The container's command line as Kubernetes composes it, `$(VAR)` expanded."""
    command = container.get("command")
    args = container.get("args")
    if not command:
        repo = image_repository(container.get("image", ""))
        if repo not in IMAGES:
            raise PodSpecError(
                "CreateContainerError",
                f"no command given and devcluster knows no entrypoint for image "
                f"{container.get('image')!r} (devcluster/kubelet/podspec.py: IMAGES)",
            )
        # Kubernetes: `args` alone replace the image's CMD, after its ENTRYPOINT.
        entrypoint, cmd, _ = IMAGES[repo]
        command, args = entrypoint, cmd if args is None else args
    return [expand(word, env) for word in [*command, *(args or [])]]


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, undefined ones
    kept as written, `$$` escapes a `$`."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, text)


Lookup = Callable[[str, str], Awaitable[dict | None]]  # (kind plural, name) → object


def field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise PodSpecError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


_QUANTITY = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(text: str | int | float) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    if not m or m.group(2) not in _QUANTITY:
        raise PodSpecError("CreateContainerConfigError", f"bad quantity {text!r}")
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def resource_value(pod: dict, container: dict, ref: dict) -> str:
    import math
    import os

    name = ref.get("containerName") or container["name"]
    target = next((c for c in pod["spec"].get("containers", []) if c["name"] == name), container)
    kind, _, res = ref["resource"].partition(".")
    value = target.get("resources", {}).get(kind, {}).get(res)
    if value is None:  # no limit: the node's allocatable, as the kubelet does
        value = os.cpu_count() if res == "cpu" else os.sysconf("SC_PHYS_PAGES") * 4096
    divisor = quantity(ref.get("divisor", "1"))
    return str(max(1, math.ceil(quantity(value) / divisor)))


async def environment(pod: dict, container: dict, lookup: Lookup) -> dict[str, str]:
    """envFrom, then env (later wins), each value `$(VAR)`-expanded against the
    ones before it, as Kubernetes does."""
    env: dict[str, str] = {}

    async def source(kind: str, name: str, optional: bool) -> dict[str, str] | None:
        obj = await lookup(kind, name)
        if obj is None:
            if optional:
                return None
            raise PodSpecError("CreateContainerConfigError", f'{kind[:-1]} "{name}" not found')
        data = dict(obj.get("data") or {})
        if kind == "secrets":
            import base64

            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        return data

    for item in container.get("envFrom", []):
        ref = item.get("configMapRef") or item.get("secretRef") or {}
        kind = "configmaps" if "configMapRef" in item else "secrets"
        data = await source(kind, ref["name"], bool(ref.get("optional")))
        for key, value in (data or {}).items():
            env[item.get("prefix", "") + key] = value
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        frm = var["valueFrom"]
        if "fieldRef" in frm:
            env[name] = field_value(pod, frm["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in frm:
            env[name] = resource_value(pod, container, frm["resourceFieldRef"])
        else:
            ref = frm.get("configMapKeyRef") or frm.get("secretKeyRef")
            if ref is None:
                raise PodSpecError("CreateContainerConfigError", f"env {name}: bad valueFrom")
            kind = "configmaps" if "configMapKeyRef" in frm else "secrets"
            data = await source(kind, ref["name"], bool(ref.get("optional")))
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise PodSpecError(
                    "CreateContainerConfigError",
                    f"couldn't find key {ref['key']} in {kind[:-1]} {ref['name']}",
                )
            env[name] = data[ref["key"]]
    return env


async def materialize_volumes(
    pod: dict, root: Path, claims: Path, lookup: Lookup
) -> dict[str, Path]:
    """Each volume as a local path: emptyDir under the pod's folder, configMap
    and secret files written out, hostPath as is, a PVC a folder per claim."""
    import base64

    paths: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes", []):
        name = vol["name"]
        if "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type", "") in ("", "DirectoryOrCreate"):
                path.mkdir(parents=True, exist_ok=True)
        elif "persistentVolumeClaim" in vol:
            namespace = pod["metadata"]["namespace"]
            path = claims / namespace / vol["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
        elif "emptyDir" in vol:
            path = root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
        elif "configMap" in vol or "secret" in vol:
            kind = "configmaps" if "configMap" in vol else "secrets"
            ref = vol.get("configMap") or vol["secret"]
            obj_name = ref.get("name") or ref.get("secretName")
            obj = await lookup(kind, obj_name)
            if obj is None and not ref.get("optional"):
                raise PodSpecError(
                    "ContainerCreating", f'{kind[:-1]} "{obj_name}" not found (volume {name})'
                )
            data: dict[str, bytes] = {}
            for k, v in ((obj or {}).get("data") or {}).items():
                data[k] = base64.b64decode(v) if kind == "secrets" else v.encode()
            for k, v in ((obj or {}).get("binaryData") or {}).items():
                data[k] = base64.b64decode(v)
            items = ref.get("items")
            files = (
                {i["path"]: data[i["key"]] for i in items if i["key"] in data} if items else data
            )
            path = root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            for rel, content in files.items():
                target = path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                target.chmod(ref.get("defaultMode", 0o644))
        else:
            raise PodSpecError(
                "ContainerCreating",
                f"volume {name}: devcluster supports emptyDir, configMap, secret, "
                f"hostPath and persistentVolumeClaim, not {sorted(set(vol) - {'name'})}",
            )
        paths[name] = path
    return paths


def mounts_of(container: dict, volumes: dict[str, Path]) -> list[dict[str, Any]]:
    """(source, target, readOnly) bind mounts for a container's volumeMounts."""
    mounts = []
    for m in container.get("volumeMounts", []):
        if m["name"] not in volumes:
            raise PodSpecError(
                "CreateContainerConfigError", f"volumeMount {m['name']!r}: no such volume"
            )
        source = volumes[m["name"]]
        if m.get("subPath"):
            source = source / m["subPath"]
        mounts.append(
            {"source": str(source), "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))}
        )
    return mounts
