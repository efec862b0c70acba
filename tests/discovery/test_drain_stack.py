"""Drain with the real stack, the fake API server standing in for the cluster.

One prefill and two decode engines (real vLLM on CPU, KV over NIXL) behind
the real router process, which finds them through the EndpointSlices in the
fake API server (``--discovery kubernetes``); the real operator reconciles the
TandemDeployment. No kubelet or controller-manager runs, so the test does
their part: it writes the engine and router Pod objects (pointing at the real
processes) and their EndpointSlices, deletes the pod the ReplicaSet
controller would pick, marks its endpoint terminating and sends SIGTERM to
its engine.

``test_scale_down_while_streaming``: sessions stream while the decode pool
goes from 2 to 1 replicas; the operator prices the pods from the router's
/metrics, the cheaper one goes, no request fails and the prefill holds no KV
lease afterwards. ``test_prefill_waits_for_its_kv_leases_on_sigterm``: a
prefill engine told to stop while a lease is open exits only once a decode
pulled that KV.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import pytest

from common.ports import free_port
from common.procs import Processes, stop_process_group, wait_http_ok
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from operators.manifests import DELETION_COST
from services.stack import Stack, StackConfig
from tests.discovery.slices import Slices, discovery_router_argv, endpoint, endpoint_slice
from tests.helpers import MODEL_NAME, engine_load
from tests.kube.plugin import start_operator, wait_for

pytestmark = [pytest.mark.stack, pytest.mark.timeout(1800)]

HOST = "127.0.0.1"
TD = {
    "apiVersion": "tandem.dev/v1alpha1",
    "kind": "TandemDeployment",
    "metadata": {"name": "demo", "namespace": "default"},
    "spec": {
        "model": {"path": "/models/smollm2"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "kvStore": {"enabled": False},
    },
}
# A stranded lease would show for minutes; drained ones go at once. Longer
# than the slowest KV pull seen on a loaded 2-core machine (~3 min, with two
# engines bound to one core: docs/known-problems.md), during which the
# waiting decode's heartbeats, sent from its stalled steps, stall too.
# These tests are about who ends a lease, not how fast a pull is.
KV_LEASE_S = 300
# Each stream decodes about this long at the rate one request decodes alone:
# long enough to outlast the start of the others and the scale-down, short
# enough to end inside the grace period once five share two engines. Sized in
# seconds, not tokens: a 2-core machine decodes several times faster idle than loaded.
STREAM_S = 30
STREAM_TOKENS = (96, 1800)  # the bounds: max_model_len is 2048
PRESTOP_S = 1.0  # the pod's preStop sleep: the router sees `terminating` first


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    state = tmp_path_factory.mktemp("drain-stack")
    stack = Stack(
        StackConfig(
            prefill=1,
            decode=2,
            kv_store=False,
            router=False,
            kv_cache_gib=1,
            max_model_len=2048,
            state_dir=state,
            engine_args=["--kv-lease-s", str(KV_LEASE_S), "--shutdown-grace-s", "400"],
        )
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def proc_of(stack: Stack, name: str):
    return next(p for p in stack.procs if p.name == name)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def kv_ports(proc) -> tuple[int, int]:
    pub, replay = proc.kv_events.split(",")
    return port_of(pub), port_of(replay)


class Cluster:
    """The fake API server's objects for the engines and the router: what
    the ReplicaSet controller, the kubelet and the EndpointSlice controller write."""

    def __init__(self, kube_api, stack: Stack) -> None:
        self.api = kube_api
        self.stack = stack
        self.slices = Slices(kube_api)
        self.pod_kind = kube_api.store.kind("", "v1", "pods")

    def template(self, deployment: str) -> dict:
        return self.api.get("apps", "v1", "deployments", "default", deployment)["spec"]["template"]

    def create_pod(self, name: str, deployment: str, ports: dict[str, int]) -> None:
        template = json.loads(json.dumps(self.template(deployment)))
        container = template["spec"]["containers"][0]
        container["ports"] = [{"name": n, "containerPort": p} for n, p in ports.items()]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": template["metadata"]["labels"],
            },
            "spec": {**template["spec"], "nodeName": "node-1"},
            "status": {"phase": "Running", "podIP": HOST, "podIPs": [{"ip": HOST}]},
        }
        self.api.call(lambda: self.api.store.create(self.pod_kind, "default", pod))

    def engine_pod(self, proc, role: str) -> str:
        """The Pod and EndpointSlice of a running engine process; the pod's name."""
        name = f"demo-{role}-{proc.name.split('-')[1]}"
        pub, replay = kv_ports(proc)
        self.create_pod(
            name,
            f"demo-{role}",
            {"grpc": port_of(proc.grpc), "kv-events": pub, "kv-replay": replay},
        )
        self.put_slice(proc, role, name, "ready")
        return name

    def put_slice(self, proc, role: str, pod: str, state: str) -> None:
        # One slice per engine: they share an IP, so each needs its own ports.
        pub, replay = kv_ports(proc)
        self.slices.put(
            endpoint_slice(
                f"{pod}-slice",
                role,
                port_of(proc.grpc),
                [endpoint(HOST, pod, state)],
                kv_events_port=pub,
                kv_replay_port=replay,
            )
        )

    def pod(self, name: str) -> dict:
        return self.api.get("", "v1", "pods", "default", name)

    def delete_pod(self, name: str, grace: int | None = None) -> None:
        options = {} if grace is None else {"gracePeriodSeconds": grace}
        self.api.call(lambda: self.api.store.delete(self.pod_kind, "default", name, options))


