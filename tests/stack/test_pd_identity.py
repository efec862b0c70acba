"""Greedy output through the router's P/D path (prefill engine → NIXL →
decode engine) is token-identical to vLLM's own aggregated OpenAI server
with the same model and dtype. Real services, no mocks."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import LONG_CONTEXT, MODEL_NAME, chat, engine, metric_value

pytestmark = pytest.mark.stack

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a compiler.",
    LONG_CONTEXT + "\nSummarize the steps above in one sentence.",
]


def _external_kv_tokens(stack) -> float:
    text = httpx.get(engine(stack, "decode").url, timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total")
        and 'source="external_kv_transfer"' in line
    )


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "haiku", "long"])
def test_chat_greedy_is_token_identical(stack, reference, prompt):
    before = _external_kv_tokens(stack)
    ours = chat(stack.router_url, MODEL_NAME, prompt, temperature=0, max_tokens=48)
    theirs = chat(reference, MODEL_NAME, prompt, temperature=0, max_tokens=48)
    assert ours.status_code == 200, ours.text
    assert theirs.status_code == 200, theirs.text
    a, b = ours.json(), theirs.json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
    # The prompt's KV really came over NIXL from the prefill engine (all full
    # blocks; the decode engine computes at most the last partial block).
    moved = _external_kv_tokens(stack) - before
    assert moved > 0, "the decode engine received no KV from the prefill engine"


def test_completions_greedy_is_token_identical(stack, reference):
    body = {
        "model": MODEL_NAME,
        "prompt": "The three laws of robotics are",
        "temperature": 0,
        "max_tokens": 40,
    }
    ours = httpx.post(f"{stack.router_url}/v1/completions", json=body, timeout=300)
    theirs = httpx.post(f"{reference}/v1/completions", json=body, timeout=300)
    assert ours.status_code == 200, ours.text
    assert ours.json()["choices"][0]["text"] == theirs.json()["choices"][0]["text"]
    assert ours.json()["usage"]["completion_tokens"] == theirs.json()["usage"]["completion_tokens"]


def test_no_request_fell_back_to_local_prefill(stack):
    text = httpx.get(f"{stack.router_url}/metrics", timeout=10).text
    for reason in ("no_prefill_pods", "prefill_unavailable"):
        assert metric_value(text, "tandem_router_local_prefill_total", f'reason="{reason}"') == 0
