"""Two router processes (``python -m services.router --redis-url``) sharing
session bindings and in-flight load through a real ``redis-server``, in front
of two fake gRPC engines (bench/router_fakes.py) whose every token is their
own name, so each answer says which pod served it. No mocks.

The sessions checked are placed by replica 1 on the pod that holds their
prefix (a seed request put that prefix there), which is *not* their
consistent-hash home. Replica 2 never saw that prefix, so the only way it can
send their next turns to the same pod is the binding it reads from Redis.

Then Redis is killed mid-traffic: both replicas keep answering every request
and log the loss. It is restarted empty (no persistence, like a Redis pod
without a volume): both replicas re-sync, writing back the bindings they hold
and their in-flight load, so sessions bound before and during the outage keep
their pod whichever replica serves them next.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis as redis_client
from prometheus_client.parser import text_string_to_metric_families

from bench import router_fakes
from bench.harness import RedisServer
from bench.router_fakes import MODEL_NAME
from common.model import resolve_model
from common.ports import free_port
from common.procs import Proc, Processes, wait_grpc_serving, wait_http_ok
from services.router.routing.hashring import bounded_load_choice

HOST = "127.0.0.1"
PODS = ("pod-a", "pod-b")  # each fake engine's token text
STARTUP_S = 120.0
# Fake engines answer in ~30 ms. A request slower than this stalled in a router
# (e.g. retrying a dead Redis with backoff); the margin is for scheduling delays
# on a loaded 2-core machine.
SLOW_S = 5.0
# A replica sees the others' in-flight load up to RedisState.refresh_s (0.2 s)
# late. Turns of one session that switch replicas, and placements after traffic
# on the other replica, wait longer than that: otherwise a request that just
# ended (e.g. the session's own previous turn) can still count as load on a pod,
# and with these fakes, which report no cache hits (so the router unlearns its
# predicted prefixes and counts whole prompts as pending prefill), that load can
# outweigh stickiness or a prefix hit in the cost policy.
SETTLE_S = 0.3


@dataclass
class Cluster:
    redis: RedisServer
    address: dict[str, str]  # pod name -> gRPC address
    routers: list[Proc]
    urls: list[str]
    pod_of: dict[str, str] = field(default_factory=dict)  # gRPC address -> pod name

    def home(self, sid: str) -> str:
        """The pod consistent hashing gives session ``sid`` on an idle cluster."""
        address, _ = bounded_load_choice(f"h:{sid}", list(self.address.values()), {})
        return self.pod_of[address]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    procs = Processes(logs)
    cpus = set(os.sched_getaffinity(0))
    model_dir = str(resolve_model(None))
    server = RedisServer(logs)
    server.start()
    try:
        address, fakes = {}, []
        for name in PODS:
            port = free_port()
            proc, _ = procs.launch(
                f"fake-{name}",
                router_fakes.command(
                    "grpc",
                    HOST,
                    str(port),
                    model_dir,
                    "--token-text",
                    name,
                ),
                cpus,
            )
            address[name] = f"{HOST}:{port}"
            fakes.append(proc)
        for name, proc in zip(PODS, fakes):
            wait_grpc_serving(address[name], proc, time.monotonic() + STARTUP_S)
        routers, urls = [], []
        env = {"TANDEM_LOG_LEVEL": "INFO", "TANDEM_LOG_FORMAT": "text"}
        for i in (1, 2):
            port = free_port()
            # --redis-timeout-s: not the 0.25-s default, which on a loaded test machine can
            # take a slow reply for a lost Redis. The outage here is real (killed), not slow.
            argv = [
                sys.executable,
                "-m",
                "services.router",
                "--host",
                HOST,
                "--port",
                str(port),
                "--redis-url",
                server.url,
                "--redis-timeout-s",
                "2",
                "--model",
                model_dir,
            ]
            for a in address.values():
                argv += ["--engine", a]
            proc, _ = procs.launch(f"router-{i}", argv, cpus, env=env)
            routers.append(proc)
            urls.append(f"http://{HOST}:{port}")
        for proc, url in zip(routers, urls):
            wait_http_ok(f"{url}/health", proc, time.monotonic() + STARTUP_S)
        yield Cluster(server, address, routers, urls, {a: n for n, a in address.items()})
    finally:
        procs.stop_all()
        server.kill()


# -- clients ---------------------------------------------------------------------


def system_prompt(tag: str) -> str:
    """~1000 tokens: several full KV blocks (128 tokens) that only this tag has."""
    return f"[{tag}] " + " ".join(
        f"Rule {i} of {tag}: answer briefly, cite file {tag}-{i}." for i in range(60)
    )


async def chat(
    client: httpx.AsyncClient, url: str, sid: str, messages: list[dict], max_tokens: int = 1
) -> httpx.Response:
    return await client.post(
        f"{url}/v1/chat/completions",
        headers={"x-session-id": sid},
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens},
    )


class Session:
    def __init__(self, sid: str, system: str) -> None:
        self.sid = sid
        self.messages = [{"role": "system", "content": system}]
        self.pods: list[str] = []  # the pod of each turn

    async def turn(self, client: httpx.AsyncClient, url: str) -> str:
        self.messages.append({"role": "user", "content": f"turn {len(self.pods) + 1}"})
        r = await chat(client, url, self.sid, self.messages)
        assert r.status_code == 200, f"{self.sid} via {url}: {r.status_code} {r.text}"
        pod = r.json()["choices"][0]["message"]["content"]
        assert pod in PODS, pod
        self.messages.append({"role": "assistant", "content": pod})
        self.pods.append(pod)
        return pod


def sid_where(
    c: Cluster, stem: str, home_is: str | None = None, home_is_not: str | None = None
) -> str:
    for i in range(1000):
        sid = f"{stem}-{i}"
        home = c.home(sid)
        if (home_is is None or home == home_is) and (home_is_not is None or home != home_is_not):
            return sid
    raise AssertionError("no session id with that home")


async def wait_idle_view(client, c: Cluster, url: str, timeout_s: float = 10.0) -> None:
    """Until replica ``url`` sees no request on any pod, its own or polled.

    The engines' load is polled (each second): a request that just ended can
    still count as running on its pod until the next poll, and a loaded pod
    is passed over by bounded-load hashing, so a new session's pod is its
    hash home only once that view is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get(f"{url}/metrics")).text
        assert "tandem_router_pod_engine_requests{" in text
        busy = {pod: 0.0 for pod in PODS}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (
                    "tandem_router_pod_in_flight",
                    "tandem_router_pod_engine_requests",
                ):
                    busy[c.pod_of[sample.labels["pod"]]] += sample.value
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"{url} still sees load {busy}"
        await asyncio.sleep(0.1)


