"""Generator statistics match their parameters on a large seeded sample.
No mocks, no server."""

from __future__ import annotations

import statistics

import pytest

from tandem.workload.generate import generate, params_for, trace_stats
from tandem.workload.trace import Request, Subagent

# Contexts large enough that a 96% per-turn reuse is feasible (the previous
# output and the partial last block are small against the input).
LARGE = dict(
    sessions=800,
    seed=11,
    first_in_median=8000,
    shared_prefix=1024,
    max_context=60000,
    turns_median=10,
)


@pytest.fixture(scope="module")
def sample():
    p = params_for("small", **LARGE)
    return p, generate(p)


def test_same_seed_same_trace_other_seed_differs():
    a = generate(params_for("small", sessions=5, seed=1))
    b = generate(params_for("small", sessions=5, seed=1))
    c = generate(params_for("small", sessions=5, seed=2))
    assert [s.to_json() for s in a] == [s.to_json() for s in b]
    assert [s.to_json() for s in a] != [s.to_json() for s in c]


def test_statistics_match_parameters(sample):
    p, sessions = sample
    st = trace_stats(sessions)
    assert st["sessions"] == p.sessions
    # turn count: lognormal with this median (clamped at turns_min)
    assert abs(st["turns_median"] - p.turns_median) <= 1
    # share of sessions spawning sub-agents: binomial, 3 sigma ~ 0.053 at n=800
    assert abs(st["subagent_share"] - p.subagent_share) < 0.055
    assert st["subagents_per_fanout_median"] == p.subagents_median
    # block-level prefix reuse of each turn vs the previous turn of its agent
    assert abs(st["reuse_mean"] - p.reuse) < 0.01, st["reuse_mean"]
    assert st["reuse_bound"] > 0.9
    assert abs(st["out_p50"] - p.out_median) <= 2
    assert abs(st["think_p50"] - p.think_median) < 0.1
    assert st["in_max"] + p.out_max <= p.max_context


def test_structure_invariants(sample):
    p, sessions = sample
    shared = list(range(1, p.shared_prefix // p.block_size + 1))
    for s in sessions[:200]:
        assert s.hash_id_scope == "global"
        first = s.requests[0]
        assert first.hash_ids[: len(shared)] == shared  # common prefix
        for _, _, r in s.iter_requests():
            assert len(r.hash_ids) == -(-r.in_tokens // p.block_size)
            assert 1 <= r.out_tokens <= p.out_max
        main = [e for e in s.requests if isinstance(e, Request)]
        for prev, cur in zip(main, main[1:]):
            assert cur.t > prev.t
        # sub-agents fork the parent's context: they start with the parent's
        # last request's full blocks, and the parent's next turn follows them
        for i, e in enumerate(s.requests):
            if isinstance(e, Subagent):
                parent = next(x for x in reversed(s.requests[:i]) if isinstance(x, Request))
                full = parent.hash_ids[: parent.in_tokens // p.block_size]
                sub_first = e.requests[0]
                assert sub_first.hash_ids[: len(full)] == full
                assert any(isinstance(x, Request) for x in s.requests[i + 1 :])


def test_small_profile_fits_a_4096_token_engine():
    p = params_for("small", sessions=300, seed=5)
    st = trace_stats(generate(p))
    assert st["in_max"] + p.out_max < 4096
    assert 0.9 < st["reuse_mean"] < p.reuse + 0.005
    assert statistics.median([st["turns_median"]]) == pytest.approx(p.turns_median, abs=1)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="reuse"):
        params_for("small", reuse=1.5)
    with pytest.raises(ValueError, match="unknown profile"):
        params_for("huge")
    with pytest.raises(ValueError, match="max_context"):
        params_for("small", max_context=1000)
