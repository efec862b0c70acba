"""A short agentic replay against the real embedded stack (router, prefill and
decode engines): it completes with zero failures, the server sees exactly the
prompts the replay built, and reports usage with cached tokens. The same small
workload through aiperf reaches the server with the same token structure.

No mocks. Uses the session-scoped ``stack`` fixture from tests/conftest.py
(``.router_url``, ``.model``). Timings are measured, never asserted.
"""

from __future__ import annotations

import json

import pytest

from bench import cli

pytestmark = pytest.mark.stack

# Two sessions of ~3 turns, each fanning out to ~2 sub-agents: about 14 short
# requests, a couple of minutes on a loaded 2-core machine.
TRACE_ARGS = [
    "--profile",
    "small",
    "--sessions",
    "2",
    "--turns-median",
    "3",
    "--seed",
    "7",
    "--subagent-share",
    "1.0",
    "--subagents-median",
    "2",
    "--think-median",
    "0.05",
    "--out-max",
    "16",
    "--out-median",
    "6",
]
# Generous: the first cold requests on a loaded 2-core machine have taken minutes.
TIMEOUT = "900"


def test_short_replay_completes_with_zero_failures(stack, tmp_path):
    out = tmp_path / "replay"
    rc = cli.main(
        [
            "replay",
            "--url",
            stack.router_url,
            "--model",
            stack.model,
            "--concurrency",
            "2",
            "--no-progress",
            "--timeout",
            TIMEOUT,
            "--out",
            str(out),
            "--label",
            "stack",
            *TRACE_ARGS,
        ]
    )
    run = json.loads((out / "run.json").read_text())
    s = run["summary"]
    failures = [r for r in run["records"] if not r["ok"]]
    assert rc == 0 and s["failures"] == 0, failures[:3]
    assert s["ok"] == run["trace"]["stats"]["requests"] == len(run["records"])
    # sub-agents ran: records exist for the main agents and their sub-agents
    assert {r["agent"] for r in run["records"]} >= {"", "sa1"}
    for r in run["records"]:
        # the server tokenized exactly what the replay built (block structure kept)
        assert r["prompt_tokens"] == r["expected_prompt_tokens"], r
        assert r["output_tokens"] == r["max_tokens"], r  # ignore_eos honoured
        assert r["cached_tokens"] is not None, "usage lacks prompt_tokens_details.cached_tokens"
        assert r["ttft"] is not None and r["e2e"] >= r["ttft"]
    assert s["hit_rate"] is not None and s["hit_rate"] > 0
    assert (out / "report.md").is_file() and (out / "ttft_cdf.png").is_file()
    _check_fork_join(run["records"])


def _check_fork_join(records):
    """Sub-agents of a fan-out start together; the parent's next turn starts
    only after every sub-agent request has finished."""
    by_session = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    forks = 0
    for rs in by_session.values():
        main = sorted((r for r in rs if r["agent"] == ""), key=lambda r: r["turn"])
        subs = [r for r in rs if r["agent"]]
        first_reqs = [r for r in subs if r["turn"] == 0]
        if not first_reqs:
            continue
        forks += 1
        firsts = [r["start"] for r in first_reqs]
        # "Together" = in flight at once: every sibling's first request was sent
        # before any of them finished. (Not a fixed gap in seconds: the client's
        # own event loop can be descheduled for a second on a starved 2-core box,
        # which delays its start and end stamps alike.)
        first_end = min(r["start"] + r["e2e"] for r in first_reqs)
        assert max(firsts) < first_end, "sub-agents did not run in parallel"
        spawned_after = max((r for r in main if r["start"] < min(firsts)), key=lambda r: r["start"])
        later = [r for r in main if r["turn"] > spawned_after["turn"]]
        sub_end = max(r["start"] + r["e2e"] for r in subs)
        assert later, "the parent has no turn after its sub-agents"
        assert later[0]["start"] >= sub_end, "parent resumed before its sub-agents finished"
    assert forks > 0


def test_aiperf_sends_the_same_prompts(stack, tmp_path):
    # Needs aiperf in its own venv: bench/setup_aiperf.sh (fails loudly if absent).
    out = tmp_path / "crosscheck"
    cli.main(
        [
            "crosscheck",
            "--url",
            stack.router_url,
            "--model",
            stack.model,
            "--concurrency",
            "2",
            "--no-progress",
            "--timeout",
            TIMEOUT,
            "--out",
            str(out),
            "--sessions",
            "2",
            "--turns-median",
            "3",
            "--seed",
            "8",
            "--subagent-share",
            "0",
            "--out-max",
            "16",
            "--out-median",
            "8",
        ]
    )
    path = out / "crosscheck.json"
    assert path.is_file(), "cross-check did not run (is aiperf installed? bench/setup_aiperf.sh)"
    doc = json.loads(path.read_text())
    assert doc["ours"]["failures"] == 0
    assert doc["aiperf"]["errors"] == 0
    assert doc["aiperf"]["requests"] == doc["requests"]
    pc = doc["aiperf"]["prompt_check"]
    assert pc["checked"] == doc["requests"] and pc["equal"] == pc["checked"], pc
