"""Session KV prefetch decisions: which idle sessions to warm where. Pure;
no servers."""

import pytest

from common.settings import SettingError
from services.router.routing import PodSpec, RouteRequest, RoutingCore, RoutingSettings, SharedView
from services.router.routing.policy import Binding
from services.router.routing.prefetch import Candidate, PodGate, PrefetchSettings, plan

S = PrefetchSettings(session_prefetch=True, prefetch_max_in_flight=1, prefetch_min_tokens=256)
IDLE = PodGate(available=True, queued=0, prefetching=0)


def test_warms_what_is_missing_on_the_next_turns_pod():
    chosen = plan(
        [
            Candidate("moved", 2000, "b", 0, moves=True),
            Candidate("evicted", 1500, "c", 500, moves=False),
            Candidate("warm", 2000, "a", 1920, moves=False),
        ],  # 80 missing: not worth it
        {"a": IDLE, "b": IDLE, "c": IDLE},
        S,
    )
    assert [(p.session, p.pod, p.tokens, p.reason) for p in chosen] == [
        ("moved", "b", 2000, "moves"),
        ("evicted", "c", 1000, "evicted"),
    ]


def test_never_evicts_other_live_sessions_kv():
    c = [Candidate("s", 2000, "a", 0, moves=True, room_tokens=1999)]
    assert plan(c, {"a": IDLE}, S) == []
    c = [Candidate("s", 2000, "a", 0, moves=True, room_tokens=2000)]
    assert [p.session for p in plan(c, {"a": IDLE}, S)] == ["s"]


def test_never_on_a_pod_with_queued_requests_or_unavailable():
    c = [Candidate("s", 2000, "a", 0, moves=True)]
    assert plan(c, {"a": PodGate(True, queued=1, prefetching=0)}, S) == []
    assert plan(c, {"a": PodGate(False, queued=0, prefetching=0)}, S) == []
    assert plan(c, {}, S) == []  # the pod left


def test_bounded_per_pod_most_missing_first():
    c = [
        Candidate("small", 600, "a", 0, moves=True),
        Candidate("big", 3000, "a", 0, moves=True),
        Candidate("other", 600, "b", 0, moves=True),
    ]
    chosen = plan(c, {"a": IDLE, "b": IDLE}, S)
    assert [(p.session, p.pod) for p in chosen] == [("big", "a"), ("other", "b")]
    busy = {"a": PodGate(True, 0, prefetching=1), "b": IDLE}
    assert [p.session for p in plan(c, busy, S)] == ["other"]
    two = PrefetchSettings(session_prefetch=True, prefetch_max_in_flight=2)
    assert [p.session for p in plan(c, {"a": IDLE, "b": IDLE}, two)] == ["big", "other", "small"]


def test_settings_are_validated():
    with pytest.raises(SettingError, match="--prefetch-max-in-flight"):
        PrefetchSettings(prefetch_max_in_flight=0).validate()
    with pytest.raises(SettingError, match="--prefetch-min-tokens"):
        RoutingSettings(prefetch=PrefetchSettings(prefetch_min_tokens=0)).validate()


def _core():
    core = RoutingCore(RoutingSettings(block_size=4), [PodSpec("a"), PodSpec("b")])
    for p in ("a", "b"):
        core.update_pod(p, 0.0, healthy=True)
    return core


def test_next_turn_asks_the_policy_without_holding_anything():
    core = _core()
    tokens = list(range(400))
    d = core.route(RouteRequest(tokens, session="s"), SharedView(), 0.0)
    core.release(d)
    held = {p: core.local_load(p) for p in core.pods}
    counts = {p: dict(st.class_counts) for p, st in core.pods.items()}

    def next_turn(now):
        view = core.next_turn(
            core.hasher.event_hashes(tokens), len(tokens), "s", Binding(d.decode_pod), now
        )
        return view.name, view.cached_tokens

    assert next_turn(1.0) == (d.decode_pod, 396)
    assert {p: core.local_load(p) for p in core.pods} == held
    assert {p: dict(st.class_counts) for p, st in core.pods.items()} == counts
    # The pod's engine evicted the session's KV (its events say so).
    core.index.removed(d.decode_pod, core.hasher.event_hashes(tokens))
    core.index.expire_predictions(10_000.0)
    assert next_turn(10_000.0) == (d.decode_pod, 0)
    # The pod is going away: the next turn moves, to a pod that lacks the prefix.
    core.set_draining(d.decode_pod)
    other = "b" if d.decode_pod == "a" else "a"
    assert next_turn(10_000.0) == (other, 0)
    core.note_warmed(other, core.hasher.event_hashes(tokens), 10_000.0)
    assert next_turn(10_000.0) == (other, 396)


def test_next_turn_is_none_without_a_pod():
    core = _core()
    for p in ("a", "b"):
        core.set_draining(p)
    tokens = list(range(40))
    assert core.next_turn(core.hasher.event_hashes(tokens), len(tokens), "s", None, 0.0) is None
