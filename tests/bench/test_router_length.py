"""The conversation-length benchmark's workload and statistics (no servers)."""

import random

from bench.router_length import Shot, added, make_session, stage_means_ms, stage_totals


def test_a_session_grows_to_its_length_and_forks_share_its_context():
    s = make_session(random.Random(0), "k", length=8000, turns=10, forks=3)
    assert len(s.turns) == 10 and len(s.forks) == 3
    words = [sum(len(m["content"].split()) for m in t) for t in s.turns]
    assert words == sorted(words) and 7000 <= words[-1] <= 8000
    for earlier, later in zip(s.turns, s.turns[1:]):
        assert later[: len(earlier)] == earlier  # each turn extends the previous one
    for key, messages in s.forks:
        assert key.startswith("k:sub") and messages[: len(s.turns[-1])] == s.turns[-1]


def test_added_ttft_and_stage_means():
    routed = [Shot(ttft=t) for t in (0.010, 0.012, 0.020)]
    direct = [Shot(ttft=t) for t in (0.002, 0.003, 0.004)]
    assert round(added(routed, direct)["p50_ms"], 6) == 9.0
    text = (
        'tandem_router_stage_seconds_sum{stage="hash"} 0.5\n'
        'tandem_router_stage_seconds_count{stage="hash"} 10\n'
    )
    after = stage_totals(
        "# TYPE tandem_router_stage_seconds histogram\n"
        + text.replace("0.5", "0.8").replace(" 10", " 13")
    )
    before = stage_totals("# TYPE tandem_router_stage_seconds histogram\n" + text)
    assert round(stage_means_ms(before, after)["hash"], 6) == 100.0
