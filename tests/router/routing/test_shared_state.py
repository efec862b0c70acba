"""Two routing cores sharing state through a real Redis server (started on a free
loopback port by tests/router/conftest.py), including Redis going away and
coming back. No mocks."""

import asyncio
import logging
import time

import pytest
import redis

from services.router.routing import (
    PodLoad,
    PodSpec,
    Replica,
    RouteRequest,
    RoutingCore,
    RoutingSettings,
    StateWrites,
    shared_state,
)
from services.router.routing.policy import Binding
from services.router.routing.shared_state import LocalState, RedisState

PODS = [PodSpec("10.0.0.1:1"), PodSpec("10.0.0.2:1"), PodSpec("10.0.0.3:1")]
# Not the 0.25-s default: on a loaded test machine a slow reply would count as
# Redis lost. The outages here are real (connection refused or reset), never slow.
TIMEOUT_S = 2.0


def replica_for(redis, name):
    """A routing core with its own RedisState, as one router replica has."""
    core = RoutingCore(RoutingSettings(block_size=4), PODS)
    for pod in PODS:
        core.update_pod(pod.name, 0.0, healthy=True)
    return Replica(
        core, RedisState(redis.url, name, timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    )


async def others_load(state, pod):
    """The other replicas' in-flight count on ``pod``, as ``state`` last read it."""
    return (await state.read(None, time.monotonic())).loads.get(pod, PodLoad()).in_flight


async def test_replicas_share_bindings_and_load(redis_server):
    a, b = replica_for(redis_server, "ra"), replica_for(redis_server, "rb")
    await a.state.start()
    await b.state.start()
    try:
        now = time.monotonic()
        tokens = list(range(40))
        d1 = await a.route(RouteRequest(tokens, session="s1"), now)
        # Replica b has never seen s1 nor its blocks, yet routes it to the same pod.
        d2 = await b.route(RouteRequest(tokens + [1, 2, 3, 4], session="s1"), now)
        assert d2.decode_pod == d1.decode_pod and d2.reason == "sticky"
        # b sees a's in-flight load once its refresh ran (and its own, exactly).
        await asyncio.sleep(0.2)
        assert await others_load(b.state, d1.decode_pod) == 1
        assert b.core.local_load(d1.decode_pod).in_flight == 1
        await a.release(d1, time.monotonic())
        await asyncio.sleep(0.2)
        assert await others_load(b.state, d1.decode_pod) == 0
        await b.release(d2, time.monotonic())
    finally:
        await a.state.close()
        await b.state.close()


async def test_redis_loss_and_return(redis_server):
    a, b = replica_for(redis_server, "ra"), replica_for(redis_server, "rb")
    await a.state.start()
    await b.state.start()
    try:
        assert a.state.up and b.state.up
        redis_server.stop()
        await asyncio.sleep(0.3)
        # Both keep serving on local state.
        d = await a.route(RouteRequest(list(range(40)), session="during-outage"), time.monotonic())
        assert not a.state.up and a.state.outages == 1
        again = await a.route(
            RouteRequest(list(range(44)), session="during-outage"), time.monotonic()
        )
        assert again.decode_pod == d.decode_pod  # local binding holds
        redis_server.start()
        deadline = time.monotonic() + 10
        while not (a.state.up and b.state.up):
            assert time.monotonic() < deadline, "replicas did not reconnect"
            await asyncio.sleep(0.05)
        # a re-synced the binding it made during the outage: b now sees it.
        d_b = await b.route(
            RouteRequest(list(range(48)), session="during-outage"), time.monotonic()
        )
        assert d_b.decode_pod == d.decode_pod and d_b.reason == "sticky"
        await asyncio.sleep(0.2)
        # a re-wrote the load it took on during the outage: b sees both requests.
        assert await others_load(b.state, d.decode_pod) == 2
        for x in (d, again):
            await a.release(x, time.monotonic())
        await b.release(d_b, time.monotonic())
    finally:
        await a.state.close()
        await b.state.close()


async def wait_until(condition, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def wait_up(*states):
    await wait_until(lambda: all(s.up for s in states), "did not reconnect")


async def test_redis_back_empty_gets_every_binding_back(redis_server):
    """Redis restarted without persistence comes back empty. Each replica writes
    back every binding it holds, not only those made during the outage, yet
    never over a binding another replica made meanwhile; its pooled
    connections to the old server do not count as a second outage."""
    a = RedisState(redis_server.url, "ra", timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    b = RedisState(redis_server.url, "rb", timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    await a.start()
    await b.start()
    try:
        # Concurrent writes: several pooled connections, as under load.
        now = time.monotonic()
        await asyncio.gather(*(a.set_binding(f"s{i}", Binding("p1"), now) for i in range(8)))
        await a.set_binding("moved", Binding("p1"), now)
        redis_server.kill()
        await wait_until(lambda: not (a.up or b.up), "the outage went unnoticed")
        await b.set_binding("moved", Binding("p2"), now)  # b re-binds it while Redis is away
        redis_server.start()
        await wait_up(a, b)
        for i in range(8):
            assert await b.get_binding(f"s{i}", now) == Binding("p1")  # restored by a
        assert await a.get_binding("moved", now) == Binding("p2")  # a's older one not written over
        await asyncio.gather(*(a.get_binding(f"s{i}", now) for i in range(8)))
        await asyncio.sleep(0.2)  # background refreshes on every pooled connection
        assert a.up and b.up and (a.outages, b.outages) == (1, 1)
    finally:
        await a.close()
        await b.close()


async def test_unreachable_at_start_is_logged_then_synced(redis_servers, caplog):
    server = redis_servers()  # its port is chosen, nothing listens there yet
    state = RedisState(server.url, "rs", timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    logger = shared_state.log
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            await state.start()
            assert not state.up and "unreachable" in caplog.text
            now = time.monotonic()
            await state.set_binding("s", Binding("p1"), now)  # served on local state
            assert await state.get_binding("s", now) == Binding("p1")
            server.start()
            await wait_up(state)
            assert "re-synced (1 bindings made while unreachable" in caplog.text
        db = redis.Redis(port=server.port, decode_responses=True)
        assert db.get("tandem:sess:s") == "p1|"
        db.close()
    finally:
        logger.removeHandler(caplog.handler)
        await state.close()


async def test_resync_reads_the_other_replicas_load_afresh(redis_server):
    """Coming back, a replica reads the others' load anew rather than using the
    view from before the outage (requests that ended meanwhile would count
    until its next refresh). ``a`` runs only the re-sync step, no background task."""
    a = RedisState(redis_server.url, "ra", timeout_s=TIMEOUT_S)
    b = RedisState(redis_server.url, "rb", timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    await b.start()
    try:
        now = time.monotonic()
        await b.write(StateWrites({"p1": PodLoad(1, 100)}), now)
        assert await a._try_resync()
        assert await others_load(a, "p1") == 1
        redis_server.kill()
        assert await a.get_binding("x", now) is None and not a.up
        await wait_until(lambda: not b.up, "b did not notice the outage")
        await b.write(StateWrites({"p1": PodLoad()}), now)  # the request ends while Redis is away
        redis_server.start()
        await wait_up(b)
        assert await a._try_resync()
        assert await others_load(a, "p1") == 0
    finally:
        await a.close()
        await b.close()


async def test_an_idle_replica_is_not_taken_for_gone(redis_server):
    """A replica that has routed nothing yet stays in the replica set, so its
    first requests count in the others' view at their next refresh (not at its
    next heartbeat, seconds later)."""
    a = RedisState(redis_server.url, "ra", timeout_s=TIMEOUT_S, refresh_s=0.05)
    b = RedisState(redis_server.url, "rb", timeout_s=TIMEOUT_S, refresh_s=0.05)
    await a.start()
    await b.start()
    try:
        await asyncio.sleep(0.3)  # b refreshes several times while a is idle
        await a.write(StateWrites({"p1": PodLoad(1, 0)}), time.monotonic())
        await asyncio.sleep(0.3)
        assert await others_load(b, "p1") == 1
    finally:
        await a.close()
        await b.close()


def test_local_bindings_are_bounded_and_expired_ones_go_first():
    state = LocalState(binding_ttl_s=10, max_sessions=3)
    for i in range(3):
        state.set_local_binding(f"s{i}", Binding(f"p{i}"), now=i)
    state.set_local_binding("s3", Binding("p3"), now=3)  # over the bound: s0 is evicted
    assert state.entries == 3 and state.evictions == 1
    assert state.local_binding("s0", now=3) is None
    # s1 and s2 expired by now=12.5: dropped as the next binding comes, not evicted.
    state.set_local_binding("s4", Binding("p4"), now=12.5)
    assert state.entries == 2 and state.evictions == 1
    assert state.local_binding("s3", now=12.5) == Binding("p3")
    with pytest.raises(ValueError):
        LocalState(max_sessions=0)


async def test_a_pod_without_load_leaves_no_fields_in_redis(redis_server):
    a = replica_for(redis_server, "ra")
    await a.state.start()
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        decision = await a.route(RouteRequest(list(range(40))), time.monotonic())
        key = "tandem:load:ra"
        assert client.hget(key, f"{decision.decode_pod}|r") == "1"
        await a.release(decision, time.monotonic())
        assert client.hgetall(key) == {"alive": "1"}
    finally:
        client.close()
        await a.state.close()


async def test_bindings_made_while_redis_is_down_are_bounded_too(redis_servers):
    server = redis_servers()  # never started: Redis is unreachable
    state = RedisState(server.url, "ra", timeout_s=TIMEOUT_S, max_sessions=2)
    try:
        for i in range(3):
            await state.set_binding(f"s{i}", Binding("p"), now=float(i))
        assert state.entries == 2 and state.evictions == 1
        # The evicted binding is not written back when Redis returns.
        assert state._dirty_sessions == {"s1", "s2"}
    finally:
        await state.close()
