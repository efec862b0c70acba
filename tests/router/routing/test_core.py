"""RoutingCore, the seam the router calls: synchronous decisions over a view
of the shared state, and a pod set that changes at runtime. Local state, no
servers, no mocks."""

import random
from collections import Counter

import pytest

from services.router.routing import (
    NoPodAvailable,
    PodSpec,
    Replica,
    RouteRequest,
    RoutingCore,
    RoutingSettings,
    SharedView,
)
from services.router.routing.core import PodLoad
from services.router.routing.health import BreakerSettings
from services.router.routing.policy import Binding, PolicySettings
from services.router.routing.shared_state import LocalState

BS = 4


def make_core(pods=("a", "b"), roles=None, **kw):
    core = RoutingCore(
        RoutingSettings(block_size=BS, **kw),
        [PodSpec(p, (roles or {}).get(p, "both")) for p in pods],
    )
    for p in pods:
        core.update_pod(p, 0.0, healthy=True)
    return core


def replica(core):
    return Replica(core, LocalState())


def test_route_is_a_function_of_the_view_it_is_given():
    core = make_core()
    tokens = list(range(40))
    # A binding another replica wrote and the others' load are inputs, not reads.
    d = core.route(RouteRequest(tokens, session="s"), SharedView(Binding("b")), now=0.0)
    assert (d.decode_pod, d.reason) == ("b", "sticky")
    busy = SharedView(loads={"a": PodLoad(in_flight=50, pending_prefill_tokens=9000)})
    assert core.route(RouteRequest(tokens, session="t"), busy, now=0.0).decode_pod == "b"
    # What the store must learn comes back: this replica's load and the binding.
    assert d.writes.binding == ("s", Binding("b"))
    assert d.writes.loads == {"b": PodLoad(1, 40)}


async def test_predicted_index_for_pods_without_events():
    core = make_core()
    r = replica(core)
    tokens = list(range(40))
    d1 = await r.route(RouteRequest(tokens, session="s"), now=0.0)
    assert d1.predicted_cached_tokens == 0
    await r.report_prefill(d1, now=1.0)
    await r.release(d1, now=1.0)
    d2 = await r.route(RouteRequest(tokens + list(range(100, 110)), session="s"), now=2.0)
    assert d2.decode_pod == d1.decode_pod and d2.reason == "sticky"
    assert d2.predicted_cached_tokens == 40
    # Whatever the engine reports, the pod has just computed the whole prompt,
    # so the index keeps every block of it.
    await r.report_prefill(d2, now=3.0)
    await r.release(d2, now=3.0)
    assert core.index.match(d2.block_hashes, 4.0)[d1.decode_pod] == 50 // BS


async def test_pod_report_follows_polls_and_decisions():
    core = make_core(index_capacity=8)
    r = replica(core)
    core.index.stored("a", range(12))  # as KV events would: 12 blocks, room for 8
    d = await r.route(RouteRequest(list(range(40)), session="s"), now=0.0)
    core.update_pod("b", 0.2, healthy=True, kv_capacity_blocks=64)
    assert len(core.index) == 8 and core.index.evictions == 4  # capped by the LRU bound
    report = {p.name: p for p in core.report(0.3)}
    assert report["a"].cached_blocks == 8 and report["b"].cached_blocks == 0
    assert report["b"].kv_capacity_blocks == 64
    assert report[d.decode_pod].in_flight == 1
    assert report[d.decode_pod].pending_prefill_tokens == 40
    assert {p.state for p in report.values()} == {"available"}


