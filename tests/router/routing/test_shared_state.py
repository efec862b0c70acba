"""Two routing cores sharing state through a real Redis server (started here on a
free loopback port), including Redis going away and coming back. No mocks."""

import asyncio
import shutil
import socket
import subprocess
import time

import pytest

from services.router.routing import PodSpec, RouteRequest, RoutingCore, RoutingSettings

PODS = [PodSpec("10.0.0.1:1"), PodSpec("10.0.0.2:1"), PodSpec("10.0.0.3:1")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    subprocess.run([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--daemonize", "yes"], check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail("redis-server did not start")


def stop_redis(port):
    subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"],
                   capture_output=True, timeout=10)


@pytest.fixture
def redis_port():
    port = free_port()
    start_redis(port)
    yield port
    stop_redis(port)


def core_for(port, replica):
    settings = RoutingSettings(block_size=4, redis_url=f"redis://127.0.0.1:{port}/0",
                               replica_id=replica)
    core = RoutingCore(settings, PODS)
    core.state.refresh_s = 0.05
    core.state.retry_s = 0.1
    return core


async def test_replicas_share_bindings_and_load(redis_port):
    a, b = core_for(redis_port, "ra"), core_for(redis_port, "rb")
    await a.start()
    await b.start()
    try:
        now = time.monotonic()
        tokens = list(range(40))
        d1 = await a.route(RouteRequest(tokens, session="s1"), now)
        # Replica b has never seen s1 nor its blocks, yet routes it to the same pod.
        d2 = await b.route(RouteRequest(tokens + [1, 2, 3, 4], session="s1"), now)
        assert d2.decode_pod == d1.decode_pod and d2.reason == "sticky"
        # b sees a's in-flight load once its refresh ran.
        await asyncio.sleep(0.2)
        loads = await b.state.loads()
        assert loads[d1.decode_pod].in_flight == 2  # one from a, one from b
        await a.release(d1)
        await asyncio.sleep(0.2)
        assert (await b.state.loads())[d1.decode_pod].in_flight == 1
        await b.release(d2)
    finally:
        await a.close()
        await b.close()


async def test_redis_loss_and_return(redis_port):
    a, b = core_for(redis_port, "ra"), core_for(redis_port, "rb")
    await a.start()
    await b.start()
    try:
        assert a.state.up and b.state.up
        stop_redis(redis_port)
        await asyncio.sleep(0.3)
        # Both keep serving on local state.
        d = await a.route(RouteRequest(list(range(40)), session="during-outage"),
                          time.monotonic())
        assert not a.state.up and a.state.outages == 1
        again = await a.route(RouteRequest(list(range(44)), session="during-outage"),
                              time.monotonic())
        assert again.decode_pod == d.decode_pod  # local binding holds
        start_redis(redis_port)
        deadline = time.monotonic() + 10
        while not (a.state.up and b.state.up):
            assert time.monotonic() < deadline, "replicas did not reconnect"
            await asyncio.sleep(0.05)
        # a re-synced the binding it made during the outage: b now sees it.
        d_b = await b.route(RouteRequest(list(range(48)), session="during-outage"),
                            time.monotonic())
        assert d_b.decode_pod == d.decode_pod and d_b.reason == "sticky"
        await asyncio.sleep(0.2)
        assert (await b.state.loads())[d.decode_pod].in_flight == 3  # a's two + b's one
        for x in (d, again):
            await a.release(x)
        await b.release(d_b)
    finally:
        await a.close()
        await b.close()
