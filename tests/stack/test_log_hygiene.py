"""No prompt or completion text in any log the stack wrote at the default
level (router, prefill and decode engines, KV store): a recognisable prompt
through chat (whole and streamed), Messages and Responses, then every log
under the stack's state folder is searched for it and for the completions
the engines generated. The shared stack; a few seconds."""

from __future__ import annotations

import secrets

import httpx
import pytest

pytestmark = pytest.mark.stack


def test_no_prompt_or_completion_in_the_stack_logs(stack):
    tag = secrets.token_hex(6)
    prompt = f"Repeat after me, word for word: ocelot-{tag} pangolin-{tag}."
    url = stack.router_url
    chat = {
        "model": stack.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "temperature": 0,
    }
    with httpx.Client(base_url=url, timeout=120) as client:
        whole = client.post("/v1/chat/completions", json=chat)
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True})
        messages = client.post(
            "/v1/messages",
            json={"model": stack.model, "max_tokens": 16, "messages": chat["messages"]},
        )
        responses = client.post(
            "/v1/responses", json={"model": stack.model, "input": prompt, "max_output_tokens": 16}
        )
    for response in (whole, streamed, messages, responses):
        assert response.status_code == 200, response.text
    completion = whole.json()["choices"][0]["message"]["content"]
    # Long enough that finding it in a log cannot be chance (the model may
    # answer with the tagged word alone: "Ocelot-<12 hex digits>", 19 chars).
    assert len(completion) >= 16, completion
    logs = [p for p in stack.config.state_dir.rglob("*.log") if p.is_file()]
    assert {p.name for p in logs} >= {"router.log"}, logs
    for path in logs:
        text = path.read_text(errors="replace")
        assert tag not in text, f"{path} holds the prompt"
        assert completion not in text, f"{path} holds a completion: {completion!r}"
