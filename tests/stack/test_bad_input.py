"""Bad input gets an OpenAI-format error with the right status, and the stack
keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import MODEL_NAME, chat

pytestmark = pytest.mark.stack

M = MODEL_NAME
USER = [{"role": "user", "content": "hi"}]
CASES = {
    "malformed json": ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    "not an object": ("/v1/chat/completions", b"[1, 2]", 400, None),
    "missing messages": ("/v1/chat/completions", {"model": M}, 400, "messages"),
    "empty messages": ("/v1/chat/completions", {"model": M, "messages": []}, 400, "messages"),
    "bad role": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        None,
    ),
    "image part": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "messages[0].content[0]",
    ),
    "unknown model": ("/v1/chat/completions", {"model": "gpt-9", "messages": USER}, 404, "model"),
    "negative temperature": (
        "/v1/chat/completions",
        {"model": M, "messages": USER, "temperature": -0.5},
        400,
        "temperature",
    ),
    "top_p zero": (
        "/v1/chat/completions",
        {"model": M, "messages": USER, "top_p": 0},
        400,
        "top_p",
    ),
    "max_tokens zero": (
        "/v1/chat/completions",
        {"model": M, "messages": USER, "max_tokens": 0},
        400,
        "max_tokens",
    ),
    "n=17": ("/v1/chat/completions", {"model": M, "messages": USER, "n": 17}, 400, "n"),
    "max_tokens beyond context": (
        "/v1/chat/completions",
        {"model": M, "messages": USER, "max_tokens": 100_000},
        400,
        "max_tokens",
    ),
    "prompt beyond context": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "word " * 6000}]},
        400,
        "messages",
    ),
    "empty completion prompt": ("/v1/completions", {"model": M, "prompt": ""}, 400, "prompt"),
    "negative token id": ("/v1/completions", {"model": M, "prompt": [1, -3]}, 400, "prompt"),
    "token id beyond uint32": ("/v1/completions", {"model": M, "prompt": [2**32]}, 400, "prompt"),
    "missing model": ("/v1/completions", {"prompt": "x"}, 400, "model"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_openai_error(stack, name):
    path, body, status, param = CASES[name]
    if isinstance(body, bytes):
        response = httpx.post(
            f"{stack.router_url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
    else:
        response = httpx.post(f"{stack.router_url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if "context" in name:
        assert error["code"] == "context_length_exceeded"


def test_unknown_path_is_openai_error(stack):
    response = httpx.get(f"{stack.router_url}/v1/nothing", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["message"]


def test_stack_keeps_serving_after_bad_input(stack):
    response = chat(stack.router_url, MODEL_NAME, "Name a prime number.", max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
