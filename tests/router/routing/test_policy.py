"""Routing policy: pure math on dataclass inputs. No servers, no mocks."""

from collections import Counter

import pytest

from services.router.routing.hashring import bounded_load_choice, ring_home
from services.router.routing.policy import (
    PREFIX_KEY_TOKENS,
    Binding,
    NoPodAvailable,
    PodView,
    Policy,
    PolicySettings,
    RouteInput,
    prefix_key,
)
from services.router.routing.strategies import POLICIES


def pol(name="cost", **kw):
    return Policy(PolicySettings(policy=name, **kw))


def pods(*specs):
    return [PodView(**s) for s in specs]


def test_sticky_when_comparable():
    views = pods(
        dict(name="a", cached_tokens=3000, in_flight=2),
        dict(name="b", cached_tokens=0, in_flight=1),
    )
    c = pol().choose(RouteInput(4000, views, "s", Binding("a")))
    assert (c.pod, c.reason) == ("a", "sticky")
    assert c.predicted_cached_tokens == 3000


def test_sticky_yields_when_bound_pod_is_much_worse():
    # The bound pod has a long queue and holds little of the session any more
    # (evicted under KV pressure): moving is cheaper than waiting.
    views = pods(
        dict(name="a", cached_tokens=256, pending_prefill_tokens=20000, in_flight=8),
        dict(name="b", cached_tokens=0, in_flight=0),
    )
    c = pol().choose(RouteInput(4000, views, "s", Binding("a")))
    assert (c.pod, c.reason) == ("b", "sticky-yielded")


def test_sticky_keeps_big_cached_prefix_despite_moderate_queue():
    views = pods(
        dict(name="a", cached_tokens=30000, in_flight=4, pending_prefill_tokens=2000),
        dict(name="b", cached_tokens=0),
    )
    assert pol().choose(RouteInput(31000, views, "s", Binding("a"))).pod == "a"


def test_store_prices_a_prefix_another_pod_holds_as_a_load():
    """With a shared KV store, the session's context the bound pod holds is in
    the store too: a busy bound pod yields to an idle one, which loads the
    context at ``store_load_weight`` of computing it. Without the store the
    same queue keeps the session (the case above)."""
    views = pods(
        dict(name="a", cached_tokens=30000, in_flight=4, pending_prefill_tokens=6000),
        dict(name="b", cached_tokens=0),
    )
    req = RouteInput(31000, views, "s", Binding("a"))
    assert pol().choose(req).pod == "a"
    c = pol(store_load_weight=0.1).choose(req)
    assert (c.pod, c.reason) == ("b", "sticky-yielded")
    # b's cost: 1,000 new tokens computed, 30,000 loaded at 0.1 each
    assert c.costs["b"] == pytest.approx(1000 + 0.1 * 30000)


def test_store_weight_leaves_tokens_no_pod_holds_priced_as_compute():
    views = pods(dict(name="a", cached_tokens=0), dict(name="b", cached_tokens=0))
    c = pol(store_load_weight=0.1).choose(RouteInput(4000, views, "s"))
    assert c.costs == {"a": 4000, "b": 4000}


def test_store_weight_must_be_a_share():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="store-load-weight"):
            pol(store_load_weight=bad)


def test_session_policy_never_yields_but_rebinds_unavailable():
    views = pods(dict(name="a", pending_prefill_tokens=10**6), dict(name="b"))
    assert pol("session").choose(RouteInput(100, views, "s", Binding("a"))).pod == "a"
    views = pods(dict(name="a", available=False), dict(name="b"))
    c = pol("session").choose(RouteInput(100, views, "s", Binding("a")))
    assert c.pod == "b" and c.reason.startswith("rebind-unavailable")


def test_new_session_follows_fork_prefix():
    views = pods(dict(name="a", cached_tokens=0), dict(name="b", cached_tokens=2048))
    c = pol().choose(RouteInput(2100, views, "child", None))
    assert (c.pod, c.reason) == ("b", "new-prefix")


