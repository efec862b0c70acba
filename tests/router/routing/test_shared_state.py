"""Two routing cores sharing state through a real Redis server (started on a free
loopback port by tests/router/conftest.py), including Redis going away and
coming back. No mocks."""

import asyncio
import logging
import time

import redis

from services.router.routing import PodSpec, RouteRequest, RoutingCore, RoutingSettings
from services.router.routing.policy import Binding
from services.router.routing.shared_state import RedisState

PODS = [PodSpec("10.0.0.1:1"), PodSpec("10.0.0.2:1"), PodSpec("10.0.0.3:1")]
# Not the 0.25-s default: on a loaded test machine a slow reply would count as
# Redis lost. The outages here are real (connection refused or reset), never slow.
TIMEOUT_S = 2.0


def core_for(redis, replica):
    settings = RoutingSettings(block_size=4, redis_url=redis.url, replica_id=replica,
                               redis_timeout_s=TIMEOUT_S)
    core = RoutingCore(settings, PODS)
    core.state.refresh_s = 0.05
    core.state.retry_s = 0.1
    return core


async def test_replicas_share_bindings_and_load(redis_server):
    a, b = core_for(redis_server, "ra"), core_for(redis_server, "rb")
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


async def test_redis_loss_and_return(redis_server):
    a, b = core_for(redis_server, "ra"), core_for(redis_server, "rb")
    await a.start()
    await b.start()
    try:
        assert a.state.up and b.state.up
        redis_server.stop()
        await asyncio.sleep(0.3)
        # Both keep serving on local state.
        d = await a.route(RouteRequest(list(range(40)), session="during-outage"),
                          time.monotonic())
        assert not a.state.up and a.state.outages == 1
        again = await a.route(RouteRequest(list(range(44)), session="during-outage"),
                              time.monotonic())
        assert again.decode_pod == d.decode_pod  # local binding holds
        redis_server.start()
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
        await asyncio.gather(*(a.set_binding(f"s{i}", Binding("p1")) for i in range(8)))
        await a.set_binding("moved", Binding("p1"))
        redis_server.kill()
        await wait_until(lambda: not (a.up or b.up), "the outage went unnoticed")
        await b.set_binding("moved", Binding("p2"))  # b re-binds it while Redis is away
        redis_server.start()
        await wait_up(a, b)
        for i in range(8):
            assert await b.get_binding(f"s{i}") == Binding("p1")  # restored by a
        assert await a.get_binding("moved") == Binding("p2")  # a's older one not written over
        await asyncio.gather(*(a.get_binding(f"s{i}") for i in range(8)))
        await asyncio.sleep(0.2)  # background refreshes on every pooled connection
        assert a.up and b.up and (a.outages, b.outages) == (1, 1)
    finally:
        await a.close()
        await b.close()


async def test_unreachable_at_start_is_logged_then_synced(redis_servers, caplog):
    server = redis_servers()  # its port is chosen, nothing listens there yet
    state = RedisState(server.url, "rs", timeout_s=TIMEOUT_S, refresh_s=0.05, retry_s=0.1)
    logger = logging.getLogger("tandem.router.routing.shared_state")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            await state.start()
            assert not state.up and "unreachable" in caplog.text
            await state.set_binding("s", Binding("p1"))  # served on local state
            assert await state.get_binding("s") == Binding("p1")
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
        await b.add_load("p1", 1, 100)
        assert await a._try_resync()
        assert (await a.loads())["p1"].in_flight == 1
        redis_server.kill()
        assert await a.get_binding("x") is None and not a.up
        await wait_until(lambda: not b.up, "b did not notice the outage")
        await b.add_load("p1", -1, -100)  # the request ends while Redis is away
        redis_server.start()
        await wait_up(b)
        assert await a._try_resync()
        assert (await a.loads())["p1"].in_flight == 0
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
        await a.add_load("p1", 1, 0)
        await asyncio.sleep(0.3)
        assert (await b.loads())["p1"].in_flight == 1
    finally:
        await a.close()
        await b.close()
