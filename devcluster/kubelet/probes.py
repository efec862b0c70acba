"""Container probes and lifecycle handlers as the kubelet runs them: httpGet,
tcpSocket and grpc from the host to the pod's IP, exec (and preStop exec)
inside the container's namespaces (`nsenter` into its first process)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp


def port_of(container: dict, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port!r}")


async def run_exec(pid: int, argv: list[str], env: dict[str, str], timeout: float) -> int:
    """Run `argv` in the namespaces of process `pid`; its exit code (-1: timed out)."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter",
        "-t",
        str(pid),
        "-n",
        "-m",
        "--",
        *argv,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return -1


async def check(
    handler: dict[str, Any],
    container: dict,
    pod_ip: str,
    pid: int,
    env: dict[str, str],
    timeout: float,
) -> bool:
    """One probe (or lifecycle handler) run: success?"""
    try:
        if "httpGet" in handler:
            h = handler["httpGet"]
            scheme = h.get("scheme", "HTTP").lower()
            url = f"{scheme}://{h.get('host') or pod_ip}:{port_of(container, h['port'])}"
            url += h.get("path", "/")
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders", [])}
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    url,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    ssl=False,
                    allow_redirects=True,
                ) as resp,
            ):
                return 200 <= resp.status < 400
        if "tcpSocket" in handler:
            h = handler["tcpSocket"]
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(h.get("host") or pod_ip, port_of(container, h["port"])),
                timeout,
            )
            writer.close()
            return True
        if "grpc" in handler:
            from grpc import aio
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            h = handler["grpc"]
            async with aio.insecure_channel(f"{pod_ip}:{h['port']}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=h.get("service", "")),
                    timeout=timeout,
                )
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "exec" in handler:
            return await run_exec(pid, handler["exec"]["command"], env, timeout) == 0
        if "sleep" in handler:
            await asyncio.sleep(float(handler["sleep"]["seconds"]))
            return True
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError):
        return False
    except Exception as exc:  # noqa: BLE001  (grpc's AioRpcError and kin)
        if type(exc).__name__ == "AioRpcError":
            return False
        raise
    raise ValueError(f"unsupported probe or handler: {sorted(handler)}")
