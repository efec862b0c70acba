"""Live sessions: the KV each pod's active sessions need, counted once per block."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.routing.live import LiveSessions


def test_sessions_sharing_a_prefix_count_its_blocks_once():
    live = LiveSessions(window_s=60)
    live.touch("parent", ["a"], [1, 2, 3], now=0)
    live.touch("fork", ["a"], [1, 2, 3, 4, 5], now=1)  # a sub-agent of parent
    live.touch("other", ["b"], [9], now=1)
    assert live.occupied_blocks("a", None) == 5
    assert live.occupied_blocks("b", None) == 1


def test_own_blocks_count_only_as_the_cached_part():
    live = LiveSessions(window_s=60)
    live.touch("s", ["a"], [1, 2, 3, 4], now=0)
    live.touch("t", ["a"], [1, 7], now=0)
    # s's next turn: blocks 1..2 still cached on a; 3, 4 (evicted) are not
    # counted, 1 is t's too (once), 7 is t's.
    assert live.occupied_blocks("a", "s", cached=[1, 2]) == 3
    # On another pod s has nothing live; what it finds cached there counts.
    assert live.occupied_blocks("b", "s", cached=[1]) == 1


def test_a_moved_session_frees_its_old_pod():
    live = LiveSessions(window_s=60)
    live.touch("s", ["a"], [1, 2], now=0)
    live.touch("s", ["b"], [1, 2, 3], now=5)
    assert live.occupied_blocks("a", None) == 0
    assert live.occupied_blocks("b", None) == 3


def test_idle_and_ended_sessions_stop_counting():
    live = LiveSessions(window_s=60)
    live.touch("idle", ["a"], [1, 2], now=0)
    live.touch("busy", ["a"], [2, 3], now=30)
    live.touch("done", ["a"], [4], now=30)
    live.end("done")
    live.expire(now=61)
    assert len(live) == 1
    assert live.occupied_blocks("a", None) == 2  # busy's 2 and 3


def test_a_pd_turn_is_live_on_its_prefill_and_decode_pods():
    live = LiveSessions(window_s=60)
    live.touch("s", ["p1", "d1"], [1, 2], now=0)
    assert live.occupied_blocks("p1", None) == live.occupied_blocks("d1", None) == 2
    live.touch("s", ["p2", "d1"], [1, 2, 3], now=1)
    assert live.occupied_blocks("p1", None) == 0
    assert live.occupied_blocks("d1", "s", cached=[1, 2]) == 2


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        LiveSessions(window_s=0)


def test_the_least_recently_seen_sessions_go_beyond_the_bounds():
    live = LiveSessions(window_s=60, max_sessions=2, max_blocks=100)
    live.touch("a", ["p"], [1, 2], now=0)
    live.touch("b", ["p"], [2, 3], now=1)
    live.touch("a", ["p"], [1, 2, 4], now=2)  # a is seen again: b is now the oldest
    live.touch("c", ["p"], [5], now=3)
    assert "b" not in live and "a" in live and "c" in live
    assert live.evictions == 1 and live.held_blocks == 4
    assert live.occupied_blocks("p", None) == 4  # b's block 3 is no longer counted
    live = LiveSessions(window_s=60, max_sessions=10, max_blocks=5)
    live.touch("a", ["p"], [1, 2, 3], now=0)
    live.touch("b", ["p"], [4, 5, 6], now=1)  # 6 blocks held: a goes
    assert "a" not in live and live.held_blocks == 3 and live.evictions == 1
    live.touch("big", ["p"], list(range(10, 20)), now=2)  # alone over the bound: kept
    assert len(live) == 1 and "big" in live and live.held_blocks == 10
    with pytest.raises(ValueError):
        LiveSessions(window_s=60, max_sessions=0)


def _occupied_by_counting(live, pod, session, cached):
    """The definition, block by block: every live block on the pod, less the
    session's own that no other session holds, plus the prompt's cached
    blocks that no other live session holds."""
    counts = live._blocks.get(pod, {})
    entry = live._sessions.get(session) if session else None
    own = entry[1] if entry is not None and pod in entry[0] else frozenset()

    def others(h):
        return counts[h] - (h in own) if h in counts else 0

    total = len(counts) - sum(1 for h in own if counts.get(h) == 1)
    return total + sum(1 for h in set(cached) if others(h) <= 0)


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.sampled_from(["s", "t", "u"]),
            st.sampled_from(["a", "b"]),
            st.lists(st.integers(0, 12), max_size=10),
        ),
        max_size=8,
    ),
    session=st.sampled_from(["s", "t", None]),
    cached=st.lists(st.integers(0, 12), max_size=10),
)
def test_occupied_blocks_by_sets_equals_counting(turns, session, cached):
    live = LiveSessions(window_s=100, max_sessions=2)
    for i, (who, pod, hashes) in enumerate(turns):
        live.touch(who, [pod], hashes, float(i))
    for pod in ("a", "b"):
        assert live.occupied_blocks(pod, session, cached) == _occupied_by_counting(
            live, pod, session, cached
        )


_PODS = ["a", "b", "c"]
_SESSIONS = ["s", "t", "u", "v"]
# A few prompts that share prefixes (asked again and again), or any blocks.
_block_lists = st.sampled_from([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2], [8, 9]]) | st.lists(
    st.integers(0, 12), max_size=10
)
_operations = st.one_of(
    st.tuples(
        st.just("touch"),
        st.sampled_from(_SESSIONS),
        st.lists(st.sampled_from(_PODS), min_size=1, max_size=2),
        _block_lists,
    ),
    st.tuples(st.just("end"), st.sampled_from(_SESSIONS)),
    st.tuples(st.just("expire"), st.integers(0, 5)),
    st.tuples(st.just("remove_pod"), st.sampled_from(_PODS)),
    st.tuples(
        st.just("ask"),
        st.sampled_from([*_SESSIONS, None]),
        _block_lists,
        st.fixed_dictionaries({}, optional={pod: st.integers(0, 6) for pod in _PODS}),
    ),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_operations, max_size=30))
def test_occupied_by_pod_equals_occupied_blocks_pod_by_pod(operations):
    """The per-request count over all pods, which remembers each pod's live
    blocks of a prefix until they change, against ``occupied_blocks`` after
    any sequence of turns, ends, expiries, pods removed (and come back) and
    bound evictions, the same prefixes asked again and again."""
    live = LiveSessions(window_s=4, max_sessions=3, max_blocks=20)
    now = 0.0
    for op in operations:
        if op[0] == "touch":
            now += 1
            live.touch(op[1], op[2], op[3], now)
        elif op[0] == "end":
            live.end(op[1])
        elif op[0] == "expire":
            live.expire(now + op[1])
        elif op[0] == "remove_pod":
            live.remove_pod(op[1])
        else:
            _, session, hashes, cached = op
            assert live.occupied_by_pod(session, hashes, cached) == {
                pod: live.occupied_blocks(pod, session, hashes[:n]) for pod, n in cached.items()
            }


def test_occupied_by_pod_counts_again_once_a_pods_live_blocks_change():
    """Live blocks and the prompt's cached ones, each once: a count remembered
    from before a change would be off by the blocks that changed."""
    live = LiveSessions(window_s=60)
    live.touch("s", ["a"], [1, 2, 3], now=0)
    live.touch("t", ["a", "b"], [8, 9], now=0)
    prefix = [1, 2, 3, 4]
    assert live.occupied_by_pod(None, prefix, {"a": 4, "b": 4}) == {"a": 6, "b": 6}
    live.end("s")  # 1, 2, 3 no longer live on a: 8, 9 and the prompt's 1..4
    assert live.occupied_by_pod(None, prefix, {"a": 4, "b": 4}) == {"a": 6, "b": 6}
    live.touch("u", ["b"], [1, 2], now=1)  # a new session, live on b
    assert live.occupied_by_pod(None, prefix, {"a": 4, "b": 4}) == {"a": 6, "b": 6}
    assert live.occupied_by_pod(None, [5], {"a": 1, "b": 1}) == {"a": 3, "b": 5}
    assert live.occupied_by_pod("u", prefix, {"a": 2, "b": 2}) == {
        pod: live.occupied_blocks(pod, "u", prefix[:2]) for pod in ("a", "b")
    }