async def stream(
    client: httpx.AsyncClient,
    url: str,
    sid: str,
    max_tokens: int,
    outcomes: list,
    decoding: asyncio.Event | None = None,
) -> list[float]:
    """One long streamed answer; records (ok, detail), sets ``decoding`` at its
    first token and returns the times its tokens arrived."""
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Session {sid}: tell me a long story."}],
    }
    finish, arrivals = None, []
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": sid}
        ) as r:
            if r.status_code != 200:
                outcomes.append((False, f"stream {sid}: {r.status_code} {await r.aread()}"))
                return arrivals
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcomes.append((False, f"stream {sid}: {chunk['error']}"))
                        return arrivals
                    for choice in chunk["choices"]:
                        if choice["delta"].get("content"):
                            arrivals.append(time.monotonic())
                            if decoding is not None:
                                decoding.set()
                        finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        outcomes.append((False, f"stream {sid}: {exc!r}"))
        return arrivals
    outcomes.append((finish == "length", f"stream {sid}: finish {finish}, {len(arrivals)} chunks"))
    return arrivals


async def stream_tokens(client: httpx.AsyncClient, url: str, outcomes: list) -> int:
    """max_tokens for a stream of about STREAM_S seconds, from the rate one
    request decodes alone on this machine now."""
    arrivals = await stream(client, url, "probe", 32, outcomes)
    assert len(arrivals) >= 2, outcomes
    rate = (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-3)
    low, high = STREAM_TOKENS
    return max(low, min(high, int(rate * STREAM_S)))


async def short_requests(
    client: httpx.AsyncClient, url: str, stop: asyncio.Event, outcomes: list
) -> None:
    """New requests one after another until ``stop``: each must succeed."""
    i = 0
    while not stop.is_set():
        i += 1
        try:
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"Short question {i}?"}],
                },
            )
            outcomes.append((r.status_code == 200, f"short {i}: {r.status_code} {r.text[:200]}"))
        except httpx.HTTPError as exc:
            outcomes.append((False, f"short {i}: {exc!r}"))


async def router_pods(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(f"{url}/health")).json()["pods"]


