"""Trace format: round trip, and clear errors naming file, session and field.
No mocks, no server."""

from __future__ import annotations

import json

import pytest

from tandem.workload import trace
from tandem.workload.generate import generate, params_for
from tandem.workload.trace import TraceError


def _session(**over):
    s = {
        "id": "abc",
        "block_size": 4,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "s", "in": 9, "out": 3, "hash_ids": [1, 2, 3], "think_time": 0.0},
            {
                "type": "subagent",
                "agent_id": "sa1",
                "t": 1.0,
                "requests": [{"t": 1.0, "type": "n", "in": 8, "out": 2, "hash_ids": [1, 2]}],
            },
            {
                "t": 2.0,
                "type": "s",
                "in": 12,
                "out": 3,
                "hash_ids": [1, 2, 4],
                "think_time": 0.5,
                "stop": "tool_use",
            },
        ],
    }
    s.update(over)
    return s


def test_round_trip_keeps_everything(tmp_path):
    sessions = generate(params_for("small", sessions=5, seed=3))
    path = trace.dump(sessions, tmp_path / "t.jsonl")
    again = trace.load(path)
    assert [s.to_json() for s in again] == [s.to_json() for s in sessions]


def test_unknown_fields_survive_and_walk_order(tmp_path):
    p = tmp_path / "one.json"
    p.write_text(json.dumps(_session(tool_tokens=7)))
    (s,) = trace.load(p)
    assert s.extra == {"tool_tokens": 7}
    assert s.requests[2].extra == {"stop": "tool_use"}
    walked = [(path, i, r.in_tokens) for path, i, r in s.iter_requests()]
    assert walked == [((), 0, 9), (("sa1",), 0, 8), ((), 1, 12)]


def test_array_and_directory(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps([_session(id="x"), _session(id="y")]))
    (tmp_path / "d" / "manifest.json").write_text("{}")
    assert [s.id for s in trace.load(tmp_path / "d")] == ["x", "y"]


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda s: s.pop("block_size"), "block_size", "positive integer"),
        (lambda s: s.update(hash_id_scope="world"), "hash_id_scope", "must be one of"),
        (lambda s: s["requests"][0].pop("in"), "requests[0].in", "missing"),
        (lambda s: s["requests"][0].update(out=-1), "requests[0].out", ">= 0"),
        (
            lambda s: s["requests"][0].update(hash_ids=[1, 2]),
            "requests[0].hash_ids",
            "expected ceil(in=9 / block_size=4) = 3",
        ),
        (
            lambda s: s["requests"][0].update(hash_ids=[1, "2", 3]),
            "requests[0].hash_ids[1]",
            "integer",
        ),
        (
            lambda s: s["requests"][1]["requests"][0].update(t=-1),
            "requests[1].requests[0].t",
            ">= 0",
        ),
        (lambda s: s["requests"][2].update(type="x"), "requests[2].type", "'s', 'n' or"),
        (lambda s: s["requests"][2].update(think_time="soon"), "requests[2].think_time", "number"),
        (lambda s: s.update(requests=[]), "requests", "non-empty"),
    ],
)
def test_bad_field_is_named(tmp_path, mutate, field, words):
    s = _session()
    mutate(s)
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(_session(id="good")) + "\n" + json.dumps(s) + "\n")
    with pytest.raises(TraceError) as e:
        trace.load(p)
    msg = str(e.value)
    assert "line 2" in msg and "session 'abc'" in msg and f"{field}:" in msg, msg
    assert words in msg, msg


def test_truncated_file(tmp_path):
    p = tmp_path / "t.jsonl"
    text = json.dumps(_session(id="a")) + "\n" + json.dumps(_session(id="b"))
    p.write_text(text[:-25])
    with pytest.raises(TraceError, match=r"t.jsonl line 2: truncated JSON"):
        trace.load(p)
    q = tmp_path / "t.json"
    q.write_text(json.dumps([_session()])[:-10])
    with pytest.raises(TraceError, match=r"t.json: truncated JSON"):
        trace.load(q)


def test_missing_id_empty_file_duplicates(tmp_path):
    p = tmp_path / "t.jsonl"
    s = _session()
    del s["id"]
    p.write_text(json.dumps(s))
    with pytest.raises(TraceError, match=r"line 1: id: must be a non-empty string"):
        trace.load(p)
    p.write_text("")
    with pytest.raises(TraceError, match="empty file"):
        trace.load(p)
    p.write_text(json.dumps(_session()) + "\n" + json.dumps(_session()))
    with pytest.raises(TraceError, match="session 'abc': id: duplicate"):
        trace.load(p)
    with pytest.raises(TraceError, match="no such file"):
        trace.load(tmp_path / "nope.jsonl")