def test_index_bound_follows_the_pods_kv(monkeypatch):
    # By default the index keeps as many hashes as the pods report KV blocks
    # (never fewer than the floor); a setting fixes the bound instead.
    monkeypatch.setattr("services.router.routing.core.INDEX_CAPACITY_FLOOR", 8)
    core = make_core(pods=("a", "b", "c"))
    assert core.index.capacity == 8
    core.update_pod("a", 0.1, healthy=True, kv_capacity_blocks=6)
    core.update_pod("b", 0.1, healthy=True, kv_capacity_blocks=6)
    assert core.index.capacity == 12
    core.index.stored("a", range(6))
    core.index.stored("b", range(100, 106))
    assert len(core.index) == 12 and core.index.evictions == 0
    core.update_pod("b", 0.2, healthy=True, kv_capacity_blocks=6)  # same report: no change
    core.mark_unhealthy("b", "UNAVAILABLE")  # a failed poll keeps the last report
    assert core.index.capacity == 12
    core.update_pod("c", 0.3, healthy=True, kv_capacity_blocks=2)
    assert core.index.capacity == 14
    core.remove_pod("b")  # its hashes go with it; the bound shrinks to a and c's
    assert core.index.capacity == 8 and len(core.index) == 6
    core.update_pod("a", 0.4, healthy=True, kv_capacity_blocks=3)  # a smaller KV
    assert core.index.capacity == 8  # the floor
    assert len(core.index) == 6

    fixed = make_core(pods=("a",), index_capacity=5)
    fixed.update_pod("a", 0.1, healthy=True, kv_capacity_blocks=600)
    assert fixed.index.capacity == 5


def test_index_shrinks_by_forgetting_the_least_recent():
    core = make_core(index_capacity=10)
    core.index.stored("a", range(10))
    core.index.match([0, 1], 0.0)  # 0 and 1 are used again
    core.index.resize(4)
    assert len(core.index) == 4 and core.index.evictions == 6
    assert core.index.match([0, 1], 0.0) == {"a": 2, "b": 0}


async def test_reported_kv_capacity_prices_evicting_live_sessions():
    # Pods of 10 blocks (40 tokens). Two live sessions of 8 blocks each, one per
    # pod; a third, new, session of 6 blocks fits nowhere without evicting.
    core = make_core()
    r = replica(core)
    for pod in ("a", "b"):
        core.update_pod(pod, 0.0, healthy=True, kv_capacity_blocks=10)
    s = await r.route(RouteRequest(list(range(32)), session="s"), now=0.0)
    t = await r.route(RouteRequest(list(range(100, 132)), session="t"), now=0.0)
    # The second avoided evicting the first (not its hash home by chance).
    assert t.decode_pod != s.decode_pod and t.reason == "new-cost"
    for d in (s, t):
        await r.report_prefill(d, now=0.5)
        await r.release(d, now=0.5)
    # s's next turn (its 8 blocks cached, 2 new): room for exactly 2 more on
    # its pod; it stays. The other pod has room for 2 only: moving would evict.
    s2 = await r.route(RouteRequest(list(range(40)), session="s"), now=1.0)
    assert (s2.decode_pod, s2.reason) == (s.decode_pod, "sticky")
    report = {p.name: p for p in core.report(1.5)}
    assert report[s.decode_pod].live_blocks == 10
    assert report[s.decode_pod].kv_capacity_blocks == 10
    # t idles past the live window: its blocks are no longer worth keeping.
    core.live.expire(now=1.0 + core.settings.live_session_window_s + 1)
    assert core.live.occupied_blocks(t.decode_pod, None) == 0


async def test_load_accounting_is_released_once():
    core = make_core(
        pods=("p", "d"),
        roles={"p": "prefill", "d": "decode"},
        policy=PolicySettings(remote_prefill_threshold=8),
    )
    r = replica(core)
    d = await r.route(RouteRequest(list(range(40))), now=0.0)
    assert (d.prefill_pod, d.decode_pod, d.local_prefill) == ("p", "d", None)
    assert core.local_load("p") == PodLoad(1, 40) and core.local_load("d") == PodLoad(1, 0)
    writes = core.report_prefill(d, now=1.0)
    assert writes.loads == {"p": PodLoad(0, 0)}  # the store learns the zero too
    assert core.local_load("p") == PodLoad()
    assert core.release(d).loads == {"d": PodLoad()}
    assert core.release(d).loads == {}
    assert core.local_load("d") == PodLoad()