def test_scale_down_while_streaming(engines, kube_api, kubectl, tmp_path):
    procs = Processes(tmp_path)
    operator = start_operator(kube_api, tmp_path, resync=1.0)
    try:
        operator.wait_ready()
        kube_api.install(TD)
        wait_for(
            lambda: (
                {
                    d["metadata"]["name"]
                    for d in kube_api.list("apps", "v1", "deployments", "default")
                }
                >= {"demo-router", "demo-decode", "demo-prefill"}
            ),
            what="workloads",
        )
        cluster = Cluster(kube_api, engines)
        prefill = proc_of(engines, "prefill-0")
        decodes = {
            cluster.engine_pod(proc_of(engines, f"decode-{i}"), "decode"): proc_of(
                engines, f"decode-{i}"
            )
            for i in (0, 1)
        }
        cluster.engine_pod(prefill, "prefill")

        port = free_port()
        url = f"http://{HOST}:{port}"
        router, _ = procs.launch(
            "router",
            discovery_router_argv(
                HOST,
                port,
                kube_api.kubeconfig,
                # Every prompt through the prefill pod: each leaves a KV lease there.
                "--remote-prefill-threshold",
                "0",
                "--poll-interval-s",
                "0.5",
                "--shutdown-grace-s",
                "30",
            ),
            env={"TANDEM_LOG_LEVEL": "INFO"},
        )
        wait_http_ok(f"{url}/health", router, time.monotonic() + 600)
        cluster.create_pod("demo-router-0", "demo-router", {"http": port})

        figures = asyncio.run(drive(cluster, kubectl, url, decodes))
        print(f"\ndrain figures: {figures}")
        # No lease left behind: the prefill engine is idle with no KV held
        # long before the leases (KV_LEASE_S) could have run out.
        wait_for(lambda: engine_load(prefill.grpc).kv_cache_usage == 0.0, 15, "prefill KV freed")
    finally:
        procs.stop_all()
        operator.stop()
        print(f"\n--- operator log ---\n{operator.output()[-6000:]}")


