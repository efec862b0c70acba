"""Reasoning through the router: a second router in front of the P/D stack's
engines with ``--reasoning-parser olmo3`` (vLLM's parser for `<think>` in
plain text). SmolLM2 does not think on its own, so the output's shape is
forced with vLLM's structured output (a regex), and the split is checked
whole and streamed; the Messages and Responses paths accept `thinking` /
answer on that router, and refuse `thinking` on one without a parser."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from common.ports import free_port
from common.procs import launch, stop_process_group, wait_http_ok
from tests.helpers import MODEL_NAME, TOOLS_TEMPLATE

pytestmark = pytest.mark.stack

THINK = {"regex": r"<think>[a-z ]{5,40}</think>[A-Z][a-z ]{3,40}\."}
ASK = [{"role": "user", "content": "What is two and two?"}]


@pytest.fixture(scope="module")
def reasoning_router(stack, tmp_path_factory):
    port = free_port()
    argv = stack.router_argv(
        port,
        [
            "--remote-prefill-threshold",
            "0",
            "--chat-template",
            str(TOOLS_TEMPLATE),
            "--reasoning-parser",
            "olmo3",
        ],
    )
    log = tmp_path_factory.mktemp("reasoning-router") / "router.log"
    proc, popen = launch("reasoning-router", argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc, time.monotonic() + 300)
        yield url
    finally:
        stop_process_group(proc, grace_s=10)
        popen.wait(timeout=10)


def test_chat_reasoning_content_whole_and_streamed(reasoning_router):
    client = openai.OpenAI(base_url=f"{reasoning_router}/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": THINK},
    )
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and "think>" not in message.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get(
                "reasoning_content"
            ) or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}


def test_messages_and_responses_answer_with_a_reasoning_parser(reasoning_router):
    client = anthropic.Anthropic(base_url=reasoning_router, api_key="unused", max_retries=0)
    reply = client.messages.create(
        model=MODEL_NAME,
        max_tokens=16,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens")
    responses = openai.OpenAI(base_url=f"{reasoning_router}/v1", api_key="unused", max_retries=0)
    response = responses.responses.create(
        model=MODEL_NAME, input="What is two and two?", max_output_tokens=16, temperature=0
    )
    assert response.output and response.status in ("completed", "incomplete")


def test_thinking_without_a_parser_is_a_400(stack):
    response = httpx.post(
        f"{stack.router_url}/v1/messages",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "max_tokens": 8,
            "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("thinking:")