@pytest.mark.parametrize("scope, local", [("request", 7), ("pod", 1)])
async def test_a_burst_of_forks_and_the_remote_prefill_scope(scope, local):
    """Seven forks of one cached context, routed before any has prefilled:
    each lacks 20 tokens of the decode pod's KV. Scope "request" prefills all
    seven there (140 tokens in one step); "pod" only while the pod's pending
    prefill plus the fork's stays under the threshold (32)."""
    core = make_core(
        pods=("p", "d"),
        roles={"p": "prefill", "d": "decode"},
        policy=PolicySettings(remote_prefill_threshold=32, remote_prefill_scope=scope),
    )
    r = replica(core)
    context = list(range(80))
    core.index.stored("d", core.hasher.event_hashes(context))
    forks = [
        await r.route(RouteRequest(context + [1000 + i] * 20, session=f"fork{i}"), now=0.0)
        for i in range(7)
    ]
    assert {d.decode_pod for d in forks} == {"d"}
    assert sum(d.prefill_pod is None for d in forks) == local
    assert core.local_load("d").pending_prefill_tokens == 20 * local


async def test_failures_eject_and_polls_recover():
    core = make_core(breaker=BreakerSettings(failure_threshold=2, open_s=5))
    r = replica(core)
    d = await r.route(RouteRequest(list(range(8)), session="s"), now=0.0)
    bad = d.decode_pod
    assert not await r.report_failure(d, bad, now=0.0)
    assert core.state_of(bad, 0.0) == "unhealthy"  # until the next poll
    core.update_pod(bad, 0.05, healthy=True)
    retry = await r.route(
        RouteRequest(list(range(8)), session="s", exclude=frozenset({bad})), now=0.1
    )
    assert retry.decode_pod != bad
    assert await r.report_failure(retry, bad, now=0.2)  # second failure: ejected
    core.update_pod(bad, 0.3, healthy=True)
    assert core.state_of(bad, 1.0) == "ejected" and not core.available(bad, 1.0)
    for i in range(5):
        x = await r.route(RouteRequest(list(range(8)), session=f"n{i}"), now=1.0)
        assert x.decode_pod != bad
    core.update_pod(bad, 6.0, healthy=True)  # the poll is the recovery probe
    assert core.available(bad, 6.0)
    assert {p.name: p.ejections for p in core.report(6.0)}[bad] == 1


async def test_draining_pods_get_no_new_work():
    core = make_core()
    r = replica(core)
    core.update_pod("a", 0.0, healthy=True, draining=True)
    for i in range(4):
        assert (await r.route(RouteRequest([1, 2, 3], session=f"s{i}"), 0.0)).decode_pod == "b"
    core.update_pod("b", 0.0, healthy=False)
    with pytest.raises(NoPodAvailable):
        await r.route(RouteRequest([1, 2, 3]), 0.0)


def test_a_new_pod_takes_work_once_a_poll_finds_it_healthy():
    core = make_core(pods=("a",))
    core.add_pod(PodSpec("b"))
    assert core.state_of("b", 0.0) == "unhealthy"
    core.update_pod("a", 0.0, healthy=True, running=10)
    core.update_pod("b", 0.0, healthy=True)
    assert core.route(RouteRequest(list(range(8))), SharedView(), 0.0).decode_pod == "b"
    with pytest.raises(ValueError, match="already known"):
        core.add_pod(PodSpec("b"))


