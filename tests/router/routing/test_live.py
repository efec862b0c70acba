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
