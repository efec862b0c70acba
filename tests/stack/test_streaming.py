"""Streaming and non-streaming give the same text; the SSE stream is
well-formed and ends with [DONE]. Real stack."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import MODEL_NAME, chat, sse_events, stream_text

pytestmark = pytest.mark.stack


def test_chat_stream_matches_whole(stack):
    prompt = "List three uses of a hash map."
    whole = chat(stack.router_url, MODEL_NAME, prompt, temperature=0, max_tokens=40)
    streamed = chat(
        stack.router_url,
        MODEL_NAME,
        prompt,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert whole.status_code == 200 and streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole.json()["usage"] | {
        "prompt_tokens_details": chunks[-1]["usage"]["prompt_tokens_details"]
    }
    assert stream_text(events[:-1] + ["[DONE]"]) == whole.json()["choices"][0]["message"]["content"]


def test_completions_stream_matches_whole(stack):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 24}
    whole = httpx.post(f"{stack.router_url}/v1/completions", json=body, timeout=300)
    streamed = httpx.post(
        f"{stack.router_url}/v1/completions", json=body | {"stream": True}, timeout=300
    )
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    assert stream_text(events, field="text") == whole.json()["choices"][0]["text"]
