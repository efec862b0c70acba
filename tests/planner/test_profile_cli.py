"""`tandem profile` (tandem/profile.py) against a real router process over a
fake gRPC engine of fixed latency (tests/planner/conftest.py): the replay at
rising concurrency, the router's counters read around each level, the
profile written as a ConfigMap the planner reads back. No mocks; the engine is
a fake so that the test takes seconds, not the minutes vLLM on CPU would."""

from __future__ import annotations

import json

import pytest

from operators.planner.profiles import profile_from_dict, profiles_from_yaml
from tandem.cli import main as tandem_main
from tests.planner.synthetic import FIRST_TOKEN_MS, TOKEN_DELAY_MS


def test_profile_writes_a_measured_profile(fake_router, tmp_path):
    out = tmp_path / "profile.yaml"
    rc = tandem_main(
        [
            "profile",
            "--role",
            "aggregated",
            "--url",
            fake_router,
            "--concurrencies",
            "1,2",
            "--level-s",
            "4",
            "--sessions",
            "3",
            "--no-verify",
            "--think-scale",
            "0",
            "--no-progress",
            "--hardware",
            "fake",
            "--kv-capacity-tokens",
            "100000",
            "--out",
            str(tmp_path / "runs"),
            "-o",
            str(out),
            "--wait-ready",
            "30",
            "--result-file",
            str(tmp_path / "result"),
        ]
    )
    assert rc == 0
    [profile] = profiles_from_yaml(out.read_text())
    # The same profile, compact, where a profile Job's pod leaves it (operators/profile.py).
    result = (tmp_path / "result").read_text()
    assert profile_from_dict(json.loads(result)) == profile and len(result.encode()) <= 4096
    assert profile.source == "measured" and profile.role == "aggregated"
    assert profile.config.hardware == "fake" and profile.config.kv_capacity_tokens == 100_000
    assert [p.concurrency for p in profile.points] == [1.0, 2.0]
    one, two = profile.points
    # The pool's load comes from the router's busy-time counter: the time requests
    # spent in the engine's Generate, which the fake makes at least 200 ms + 20 ms
    # per further token (more when a busy machine delays the router reading the
    # stream). The client's E2E adds the router's own time on top.
    # (Sub-agents run beside their parent's lane: a lane can have several
    # requests in flight.)
    for point, c in ((one, 1), (two, 2)):
        run = json.loads((tmp_path / "runs" / f"c{c}" / "run.json").read_text())
        ok = [r for r in run["records"] if r["ok"]]
        seconds = run["summary"]["duration_s"]
        in_engine = (
            sum(FIRST_TOKEN_MS / 1e3 + (r["output_tokens"] - 1) * TOKEN_DELAY_MS / 1e3 for r in ok)
            / seconds
        )
        assert in_engine * 0.9 <= point.in_flight <= sum(r["e2e"] for r in ok) / seconds
        assert point.request_rate == pytest.approx(run["summary"]["requests_per_s"], rel=0.15)
    assert two.in_flight > one.in_flight
    assert one.hit_rate == 0.0  # the fake reports no cache hits
    mean_out = one.output_tokens_per_s / one.request_rate
    assert one.ttft_p50_s >= 0.2 and one.itl_s == pytest.approx(0.02, abs=0.01)
    assert one.interactivity_p90 < 1 / 0.02 and mean_out > 1


def test_profile_refuses_bad_arguments(fake_router, tmp_path):
    assert (
        tandem_main(
            [
                "profile",
                "--role",
                "prefill",
                "--url",
                fake_router,
                "--concurrencies",
                "0,2",
                "--out",
                str(tmp_path),
                "--result-file",
                str(tmp_path / "result"),
            ]
        )
        == 2
    )
    # A profile Job's termination message says why.
    assert (tmp_path / "result").read_text().startswith("tandem profile: error: --concurrencies")