async def test_a_removed_pod_leaves_no_trace_and_running_requests_still_release():
    core = make_core()
    r = replica(core)
    tokens = list(range(40))
    d = await r.route(RouteRequest(tokens, session="s"), now=0.0)
    gone, other = d.decode_pod, ({"a", "b"} - {d.decode_pod}).pop()
    core.index.stored(gone, [1, 2, 3])
    core.remove_pod(gone)
    assert gone not in core.pods and gone not in core.index.pods
    assert [p.name for p in core.report(0.1)] == [other]
    assert core.live.occupied_blocks(gone, None) == 0
    # The session's next turn finds its binding pointing at a pod that left.
    d2 = await r.route(RouteRequest(tokens + [1, 2, 3, 4], session="s"), now=0.2)
    assert (d2.decode_pod, d2.reason) == (other, "rebind-unavailable-hash")
    # The request still running there frees its load, which the store learns.
    assert r.core.release(d).loads == {gone: PodLoad()}
    # Polls and failures of the removed pod arrive late and are ignored.
    core.update_pod(gone, 0.3, healthy=True)
    assert not core.report_failure(gone, 0.3)
    # It may come back under the same name, empty.
    core.add_pod(PodSpec(gone))
    assert core.index.held_blocks(gone) == 0


async def test_set_draining_stops_new_work_until_unset():
    core = make_core()
    r = replica(core)
    core.set_draining("a")
    core.update_pod("a", 0.0, healthy=True, draining=False)  # the engine does not know yet
    assert core.state_of("a", 0.0) == "draining"
    for i in range(4):
        assert (await r.route(RouteRequest([1, 2, 3], session=f"s{i}"), 0.0)).decode_pod == "b"
    core.set_draining("a", False)
    assert core.available("a", 0.0)
    with pytest.raises(KeyError):
        core.set_draining("zzz")


def test_local_prefill_is_decided_with_the_pods():
    core = make_core(pods=("d",), roles={"d": "decode"})
    d = core.route(RouteRequest(list(range(40))), SharedView(), 0.0)
    assert (d.prefill_pod, d.local_prefill) == (None, "no_prefill_pods")
    core.add_pod(PodSpec("p", "prefill"))  # not yet polled: cannot serve
    d = core.route(RouteRequest(list(range(40))), SharedView(), 0.0)
    assert (d.prefill_pod, d.local_prefill) == (None, "prefill_unavailable")
    core.update_pod("p", 0.0, healthy=True)
    d = core.route(RouteRequest(list(range(400))), SharedView(), 0.0)
    assert (d.prefill_pod, d.local_prefill) == ("p", None)
    agg = make_core().route(RouteRequest(list(range(40))), SharedView(), 0.0)
    assert agg.local_prefill is None


def test_pd_decode_pod_full_of_idle_sessions_kv_still_takes_new_sessions():
    # The live loop's static 1:2: a replay ran on decode pod d1 alone and
    # stopped; its sessions stay live (the window) and fill d1's KV. Then d2
    # is added and a new replay starts. d1 holding that KV must not keep every
    # new session on d2 however many run there: on a decode pod an evicted
    # session's KV comes back over NIXL, priced at the transfer weight.
    block, capacity, prompt = 16, 1456, 1600  # the CPU engines' 23,296 KV tokens
    core = RoutingCore(
        RoutingSettings(block_size=block, policy=PolicySettings(remote_prefill_threshold=0)),
        [PodSpec("p", "prefill"), PodSpec("d1", "decode")],
    )

    def poll(now):
        for name in core.pods:
            core.update_pod(name, now, healthy=True, kv_capacity_blocks=capacity)

    def prompt_of(session):
        return random.Random(session).choices(range(49_000), k=prompt)

    poll(0.0)
    for i in range(18):  # the first replay: 18 sessions, finished
        core.release(
            core.route(RouteRequest(prompt_of(f"old{i}"), session=f"old{i}"), SharedView(), 1.0)
        )
    assert core.live.occupied_blocks("d1", None) > capacity  # its KV is full
    core.add_pod(PodSpec("d2", "decode"))
    poll(40.0)
    held = [
        core.route(RouteRequest(prompt_of(f"new{i}"), session=f"new{i}"), SharedView(), 45.0)
        for i in range(6)  # the next replay's sessions, all running at once
    ]
    where = Counter(d.decode_pod for d in held)
    assert where["d1"] >= 2 and where["d2"] >= 2, where