def test_a_burst_of_forks_stays_with_the_parent_context_until_its_pod_is_much_busier():
    # The parent's pod holds 1408 of a fork's 1600 tokens, the other pod only
    # the 512-token system prompt; earlier forks queue on the parent's pod.
    def fork(pending, in_flight):
        views = pods(
            dict(name="a", cached_tokens=1408, pending_prefill_tokens=pending, in_flight=in_flight),
            dict(name="b", cached_tokens=512, in_flight=2),
        )
        return pol().choose(RouteInput(1600, views, "fork", None))

    # cost a = 192 + pending + 64 x in-flight; b = 1088 + 128; move cost 256 + 448
    assert (fork(pending=1000, in_flight=5).pod, fork(1000, 5).reason) == ("a", "new-prefix")
    assert fork(pending=1500, in_flight=5).pod == "b"


def test_new_sessions_spread_by_consistent_hash_deterministically():
    views = pods(dict(name="a"), dict(name="b"), dict(name="c"))
    p = pol()
    first = [p.choose(RouteInput(100, views, f"s{i}")).pod for i in range(300)]
    second = [p.choose(RouteInput(100, views, f"s{i}")).pod for i in range(300)]
    assert first == second  # every replica computes the same home
    counts = Counter(first)
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 50


def test_bounded_load_spills_from_hot_pod():
    key = "session-x"
    home, _ = bounded_load_choice(key, ["a", "b", "c"], {})
    loads = {home: 10.0}
    pod, spilled = bounded_load_choice(key, ["a", "b", "c"], loads, bound_factor=1.25)
    assert spilled and pod != home
    # removing a pod only moves the sessions that lived on it
    keys = [f"k{i}" for i in range(500)]
    before = {k: bounded_load_choice(k, ["a", "b", "c"], {})[0] for k in keys}
    after = {k: bounded_load_choice(k, ["a", "b"], {})[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "c" for k in moved)


def test_bounded_load_keeps_shares_even_with_few_sessions():
    pods = ["a", "b"]
    keys = [f"k{i}" for i in range(200)]
    homed_a = [k for k in keys if bounded_load_choice(k, pods, {})[0] == "a"]
    # One session on a: the next new session whose home is a goes to b
    # (the bound is 1.25 sessions, not ceil(1.25) = 2).
    assert bounded_load_choice(homed_a[0], pods, {"a": 1.0}) == ("b", True)
    # Balanced loads: every session keeps its home.
    for k in keys:
        home = bounded_load_choice(k, pods, {})[0]
        assert bounded_load_choice(k, pods, {"a": 1.0, "b": 1.0}) == (home, False)
        assert bounded_load_choice(k, pods, {"a": 100.0, "b": 100.0}) == (home, False)
    # A pod with more than 1.25 x the average spills; within it, the home stays.
    assert bounded_load_choice(homed_a[0], pods, {"a": 13.0, "b": 10.0}) == ("a", False)
    assert bounded_load_choice(homed_a[0], pods, {"a": 17.0, "b": 10.0}) == ("b", True)


def test_round_robin_least_load_prefix():
    views = pods(
        dict(name="a", in_flight=3),
        dict(name="b", in_flight=0, cached_tokens=0),
        dict(name="c", in_flight=1, cached_tokens=512),
    )
    rr = pol("round-robin")
    assert [rr.choose(RouteInput(600, views)).pod for _ in range(4)] == ["a", "b", "c", "a"]
    assert pol("least-load").choose(RouteInput(600, views)).pod == "b"
    c = pol("prefix").choose(RouteInput(600, views))
    assert (c.pod, c.reason) == ("c", "prefix-hit")


def test_kv_pressure_counts_against_a_pod():
    views = pods(dict(name="a", kv_cache_usage=0.99), dict(name="b", kv_cache_usage=0.2))
    assert pol("least-load").choose(RouteInput(100, views)).pod == "b"


def test_kv_pressure_weighs_only_the_kv_a_request_lacks():
    # A session turn that finds its context cached on its pod stays although
    # that pod's KV is full of running requests; moving would recompute it all.
    views = pods(
        dict(name="a", kv_cache_usage=1.0, cached_tokens=1920, in_flight=1),
        dict(name="b", kv_cache_usage=0.2, cached_tokens=512, in_flight=1),
    )
    assert pol().choose(RouteInput(2000, views, "s", Binding("a"))).reason == "sticky"
    # With nothing of it cached anywhere, a request avoids the full pod.
    views = pods(dict(name="a", kv_cache_usage=1.0), dict(name="b", kv_cache_usage=0.2))
    assert pol().choose(RouteInput(2000, views)).pod == "b"


def test_eviction_keeps_a_session_on_its_pod_when_kv_is_full():
    # KV smaller than the working set: the bound pod lost part of the session
    # and is busier; the other pod is full of other live sessions. Without the
    # eviction price the session moves (and would push those sessions out).
    views = pods(
        dict(
            name="a", cached_tokens=1024, pending_prefill_tokens=2000, in_flight=2, kv_free_tokens=0
        ),
        dict(name="b", cached_tokens=0, in_flight=1, kv_free_tokens=128),
    )
    req = RouteInput(2000, views, "s", Binding("a"))
    assert pol(eviction_cost_factor=0).choose(req).reason == "sticky-yielded"
    c = pol().choose(req)
    assert (c.pod, c.reason) == ("a", "sticky")
    # The eviction is not TTFT: the predicted TTFT is the prefill work alone.
    assert c.predicted_ttft_s == pytest.approx((976 + 2000 + 64 * 2) / 2000)


def test_eviction_is_free_with_room_and_unknown_without_capacity():
    # Room for the uncached part, or no capacity reported: the same choice as
    # without an eviction price.
    for free in (4096, None):
        views = pods(
            dict(
                name="a",
                cached_tokens=1024,
                pending_prefill_tokens=2000,
                in_flight=2,
                kv_free_tokens=free,
            ),
            dict(name="b", in_flight=1, kv_free_tokens=free),
        )
        assert pol().choose(RouteInput(2000, views, "s", Binding("a"))).pod == "b"


def test_tight_kv_sends_a_new_session_where_it_evicts_least():
    # Its hash home would be whichever pod; with live KV at stake, the pod with
    # room wins regardless of hashing.
    for session in ("s1", "s2", "s3", "s4"):
        views = pods(dict(name="a", kv_free_tokens=0), dict(name="b", kv_free_tokens=3000))
        c = pol().choose(RouteInput(2000, views, session, None))
        assert (c.pod, c.reason) == ("b", "new-cost")
        # --eviction-cost-factor 0 ignores KV capacity: the hash home again.
        c = pol(eviction_cost_factor=0).choose(RouteInput(2000, views, session, None))
        assert c.reason.startswith("new-hash")


def test_unavailable_pods_are_never_chosen():
    views = pods(dict(name="a", available=False, cached_tokens=4000), dict(name="b"))
    for name in POLICIES:
        assert pol(name).choose(RouteInput(5000, views, "s", Binding("a"))).pod == "b"
    with pytest.raises(NoPodAvailable):
        pol().choose(RouteInput(10, pods(dict(name="a", available=False))))


def test_xpyd_decode_first_then_prefill_by_overlap():
    views = pods(
        dict(name="p1", role="prefill", cached_tokens=0),
        dict(name="p2", role="prefill", cached_tokens=3072),
        dict(name="d1", role="decode", kv_cache_usage=0.95, in_flight=5),
        dict(name="d2", role="decode", in_flight=1),
    )
    c = pol().choose(RouteInput(4000, views, "s"))
    assert c.pod == "d2"  # the decode pod with room, not the KV-full one
    assert c.prefill_pod == "p2"  # the prefill pod holding the prefix
    assert "prefill-overlap" in c.reason
    assert c.predicted_cached_tokens == 3072


def test_xpyd_skips_remote_prefill_when_uncached_part_is_short():
    views = pods(
        dict(name="p1", role="prefill"), dict(name="d1", role="decode", cached_tokens=3968)
    )
    c = pol(remote_prefill_threshold=256).choose(RouteInput(4000, views, "s", Binding("d1")))
    assert c.prefill_pod is None and c.pod == "d1"
    assert "local-prefill:short-uncached" in c.reason and c.local_prefill == "short_uncached"
    c = pol(remote_prefill_threshold=16).choose(RouteInput(4000, views, "s", Binding("d1")))
    assert c.prefill_pod == "p1"


def test_xpyd_pod_scope_counts_the_decode_pods_pending_prefill():
    views = pods(
        dict(name="p1", role="prefill"),
        dict(name="d1", role="decode", cached_tokens=3800, pending_prefill_tokens=100),
    )
    route = RouteInput(4000, views, "s", Binding("d1"))
    c = pol(remote_prefill_threshold=256).choose(route)
    assert c.prefill_pod is None and c.local_prefill == "short_uncached"  # 200 < 256
    c = pol(remote_prefill_threshold=256, remote_prefill_scope="pod").choose(route)
    assert c.prefill_pod == "p1" and c.local_prefill is None  # 200 + 100 queued >= 256
    with pytest.raises(ValueError, match="--remote-prefill-scope: 'node'"):
        PolicySettings(remote_prefill_scope="node").validate()


def test_xpyd_prefill_pool_down_falls_back_to_local_prefill():
    views = pods(dict(name="p1", role="prefill", available=False), dict(name="d1", role="decode"))
    c = pol().choose(RouteInput(4000, views))
    assert c.prefill_pod is None and c.local_prefill == "prefill_unavailable"
    assert "local-prefill:prefill-unavailable" in c.reason


def test_invalid_policy_is_named():
    with pytest.raises(ValueError, match="--routing-policy: routing policy 'fastest'"):
        PolicySettings(policy="fastest").validate()


def test_consistent_hash_keeps_each_key_on_its_ring_home_whatever_the_load():
    names = [f"p{i}" for i in range(8)]
    idle = pods(*(dict(name=n) for n in names))
    busy = pods(*(dict(name=n, in_flight=50, cached_tokens=0) for n in names))
    sessions = [f"s{i}" for i in range(400)]
    homes = {s: pol("consistent-hash").choose(RouteInput(500, idle, s)).pod for s in sessions}
    assert all(homes[s] == ring_home(s, names) for s in sessions)
    # Spread over every pod, no load bound: a session stays home however busy it is.
    assert set(homes.values()) == set(names)
    hot = [dict(name=n, in_flight=100 if n == homes["s0"] else 0) for n in names]
    c = pol("consistent-hash").choose(RouteInput(500, pods(*hot), "s0"))
    assert (c.pod, c.reason) == (homes["s0"], "hash")
    assert pol("consistent-hash").choose(RouteInput(500, busy, "s0")).pod == homes["s0"]
    # A pod removed moves only its own keys.
    gone = homes["s0"]
    rest = pods(*(dict(name=n) for n in names if n != gone))
    moved = [
        s for s in sessions if pol("consistent-hash").choose(RouteInput(5, rest, s)).pod != homes[s]
    ]
    assert moved == [s for s in sessions if homes[s] == gone]


def test_consistent_hash_keys_a_request_without_session_on_its_prompt_prefix():
    views = pods(*(dict(name=f"p{i}") for i in range(8)))
    same = [prefix_key([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 128) for _ in range(2)]
    assert same[0] == same[1] == format(18, "x")  # the 8th block: 1,024 tokens
    assert prefix_key([11, 12], 128) == format(12, "x") and prefix_key([], 128) is None
    assert PREFIX_KEY_TOKENS // 16 == 64
    c = pol("consistent-hash").choose(RouteInput(5000, views, None, prefix_key=same[0]))
    assert (c.pod, c.reason) == (ring_home(same[0], [v.name for v in views]), "hash")
    # No session and no full block: the least loaded pod.
    loaded = pods(dict(name="a", in_flight=3), dict(name="b"))
    c = pol("consistent-hash").choose(RouteInput(10, loaded, None))
    assert (c.pod, c.reason) == ("b", "hash-no-key")


def test_consistent_hash_places_prefill_by_the_same_key():
    views = pods(
        *(dict(name=f"p{i}", role="prefill") for i in range(4)),
        *(dict(name=f"d{i}", role="decode") for i in range(4)),
    )
    c = pol("consistent-hash").choose(RouteInput(8000, views, "sess-7"))
    assert c.pod == ring_home("sess-7", ["d0", "d1", "d2", "d3"])
    assert c.prefill_pod == ring_home("sess-7", ["p0", "p1", "p2", "p3"])
