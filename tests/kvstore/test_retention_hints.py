"""Engine side of the router's retention hints, without engines: the hint's
wire forms (proto → kv_transfer_params → connector) and the ReplicateConfig
each hint selects (real mooncake ReplicateConfig objects)."""

from __future__ import annotations

import pytest

from common.proto import engine_pb2 as pb
from services.kvstore.retention import HINT_KEY, RetentionHint, from_proto, with_hint, without_hint


def test_hint_travels_from_proto_to_kv_transfer_params_and_back():
    msg = pb.PrefillRequest(retention=pb.RetentionHint(session="h:s", pin_ttl_ms=5000))
    hint = from_proto(msg.retention)
    assert hint == RetentionHint("h:s", 5000) and hint.pins
    params = with_hint({"do_remote_decode": True}, hint)
    assert params == {
        "do_remote_decode": True,
        HINT_KEY: {"session": "h:s", "pin_ttl_ms": 5000, "release": False, "keep_tokens": 0},
    }
    assert RetentionHint.from_params(params) == hint
    assert without_hint(params) == {"do_remote_decode": True}
    assert without_hint({HINT_KEY: {}}) is None
    # An unset message is no hint; a release carries what to keep.
    assert from_proto(pb.GenerateRequest().retention) is None
    release = from_proto(pb.RetentionHint(session="h:s", release=True, keep_tokens=256))
    assert release == RetentionHint("h:s", release=True, keep_tokens=256) and not release.pins
    assert with_hint(None, None) is None and with_hint(None, release)[HINT_KEY]["release"]


@pytest.mark.parametrize(
    "bad",
    [
        {HINT_KEY: "pin"},
        {HINT_KEY: {"pin_ttl_ms": -1}},
        {HINT_KEY: {"pin_ttl_ms": 5, "release": True}},
        {HINT_KEY: {"pin": 5}},
        {HINT_KEY: {"keep_tokens": "many"}},
    ],
)
def test_malformed_hints_are_refused(bad):
    with pytest.raises(ValueError, match=HINT_KEY):
        RetentionHint.from_params(bad)


def test_each_hint_selects_its_replicate_config():
    from mooncake.store import ReplicateConfig, SoftPinAction

    from services.kvstore.connector import RequestRetention, apply_retention, retention_of

    engine_wide = retention_of(
        {
            "tandem": {
                "retention": "soft-pin",
                "session_ttl_ms": 9000,
                "max_pin_ttl_ms": 60_000,
                "lease_ttl_ms": 500,
            }
        }
    )
    default = ReplicateConfig()
    default.preferred_segment = "seg-a"
    assert apply_retention(default, engine_wide)
    r = RequestRetention(store=None, default=default, retention=engine_wide)
    assert r.config_for(None) is default
    assert r.config_for(RetentionHint("h:s")) is default  # no pin asked: engine-wide policy
    pinned = r.config_for(RetentionHint("h:s", pin_ttl_ms=20_000))
    assert pinned.soft_pin_action == SoftPinAction.ENABLE and pinned.soft_pin_ttl_ms == 20_000
    assert pinned.preferred_segment == "seg-a"  # placement kept
    assert r.config_for(RetentionHint("h:t", pin_ttl_ms=20_000)) is pinned  # one per TTL
    # The master refuses pins past its max_kv_soft_pin_ttl: capped.
    assert r.config_for(RetentionHint("h:s", pin_ttl_ms=10**9)).soft_pin_ttl_ms == 60_000
    # A released session's last blocks are written unpinned (removed right after).
    released = r.config_for(RetentionHint("h:s", release=True))
    assert released.soft_pin_action == SoftPinAction.PRESERVE
    assert released.preferred_segment == "seg-a"
    assert r.reaper.delay_s == pytest.approx(0.75)
    assert r.first_release("req-1") and not r.first_release("req-1")