async def drive(cluster: Cluster, kubectl, url: str, decodes: dict) -> dict:
    address = {name: proc.grpc for name, proc in decodes.items()}
    outcomes: list = []
    # No keep-alive: a pooled connection left idle past the router's
    # keep-alive timeout can be closed as the next /health poll reuses it.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await until_async(lambda: _all_available(client, url, set(address.values())), 60)
        max_tokens = await stream_tokens(client, url, outcomes)
        # Long sessions until the two decode pods carry different loads.
        streams = []
        for i in range(5):
            decoding = asyncio.Event()
            task = asyncio.create_task(stream(client, url, f"s{i}", max_tokens, outcomes, decoding))
            streams.append(task)
            # A P/D prefill can take longer than a stream lasts on a fast
            # machine: wait for this stream's first token, not a count.
            first = asyncio.create_task(decoding.wait())
            await asyncio.wait({task, first}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
            assert decoding.is_set(), (f"stream s{i} never decoded", outcomes)
            pods = await router_pods(client, url)
            loads = {n: pods[a]["in_flight"] for n, a in address.items()}
            if i >= 2 and len(set(loads.values())) == 2:
                break
        cheaper = min(loads, key=lambda n: loads[n])

        # Scale down: the operator prices the pods before lowering replicas.
        scaled = time.monotonic()
        await asyncio.to_thread(kubectl, "scale", "enginepool/demo-decode", "--replicas", "1")
        costs = await asyncio.to_thread(
            wait_for, lambda: _costs(cluster, decodes), 60, "deletion costs"
        )
        # New requests keep coming from now until the pod is gone.
        stop = asyncio.Event()
        shorts = asyncio.create_task(short_requests(client, url, stop, outcomes))
        pods = await router_pods(client, url)
        in_flight_at_scale = sum(pods[a]["in_flight"] for a in address.values())
        # Costs first, then the lower count: the order the operator writes them.
        await asyncio.to_thread(
            wait_for,
            lambda: (
                cluster.api.get("apps", "v1", "deployments", "default", "demo-decode")["spec"][
                    "replicas"
                ]
                == 1
            ),
            30,
            "decode Deployment at 1 replica",
        )
        # The ReplicaSet controller deletes the pod with the lowest cost.
        victim = min(costs, key=lambda n: costs[n])
        assert victim == cheaper, (costs, loads)
        cluster.delete_pod(victim)  # graceful: deletionTimestamp, as for a bound pod
        # The kubelet: the endpoint turns terminating, preStop, then SIGTERM.
        cluster.put_slice(decodes[victim], "decode", victim, "terminating")
        await until_async(lambda: _state(client, url, address[victim], "draining"), 30)
        await asyncio.sleep(PRESTOP_S)
        sigterm = time.monotonic()
        os.kill(decodes[victim].pid, signal.SIGTERM)
        in_flight_on_victim = (await router_pods(client, url))[address[victim]]["in_flight"]
        await until_async(lambda: _exited(decodes[victim].pid), 300)
        drained_s = time.monotonic() - sigterm
        cluster.slices.delete(f"{victim}-slice")
        cluster.delete_pod(victim, grace=0)
        await until_async(lambda: _gone(client, url, address[victim]), 30)
        await asyncio.gather(*streams)
        stop.set()
        await shorts
    failures = [detail for ok, detail in outcomes if not ok]
    assert failures == []
    return {
        "sessions_streaming": len(streams),
        "stream_tokens": max_tokens,
        "loads_before": loads,
        "deletion_costs": costs,
        "removed": victim,
        "in_flight_at_scale_down": in_flight_at_scale,
        "in_flight_on_removed_at_sigterm": in_flight_on_victim,
        "requests": len(outcomes),
        "failed": len(failures),
        "sigterm_to_exit_s": round(drained_s, 2),
        "scale_to_exit_s": round(time.monotonic() - scaled, 2),
    }


async def until_async(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out: {check}"
        await asyncio.sleep(0.1)


async def _all_available(client, url, addresses) -> bool:
    pods = await router_pods(client, url)
    return all(pods.get(a, {}).get("state") == "available" for a in addresses)


async def _state(client, url, address, state) -> bool:
    return (await router_pods(client, url)).get(address, {}).get("state") == state


async def _gone(client, url, address) -> bool:
    return address not in await router_pods(client, url)


async def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie: exited, not yet reaped by its parent (the stack).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def _costs(cluster: Cluster, decodes: dict) -> dict[str, int] | None:
    found = {}
    for name in decodes:
        annotations = cluster.pod(name)["metadata"].get("annotations") or {}
        if DELETION_COST not in annotations:
            return None
        found[name] = int(annotations[DELETION_COST])
    return found


def test_prefill_waits_for_its_kv_leases_on_sigterm(engines):
    prefill, decode = proc_of(engines, "prefill-0"), proc_of(engines, "decode-0")
    if not _alive(decode.pid):  # the scale-down test stopped it
        decode = proc_of(engines, "decode-1")
    tokens = list(range(1000, 1400))  # 400 prompt tokens: several KV blocks
    sampling = pb.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(prefill.grpc) as channel:
        reply = pb_grpc.EngineStub(channel).Prefill(
            pb.PrefillRequest(request_id="lease-1", token_ids=tokens, sampling_params=sampling),
            timeout=120,
        )
    assert reply.kv_transfer_params_json
    sigterm = time.monotonic()
    os.kill(prefill.pid, signal.SIGTERM)
    time.sleep(3)
    assert _alive(prefill.pid), "the prefill engine exited with a KV lease open"
    with open(prefill.log) as f:
        log = f.read()
    # Exactly one: none was left behind by the scale-down test before.
    assert "waiting for 1 KV lease(s)" in log
    asked = time.monotonic()
    with grpc.insecure_channel(decode.grpc) as channel:
        out = list(
            pb_grpc.EngineStub(channel).Generate(
                pb.GenerateRequest(
                    request_id="lease-1",
                    token_ids=tokens,
                    sampling_params=sampling,
                    kv_transfer_params_json=reply.kv_transfer_params_json,
                ),
                timeout=KV_LEASE_S,
            )
        )
    assert out[-1].finish_reason == "length"
    pulled = time.monotonic()
    wait_for(lambda: not _alive(prefill.pid), 30, "prefill exit")
    exited = time.monotonic()
    print(
        f"\nprefill SIGTERM -> exit {exited - sigterm:.1f}s; decode pull + 4 tokens "
        f"{pulled - asked:.1f}s; KV pulled -> exit {exited - pulled:.1f}s"
    )
    with open(prefill.log) as f:
        log = f.read()
    # The waiting decode's heartbeats renew the lease, so a slow pull (a
    # loaded machine) does not expire it: the prefill must leave because the
    # KV was pulled, and right after. (The log also holds the scale-down
    # test's requests; vLLM suffixes request ids.)
    expired = [
        line
        for line in log.splitlines()
        if "Releasing expired KV blocks for request lease-1" in line
    ]
    assert expired == []
    assert exited - pulled < 20
    stop_process_group(prefill, 5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
