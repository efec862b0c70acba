"""Router-side KV retention hints (`services/router/retention.py`): which
requests pin, what a session's end may remove, when sessions are forgotten.
Pure logic; the engines' side is in tests/kvstore."""

from __future__ import annotations

import pytest

from services.kvstore.retention import RetentionHint
from services.router.retention import RetentionSettings, SessionRetention

BS = 16


def tracker(policy="named-sessions", ttl_s=60.0, **kw) -> SessionRetention:
    return SessionRetention(RetentionSettings(policy=policy, ttl_s=ttl_s, **kw), block_size=BS)


def test_named_sessions_pin_their_writes_and_derived_ones_do_not():
    r = tracker()
    assert r.hint("h:a", "header", [1, 2, 3], now=0) == RetentionHint("h:a", pin_ttl_ms=60_000)
    assert r.hint("u:b", "user", [1, 2], now=0) == RetentionHint("u:b", pin_ttl_ms=60_000)
    assert r.hint("d:c", "derived", [1, 2], now=0) is None
    assert r.hint(None, None, [1, 2], now=0) is None
    assert tracker("all-sessions").hint("d:c", "derived", [1], now=0).pin_ttl_ms == 60_000
    assert tracker("off").hint("h:a", "header", [1], now=0) is None


def test_release_keeps_the_prefix_other_active_sessions_share():
    r = tracker()
    r.hint("h:parent", "header", [1, 2, 3, 4], now=0)
    r.hint("h:child", "header", [1, 2, 3, 9, 10], now=1)  # forked after block 3
    r.hint("h:other", "header", [1, 7], now=2)  # shares the system prompt only
    # The parent ends with a longer prompt: blocks 1-3 are the child's too.
    hint = r.hint("h:parent", "header", [1, 2, 3, 4, 5, 6], end=True, now=3)
    assert hint == RetentionHint("h:parent", release=True, keep_tokens=3 * BS)
    assert r.active_sessions == 2
    # With the parent gone, the child's own blocks start after block 1.
    assert r.hint("h:child", "header", [1, 2, 3, 9, 10, 11], end=True, now=4).keep_tokens == BS
    assert r.hint("h:other", "header", [1, 7, 8], end=True, now=5).keep_tokens == 0
    assert r.active_sessions == 0 and not r._refs


def test_a_session_sharing_nothing_releases_everything_even_unseen():
    r = tracker()
    # A session whose earlier turns this replica never saw (another replica, or
    # a router restart) still releases what it writes now.
    assert r.hint("h:x", "header", [5, 6], end=True, now=0) == RetentionHint(
        "h:x", release=True, keep_tokens=0
    )


def test_idle_sessions_are_forgotten_after_the_ttl():
    r = tracker(ttl_s=10)
    r.hint("h:old", "header", [1, 2], now=0)
    r.hint("h:new", "header", [1, 3], now=5)
    r.hint("h:new", "header", [1, 3, 4], now=12)  # h:old idle > 10 s: its pins lapsed
    assert r.active_sessions == 1
    # Nothing of h:old protects block 1 any more: only h:new holds it.
    assert r.hint("h:new", "header", [1, 3, 4], end=True, now=13).keep_tokens == 0


def test_a_new_turn_replaces_the_session_prompt():
    r = tracker()
    r.hint("h:a", "header", [1, 2, 3], now=0)
    r.hint("h:b", "header", [1, 2, 3], now=0)
    r.hint("h:b", "header", [1, 8], now=1)  # b's history was edited: shares block 1 only
    assert r.hint("h:a", "header", [1, 2, 3, 4], end=True, now=2).keep_tokens == BS


def test_session_cap_forgets_the_oldest():
    r = tracker(max_sessions=2)
    for i, name in enumerate(["h:1", "h:2", "h:3"]):
        r.hint(name, "header", [100 + i], now=i)
    assert r.active_sessions == 2 and "h:1" not in r._sessions


def test_settings_are_checked():
    with pytest.raises(ValueError, match="--kv-retention: 'sometimes'"):
        RetentionSettings(policy="sometimes").validate()
    with pytest.raises(ValueError, match="--kv-retention-ttl-s"):
        RetentionSettings(ttl_s=0).validate()
    with pytest.raises(ValueError, match="--kv-retention-ttl-s"):
        RetentionSettings(ttl_s=2 * 86400).validate()


def test_router_flags_build_the_settings():
    from services.router.config import parse_settings

    s = parse_settings(
        [
            "--decode",
            "127.0.0.1:1",
            "--kv-retention",
            "all-sessions",
            "--kv-retention-ttl-s",
            "90",
            "--session-end-header",
            "x-done",
        ]
    )
    assert s.retention == RetentionSettings(policy="all-sessions", ttl_s=90.0, end_header="x-done")
    assert parse_settings(["--decode", "127.0.0.1:1"]).retention == RetentionSettings()
    with pytest.raises(SystemExit):
        parse_settings(["--decode", "127.0.0.1:1", "--kv-retention-ttl-s", "-1"])


def test_the_block_bound_forgets_the_least_recently_seen_sessions():
    r = tracker(max_blocks=5)
    r.hint("h:a", "header", [1, 2, 3], now=0)
    r.hint("h:b", "header", [1, 2, 4], now=1)  # 6 blocks: a is forgotten
    assert r.active_sessions == 1 and r.held_blocks == 3 and r.evictions == 1
    # b's release no longer sees a's share of the prefix.
    assert r.hint("h:b", "header", [1, 2, 4], end=True, now=2).keep_tokens == 0
    assert r.held_blocks == 0
    with pytest.raises(ValueError, match="--kv-retention-max-blocks"):
        tracker(max_blocks=0)
