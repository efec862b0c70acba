"""`GET .../pods/{name}/log` (what `kubectl logs` asks for), served from the
files the process kubelet writes: LOG_DIR/<namespace>_<pod>/<container>/
current.log, and previous.log for the run before the last restart.

Query parameters as Kubernetes takes them: `container` (needed when the pod
has several), `previous`, `follow` (until the container stops or the pod goes),
`tailLines`, `limitBytes`, `timestamps` is accepted and ignored.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp.web

from devcluster.store import ApiError, Store

FOLLOW_POLL_S = 0.2


def log_path(log_dir: Path, namespace: str, pod: str, container: str, previous: bool) -> Path:
    return (
        log_dir / f"{namespace}_{pod}" / container / ("previous.log" if previous else "current.log")
    )


def _running(store: Store, namespace: str, name: str, uid: str, container: str) -> bool:
    kind = store.kind("", "v1", "pods")
    try:
        pod = store.get(kind, namespace, name)
    except ApiError:
        return False
    if pod["metadata"]["uid"] != uid:
        return False
    statuses = pod.get("status", {}).get("containerStatuses", [])
    statuses += pod.get("status", {}).get("initContainerStatuses", [])
    return any(s["name"] == container and "running" in s.get("state", {}) for s in statuses)


async def serve(
    store: Store,
    log_dir: Path | None,
    raw_request: aiohttp.web.BaseRequest,
    namespace: str,
    name: str,
) -> aiohttp.web.StreamResponse:
    from devcluster.apiserver import query_bool

    pod = store.get(store.kind("", "v1", "pods"), namespace, name)
    params = raw_request.query
    spec = pod.get("spec", {})
    names = [c["name"] for c in spec.get("initContainers", []) + spec.get("containers", [])]
    container = params.get("container")
    if not container:
        main = [c["name"] for c in spec.get("containers", [])]
        if len(main) != 1:
            raise ApiError(
                400,
                "BadRequest",
                f"a container name must be specified for pod {name}, choose one of: {main}",
                {},
            )
        container = main[0]
    if container not in names:
        raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}", {})
    previous = query_bool(params.get("previous"))
    if log_dir is None:
        raise ApiError(
            400, "BadRequest", "no kubelet runs in this devcluster (started with --no-kubelet)", {}
        )
    path = log_path(log_dir, namespace, name, container, previous)
    if not previous and not path.is_file():
        # Waiting to restart (CrashLoopBackOff): the run that ended, as kubectl shows.
        path = log_path(log_dir, namespace, name, container, True)
    if not path.is_file():
        what = "previous terminated container" if previous else "container"
        raise ApiError(
            400,
            "BadRequest",
            f'{what} "{container}" in pod "{name}" '
            + ("not found" if previous else "is waiting to start: ContainerCreating"),
            {},
        )
    data = path.read_bytes()
    if params.get("tailLines"):
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-int(params["tailLines"]) :]) if int(params["tailLines"]) else b""
    if params.get("limitBytes"):
        data = data[: int(params["limitBytes"])]
    if previous or not query_bool(params.get("follow")):
        return aiohttp.web.Response(body=data, content_type="text/plain")
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
    await response.prepare(raw_request)
    await response.write(data)
    offset = path.stat().st_size
    uid = pod["metadata"]["uid"]
    while True:
        alive = _running(store, namespace, name, uid, container)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            break
        if size < offset:  # rotated: the container restarted
            break
        if size > offset:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            await response.write(chunk)
        elif not alive:
            break
        await asyncio.sleep(FOLLOW_POLL_S)
    await response.write_eof()
    return response
