"""RoutingCore with local state: the seam the router calls. No servers, no mocks."""

import pytest
from prometheus_client import generate_latest

from services.router.routing import (NoPodAvailable, PodSpec, RouteRequest, RoutingCore,
                                     RoutingSettings)
from services.router.routing.health import BreakerSettings
from services.router.routing.policy import PolicySettings

BS = 4


def make_core(pods=("a", "b"), roles=None, **kw):
    specs = [PodSpec(p, (roles or {}).get(p, "both")) for p in pods]
    return RoutingCore(RoutingSettings(block_size=BS, **kw), specs)


async def test_predicted_index_for_pods_without_events():
    core = make_core()
    tokens = list(range(40))
    d1 = await core.route(RouteRequest(tokens, session="s"), now=0.0)
    assert d1.predicted_cached_tokens == 0
    await core.report_prefill(d1, 0, now=1.0)
    await core.release(d1)
    d2 = await core.route(RouteRequest(tokens + list(range(100, 110)), session="s"), now=2.0)
    assert d2.decode_pod == d1.decode_pod and d2.reason == "sticky"
    assert d2.predicted_cached_tokens == 40
    # The engine says it had less: counted as "over", but the pod has just
    # computed the whole prompt, so the index keeps every block of it.
    await core.report_prefill(d2, 20, now=3.0)
    await core.release(d2)
    assert core.index.match(d2.block_hashes, 4.0)[d1.decode_pod] == 50 // BS
    text = generate_latest(core.metrics.registry).decode()
    assert 'tandem_routing_prediction_total{outcome="over"} 1.0' in text
    assert "tandem_routing_decisions_total" in text


async def test_pod_and_index_gauges_follow_polls():
    core = make_core(index_capacity=8)
    core.index.stored("a", range(12))  # as KV events would: 12 blocks, room for 8
    d = await core.route(RouteRequest(list(range(40)), session="s"), now=0.0)
    await core.route(RouteRequest(list(range(100, 108)), session="t"), now=0.1)
    for pod in ("a", "b"):
        core.update_pod(pod, 0.2, healthy=True)
    text = generate_latest(core.metrics.registry).decode()
    assert "tandem_routing_index_blocks 8.0" in text  # capped by the LRU bound
    assert "tandem_routing_index_evictions_total 4.0" in text
    assert 'tandem_routing_pod_cached_blocks{pod="a"} 8.0' in text
    assert 'tandem_routing_pod_cached_blocks{pod="b"} 0.0' in text
    # The second decision saw the first one's load on its pod.
    assert f'tandem_routing_pod_in_flight{{pod="{d.decode_pod}"}} 1.0' in text
    assert f'tandem_routing_pod_pending_prefill_tokens{{pod="{d.decode_pod}"}} 40.0' in text


async def test_reported_kv_capacity_prices_evicting_live_sessions():
    # Pods of 10 blocks (40 tokens). Two live sessions of 8 blocks each, one per
    # pod; a third, new, session of 6 blocks fits nowhere without evicting.
    core = make_core()
    for pod in ("a", "b"):
        core.update_pod(pod, 0.0, healthy=True, kv_capacity_blocks=10)
    s = await core.route(RouteRequest(list(range(32)), session="s"), now=0.0)
    t = await core.route(RouteRequest(list(range(100, 132)), session="t"), now=0.0)
    # The second avoided evicting the first (not its hash home by chance).
    assert t.decode_pod != s.decode_pod and t.reason == "new-cost"
    for d in (s, t):
        await core.report_prefill(d, 0, now=0.5)
        await core.release(d)
    # s's next turn (its 8 blocks cached, 2 new): room for exactly 2 more on
    # its pod; it stays. The other pod has room for 2 only: moving would evict.
    s2 = await core.route(RouteRequest(list(range(40)), session="s"), now=1.0)
    assert (s2.decode_pod, s2.reason) == (s.decode_pod, "sticky")
    core.update_pod(s.decode_pod, 1.5, healthy=True, kv_capacity_blocks=10)
    text = generate_latest(core.metrics.registry).decode()
    assert f'tandem_routing_pod_live_blocks{{pod="{s.decode_pod}"}} 10.0' in text
    assert f'tandem_routing_pod_kv_capacity_blocks{{pod="{s.decode_pod}"}} 10.0' in text
    # t idles past the live window: its blocks are no longer worth keeping.
    core.live.expire(now=1.0 + core.settings.live_session_window_s + 1)
    assert core.live.occupied_blocks(t.decode_pod, None) == 0
    # Without a reported capacity nothing is priced.
    assert core._kv_free_tokens("a", None, []) is not None
    core.update_pod("a", 2.0, healthy=True)
    assert core._kv_free_tokens("a", None, []) is None


async def test_load_accounting_is_released_once():
    core = make_core(pods=("p", "d"), roles={"p": "prefill", "d": "decode"},
                     policy=PolicySettings(remote_prefill_threshold=8))
    d = await core.route(RouteRequest(list(range(40))), now=0.0)
    assert (d.prefill_pod, d.decode_pod) == ("p", "d")
    loads = await core.state.loads()
    assert loads["p"].in_flight == 1 and loads["p"].pending_prefill_tokens == 40
    assert loads["d"].in_flight == 1
    await core.report_prefill(d, 0, now=1.0)
    loads = await core.state.loads()
    assert loads["p"].in_flight == 0 and loads["p"].pending_prefill_tokens == 0
    await core.release(d)
    await core.release(d)
    assert (await core.state.loads())["d"].in_flight == 0


async def test_failures_eject_and_polls_recover():
    core = make_core(breaker=BreakerSettings(failure_threshold=2, open_s=5))
    d = await core.route(RouteRequest(list(range(8)), session="s"), now=0.0)
    bad = d.decode_pod
    await core.report_failure(d, bad, now=0.0)
    retry = await core.route(RouteRequest(list(range(8)), session="s",
                                          exclude=frozenset({bad})), now=0.1)
    assert retry.decode_pod != bad
    await core.report_failure(retry, bad, now=0.2)  # second failure: ejected
    assert not core.available(bad, 1.0)
    for i in range(5):
        x = await core.route(RouteRequest(list(range(8)), session=f"n{i}"), now=1.0)
        assert x.decode_pod != bad
    assert core.pods_due_probe(6.0) == [bad]
    core.update_pod(bad, 6.0, healthy=True)  # the poll is the recovery probe
    assert core.available(bad, 6.0)


async def test_draining_pods_get_no_new_work():
    core = make_core()
    core.update_pod("a", 0.0, healthy=True, draining=True)
    for i in range(4):
        assert (await core.route(RouteRequest([1, 2, 3], session=f"s{i}"), 0.0)).decode_pod == "b"
    core.update_pod("b", 0.0, healthy=False)
    with pytest.raises(NoPodAvailable):
        await core.route(RouteRequest([1, 2, 3]), 0.0)


def test_kv_events_must_name_configured_pods():
    from services.router.routing.settings import KvEventSource
    with pytest.raises(ValueError, match="not configured"):
        make_core(kv_events=(KvEventSource("zzz", "tcp://127.0.0.1:1"),))