async def seed(client, c: Cluster, url: str, pod: str, tag: str) -> str:
    """Put a fresh system prompt on ``pod`` through replica ``url``; returns it."""
    system = system_prompt(tag)
    await wait_idle_view(client, c, url)
    s = Session(sid_where(c, f"seed-{tag}", home_is=pod), system)
    assert await s.turn(client, url) == pod  # a new session with nothing cached: its home
    return system


async def placed_off_home(
    client, c: Cluster, url: str, pod: str, system: str, stem: str
) -> Session:
    """A new session whose home is the *other* pod, placed on ``pod`` (which holds
    its prefix, ``system``) by replica ``url``.

    One per seed: the fake engines report no cached tokens, so the router
    forgets the seeded prefix after this request."""
    s = Session(sid_where(c, stem, home_is_not=pod), system)
    assert await s.turn(client, url) == pod, "replica 1 did not follow the prefix"
    return s


async def metric(client, url: str, name: str, **labels) -> float:
    text = (await client.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def log_size(proc: Proc) -> int:
    return Path(proc.log).stat().st_size


async def wait_logged(procs: list[Proc], since: list[int], text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [
            p.name
            for p, n in zip(procs, since)
            if text not in Path(p.log).read_text(errors="replace")[n:]
        ]
        if not missing:
            return
        assert time.monotonic() < deadline, f"{missing} never logged {text!r}"
        await asyncio.sleep(0.05)


# -- the tests -------------------------------------------------------------------


async def test_next_turns_follow_the_binding_across_replicas(cluster):
    c = cluster
    r1, r2 = c.urls
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.sleep(SETTLE_S)
        sticky_before = await metric(client, r2, "tandem_routing_decisions_total", reason="sticky")
        sessions = []
        for pod in PODS:
            for k in range(3):
                system = await seed(client, c, r1, pod, f"a-{pod}-{k}")
                sessions.append(await placed_off_home(client, c, r1, pod, system, f"a-{pod}-{k}"))
        assert all(c.home(s.sid) != s.pods[0] for s in sessions)
        assert {s.pods[0] for s in sessions} == set(PODS)
        for url in (r2, r2, r1, r2):
            await asyncio.sleep(SETTLE_S)
            for s in sessions:
                assert await s.turn(client, url) == s.pods[0], (s.sid, s.pods)
        # Replica 2 chose by the binding every time, not by prefix or hashing.
        sticky = await metric(client, r2, "tandem_routing_decisions_total", reason="sticky")
        assert sticky - sticky_before == 3 * len(sessions)


async def test_redis_killed_mid_traffic_then_restarted_empty(cluster):
    c = cluster
    r1, r2 = c.urls
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.sleep(SETTLE_S)
        # Bound by replica 1 alone before the outage; replica 2 never sees them until after.
        before = []
        for pod in PODS:
            system = await seed(client, c, r1, pod, f"b-{pod}")
            before.append(await placed_off_home(client, c, r1, pod, system, f"b-{pod}"))
        outage_prefix = {pod: await seed(client, c, r1, pod, f"o-{pod}") for pod in PODS}

        # Traffic on both replicas: sessions whose turns alternate between them.
        results: list[tuple[float, float, str, int, str]] = []
        stop = asyncio.Event()

        async def traffic(w: int) -> None:
            n = 0
            while not stop.is_set():
                sid, messages = f"traffic-{w}-{n}", [{"role": "system", "content": "Be terse."}]
                for t in range(4):
                    url = c.urls[(w + t) % 2]
                    messages.append({"role": "user", "content": f"step {t}"})
                    t0 = time.monotonic()
                    try:
                        r = await chat(client, url, sid, messages, max_tokens=2)
                        status, body = r.status_code, r.text
                    except httpx.HTTPError as err:
                        status, body = 0, repr(err)
                    results.append((t0, time.monotonic(), url, status, body))
                    messages.append({"role": "assistant", "content": "ok"})
                n += 1

        workers = [asyncio.create_task(traffic(w)) for w in range(3)]
        await asyncio.sleep(1.0)
        assert results, "no traffic before the outage"

        # (b) Kill Redis mid-traffic.
        since = [log_size(p) for p in c.routers]
        t_kill = time.monotonic()
        await asyncio.to_thread(c.redis.kill)  # the traffic's event loop keeps running
        await wait_logged(c.routers, since, "unreachable", timeout_s=10)
        for url in c.urls:
            assert await metric(client, url, "tandem_routing_shared_state_up") == 0
        # Replica 1 binds new sessions while Redis is away.
        during = [
            await placed_off_home(client, c, r1, pod, outage_prefix[pod], f"o-{pod}")
            for pod in PODS
        ]
        # A long request in flight across the restart (its load must reach the new Redis).
        async with client.stream(
            "POST",
            f"{r1}/v1/chat/completions",
            headers={"x-session-id": "long"},
            json={
                "model": MODEL_NAME,
                "stream": True,
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": "long"}],
            },
        ) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            long_pod = None
            while long_pod is None:
                line = await anext(lines)
                long_pod = next((pod for pod in PODS if pod in line), None)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*workers)
            t_restart = time.monotonic()

            # (c) Redis comes back empty; both replicas re-sync.
            since = [log_size(p) for p in c.routers]
            await asyncio.to_thread(c.redis.start)
            await wait_logged(c.routers, since, "re-synced", timeout_s=10)
            for url in c.urls:
                assert await metric(client, url, "tandem_routing_shared_state_up") == 1
            db = redis_client.Redis(port=c.redis.port, decode_responses=True)
            replicas = db.smembers("tandem:replicas")
            assert len(replicas) == 2
            in_flight = {pod: 0 for pod in PODS}
            for replica in replicas:
                for name, value in db.hgetall(f"tandem:load:{replica}").items():
                    pod_address, _, kind = name.rpartition("|")
                    if kind == "r":
                        in_flight[c.pod_of[pod_address]] += int(value)
            db.close()
            assert in_flight == {pod: int(pod == long_pod) for pod in PODS}, in_flight
        # (the long request is cancelled here, by closing its stream)

        # Every traffic request was answered, before and during the outage.
        bad = [r for r in results if r[3] != 200]
        assert not bad, f"{len(bad)}/{len(results)} failed, first: {bad[0]}"
        slow = [r for r in results if r[1] - r[0] > SLOW_S]
        assert not slow, f"{len(slow)} requests took over {SLOW_S}s: {slow[:3]}"
        in_outage = {
            url: sum(1 for t0, t1, u, *_ in results if u == url and t_kill < t0 and t1 < t_restart)
            for url in c.urls
        }
        assert all(n >= 3 for n in in_outage.values()), in_outage

        # Bindings made before and during the outage are in the new Redis: replica 2
        # sends their next turn to the same pod although their hash home is the other.
        for url in (r2, r1):
            await asyncio.sleep(SETTLE_S)
            for s in before + during:
                assert await s.turn(client, url) == s.pods[0], (s.sid, s.pods)


async def test_a_replica_sigkilled_holding_bindings_loses_none(cluster):
    """Last in this file: it kills replica 1. Its bindings were written to
    Redis as it made them, so replica 2 (the Service's other endpoint, where
    a client retries) sends the next turns to the same pods; and replica 1's
    in-flight count dies with it instead of pinning load on a pod."""
    c = cluster
    r1, r2 = c.urls
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.sleep(SETTLE_S)
        sessions = []
        for pod in PODS:
            system = await seed(client, c, r1, pod, f"k-{pod}")
            sessions.append(await placed_off_home(client, c, r1, pod, system, f"k-{pod}"))
        assert all(c.home(s.sid) != s.pods[0] for s in sessions)
        sticky_before = await metric(client, r2, "tandem_routing_decisions_total", reason="sticky")

        os.kill(c.routers[0].pid, signal.SIGKILL)
        await asyncio.to_thread(lambda: wait_until_dead(c.routers[0]))
        for _ in range(2):
            await asyncio.sleep(SETTLE_S)
            for s in sessions:
                assert await s.turn(client, r2) == s.pods[0], (s.sid, s.pods)
        sticky = await metric(client, r2, "tandem_routing_decisions_total", reason="sticky")
        assert sticky - sticky_before == 2 * len(sessions)


def wait_until_dead(proc: Proc, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.alive():
        assert time.monotonic() < deadline, f"{proc.name} still alive"
        time.sleep(0.05)
