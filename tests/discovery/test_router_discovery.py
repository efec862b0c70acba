"""The real router process (``python -m services.router --discovery
kubernetes``) following EndpointSlices in the fake API server (devcluster/,
real HTTP), in front of two fake gRPC engines (bench/router_fakes.py) whose
every token is their own name, so each answer says which pod served it.

A pod whose endpoint becomes ready gets requests without a restart (the test
prints how long after the write its first request was answered); a pod whose
endpoint turns terminating gets no new requests while the stream it serves
finishes; a pod whose endpoint is gone leaves the router's pod set.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from bench import router_fakes
from bench.router_fakes import MODEL_NAME
from common.model import resolve_model
from common.ports import free_port
from common.procs import Processes, wait_grpc_serving, wait_http_ok
from tests.discovery.slices import Slices, discovery_router_argv, endpoint, endpoint_slice
from tests.helpers import metric_value

HOST = "127.0.0.1"
STARTUP_S = 120.0
STREAM_TOKENS = 100
TOKEN_DELAY_MS = 20  # the long stream lasts ~2 s

pytestmark = pytest.mark.timeout(300)


async def answered_by(client: httpx.AsyncClient, url: str) -> str:
    r = await client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def stream_pods(client: httpx.AsyncClient, url: str) -> tuple[list[str], str]:
    """(the text of every chunk, the finish reason) of one long streamed answer."""
    texts, finish = [], ""
    async with client.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "a long one"}],
            "max_tokens": STREAM_TOKENS,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                texts.append(choice["delta"]["content"])
            finish = choice.get("finish_reason") or finish
    return texts, finish


async def health(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(f"{url}/health")).json()["pods"]


async def until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_router_follows_endpoint_slices(kube_api, tmp_path):
    procs = Processes(tmp_path)
    cpus = set(os.sched_getaffinity(0))
    model_dir = str(resolve_model(None))
    slices = Slices(kube_api)
    try:
        ports = {}
        for name in ("pod-a", "pod-b"):
            ports[name] = free_port()
            proc, _ = procs.launch(
                name,
                router_fakes.command(
                    "grpc",
                    HOST,
                    str(ports[name]),
                    model_dir,
                    "--token-text",
                    name,
                    "--first-token-ms",
                    "5",
                    "--token-delay-ms",
                    str(TOKEN_DELAY_MS),
                ),
                cpus,
            )
            wait_grpc_serving(f"{HOST}:{ports[name]}", proc, time.monotonic() + STARTUP_S)
        address = {name: f"{HOST}:{port}" for name, port in ports.items()}

        def pool_slice(name: str, state: str) -> dict:
            # One slice per fake: they listen on one IP, so each needs its own port.
            return endpoint_slice(
                f"demo-both-{name}", "both", ports[name], [endpoint(HOST, name, state)]
            )

        slices.put(pool_slice("pod-a", "ready"))
        port = free_port()
        url = f"http://{HOST}:{port}"
        router, _ = procs.launch(
            "router",
            discovery_router_argv(
                HOST,
                port,
                kube_api.kubeconfig,
                "--model",
                model_dir,
                "--routing-policy",
                "round-robin",
                "--poll-interval-s",
                "0.5",
                "--shutdown-grace-s",
                "5",
            ),
            cpus,
            env={"TANDEM_LOG_LEVEL": "INFO", "TANDEM_LOG_FORMAT": "text"},
        )
        wait_http_ok(f"{url}/health", router, time.monotonic() + STARTUP_S)

        async with httpx.AsyncClient(timeout=30) as client:
            assert set(await health(client, url)) == {address["pod-a"]}
            assert {await answered_by(client, url) for _ in range(4)} == {"pod-a"}
            long_stream = asyncio.create_task(stream_pods(client, url))

            async def a_streaming() -> bool:
                return (await health(client, url))[address["pod-a"]]["in_flight"] == 1

            await until(a_streaming)

            # A new engine becomes ready: it gets requests, no restart.
            written = time.perf_counter()
            slices.put(pool_slice("pod-b", "ready"))
            while await answered_by(client, url) != "pod-b":
                assert time.perf_counter() - written < 15, "pod-b never got a request"
            first_request_s = time.perf_counter() - written
            print(
                f"\nendpoint ready in the API server -> first request answered by it: "
                f"{first_request_s * 1000:.0f} ms"
            )

            # pod-a terminates while it streams: no new requests, the stream finishes.
            assert not long_stream.done()
            slices.put(pool_slice("pod-a", "terminating"))

            async def a_draining() -> bool:
                return (await health(client, url))[address["pod-a"]]["state"] == "draining"

            await until(a_draining)
            served = [await answered_by(client, url) for _ in range(10)]
            assert served == ["pod-b"] * 10
            texts, finish = await long_stream
            assert texts == ["pod-a"] * STREAM_TOKENS and finish == "length"

            # pod-a is gone: it leaves the router's pods.
            slices.delete("demo-both-pod-a")

            async def a_gone() -> bool:
                return set(await health(client, url)) == {address["pod-b"]}

            await until(a_gone)
            assert await answered_by(client, url) == "pod-b"
            metrics = (await client.get(f"{url}/metrics")).text
            for change, n in (("added", 1), ("draining", 1), ("removed", 1)):
                assert (
                    metric_value(
                        metrics, "tandem_router_discovery_changes_total", f'change="{change}"'
                    )
                    == n
                )
    finally:
        procs.stop_all()
