"""`python -m tandem.smoke`, the chart's `helm test`: against the real router, and its verdicts.

The stack test runs the exact command the helm test pod runs against the
embedded stack's router (real vLLM engines, P/D over NIXL); no mocks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.smoke import reply_problems
from tests.helm.chart import REPO, one, render

GOOD = {
    "object": "chat.completion",
    "choices": [{"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3},
}


def test_a_good_reply_passes():
    assert reply_problems(200, GOOD) == []


@pytest.mark.parametrize(
    "status,body,why",
    [
        (500, {"error": {"message": "boom"}}, "HTTP 500"),
        (200, "not json", "not a JSON object"),
        (200, {**GOOD, "object": "text_completion"}, "not 'chat.completion'"),
        (200, {**GOOD, "choices": []}, "0 choices"),
        (
            200,
            {**GOOD, "choices": [{"message": {"content": " "}, "finish_reason": "stop"}]},
            "content is empty",
        ),
        (
            200,
            {**GOOD, "choices": [{"message": {"content": "x"}, "finish_reason": "abort"}]},
            "finish_reason",
        ),
        (200, {**GOOD, "usage": {}}, "usage lacks token counts"),
    ],
)
def test_a_bad_reply_says_why(status, body, why):
    problems = reply_problems(status, body)
    assert any(why in p for p in problems), problems


def test_an_absent_router_fails_within_the_timeout():
    done = subprocess.run(
        [sys.executable, "-m", "tandem.smoke", "--url", "http://127.0.0.1:9", "--timeout-s", "3"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "did not become healthy" in done.stderr


@pytest.mark.stack
def test_the_helm_test_command_passes_against_the_real_router(stack):
    pod = one(render({}), "Pod")["spec"]["containers"][0]
    assert pod["command"][0] == "python"  # the image's; here, this venv's
    args = [a for a in pod["args"] if not a.startswith("--url=")]
    done = subprocess.run(
        [sys.executable, *pod["command"][1:], *args, f"--url={stack.router_url}"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"OK: {stack.model} answered")
