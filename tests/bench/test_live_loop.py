"""bench/live_loop.py's pure parts: the static shapes it is given and the
report comparing Auto with each shape held fixed on the same trace. The run
itself needs root and engines (`make live-loop`)."""

from __future__ import annotations

import argparse

import pytest

from bench.live_loop import main, parse_shape, render_report, trace_goodput


def step(c: int, start: float, goodput: float, ttft: float, failures: int = 0) -> dict:
    return {
        "concurrency": c,
        "from": start,
        "to": start + 60.0,
        "requests": 40,
        "failures": failures,
        "goodput_rps": goodput,
        "ttft_p90_s": ttft,
        "interactivity_p90": 3.0,
    }


def test_shapes_are_p_colon_d_of_at_least_one():
    assert parse_shape("2:1") == {"prefill": 2, "decode": 1}
    for bad in ("2", "1:0", "00:1", "a:1", "1:2:3", ":1"):
        with pytest.raises(argparse.ArgumentTypeError, match="P:D"):
            parse_shape(bad)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--static", "1:x"], "P:D"),
        (["--no-auto"], "--no-auto needs --static"),
        (["--static", "1:1", "--auto-from", "d"], "--auto-from goes with --no-auto"),
        (["--static", "3:1"], "above --max-prefill"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_the_report_compares_auto_with_each_static_shape_per_step():
    result = {
        "command": "live_loop --static 1:1,1:2",
        "load_average_start": "1 1 1",
        "load_average_end": "2 2 2",
        "slo": {"ttftP90Ms": 8000, "interactivityP90": 2.5},
        "step_s": 60.0,
        "auto": {
            "steps": [step(2, 0, 0.9, 3.1), step(6, 60, 1.4, 6.2)],
            "run": "/runs/b",
            "step_s": 150.0,
        },
        "static": [
            {
                "shape": "1:1",
                "steps": [step(2, 200, 0.8, 3.0), step(6, 260, 1.0, 9.0, failures=1)],
                "served_per_pod": {"p-0": 30.0, "d-0": 30.0},
            },
            {
                "shape": "1:2",
                "steps": [step(2, 400, 0.85, 3.2), step(6, 460, 1.3, 6.0)],
                "served_per_pod": {"p-0": 30.0, "d-0": 20.0, "d-1": 0.0},
            },
        ],
    }
    report = render_report(result)
    assert "| step (sessions) | Auto | static 1:1 | static 1:2 |" in report
    assert "| 6 | 1.400 / 6.2 / 3.0 (0 failed) | 1.000 / 9.0 / 3.0 (1 failed) |" in report
    assert "| whole trace, goodput | 1.150 | 0.900 | 1.075 |" in report
    assert "best static over the trace: 1:2 (1.075 req/s" in report
    assert "Auto from the earlier run /runs/b (150 s steps; these: 60 s)" in report
    assert "static 1:2: pods that served nothing: d-1" in report
    assert trace_goodput(result["static"][0]["steps"]) == pytest.approx(0.9)
