"""A multi-turn session through the router's HTTP API, on a stack of two
aggregated engines that publish KV events: every turn carrying the same
``x-session-id`` lands on the same engine, and for every turn the router's
predicted cached-token count equals the ``cached_tokens`` the engine reports.
Real engines, real ZMQ events; the router's side is read from its /metrics,
the engines' side from their own /metrics and the responses."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import pytest

from tests.helpers import MODEL_NAME, metric_value, wait_for

pytestmark = pytest.mark.stack

RULES = " ".join(
    f"Rule {i}: answer in at most {i + 3} words and never mention rule {i + 1}." for i in range(24)
)


@pytest.fixture(scope="module")
def two_engines(aggregated_engines):
    """The session-wide aggregated engines (tests/conftest.py): 32-token
    blocks, cost policy, the tools template."""
    return aggregated_engines


def _router_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def _finished_requests(engine_metrics_url: str) -> float:
    text = httpx.get(engine_metrics_url, timeout=30).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def _event_batches(text: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tandem_routing_kv_event_batches_total{")
    )


def test_session_sticks_and_prediction_equals_engine_cached_tokens(two_engines):
    url = two_engines.router_url
    engines = [p for p in two_engines.procs if p.name.startswith("engine")]
    assert len(engines) == 2
    finished_before = {p.name: _finished_requests(p.url) for p in engines}
    session = f"agent-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": RULES}]
    turns = []  # (engine-reported cached tokens, router-predicted cached tokens)
    for turn in range(4):
        messages.append(
            {"role": "user", "content": f"Turn {turn}: which rules mention the number {turn + 2}?"}
        )
        before = _router_metrics(url)
        response = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"x-session-id": session},
            json={"model": MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 12},
            timeout=600,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        after = _router_metrics(url)
        reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = metric_value(
            after, "tandem_routing_predicted_cached_tokens_total"
        ) - metric_value(before, "tandem_routing_predicted_cached_tokens_total")
        actual = metric_value(after, "tandem_routing_actual_cached_tokens_total") - metric_value(
            before, "tandem_routing_actual_cached_tokens_total"
        )
        assert actual == reported, "the router recorded another count than the engine reported"
        turns.append((reported, predicted))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        # The engine's KV events for this turn reach the router before the next turn.
        assert wait_for(
            lambda before=before: _event_batches(_router_metrics(url)) > _event_batches(before),
            timeout=60,
        ), "no KV events reached the router"
    print("(reported, predicted) cached tokens per turn:", turns)
    assert all(reported == predicted for reported, predicted in turns), turns
    assert all(reported > 0 for reported, _ in turns[1:]), turns  # later turns hit the cache

    finished = {p.name: _finished_requests(p.url) - finished_before[p.name] for p in engines}
    assert sorted(finished.values()) == [0, 4], f"the session moved between engines: {finished}"
    text = _router_metrics(url)
    assert metric_value(text, "tandem_routing_prediction_total", 'outcome="exact"') >= 4
    assert (
        metric_value(text, "tandem_routing_decisions_total", 'policy="cost",reason="sticky"') == 3
    )


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_forced_tool_call_and_json_schema_on_aggregated_engines(two_engines):
    """The aggregated path applies the constraint too (no prefill pod)."""
    url = f"{two_engines.router_url}/v1/chat/completions"
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    reply = httpx.post(
        url,
        timeout=300,
        json={
            "model": MODEL_NAME,
            "messages": ask,
            "max_tokens": 40,
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
        },
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    jsonschema.validate(
        json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), CITY
    )
    reply = httpx.post(
        url,
        timeout=300,
        json={
            "model": MODEL_NAME,
            "messages": ask,
            "max_tokens": 40,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": CITY},
            },
        },
    )
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), CITY)


def test_messages_and_responses_forced_tools_on_aggregated_engines(two_engines):
    """Anthropic Messages and OpenAI Responses on the aggregated path: a forced
    tool call comes back as the API's own tool block, schema-valid."""
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    reply = httpx.post(
        f"{two_engines.router_url}/v1/messages",
        timeout=300,
        json={
            "model": MODEL_NAME,
            "max_tokens": 40,
            "messages": ask,
            "tools": [{"name": "weather", "input_schema": CITY}],
            "tool_choice": {"type": "tool", "name": "weather"},
        },
    )
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["stop_reason"] == "tool_use"
    (use,) = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use["name"] == "weather"
    jsonschema.validate(use["input"], CITY)
    reply = httpx.post(
        f"{two_engines.router_url}/v1/responses",
        timeout=300,
        json={
            "model": MODEL_NAME,
            "max_output_tokens": 40,
            "input": ask,
            "tools": [{"type": "function", "name": "weather", "parameters": CITY}],
            "tool_choice": {"type": "function", "name": "weather"},
        },
    )
    assert reply.status_code == 200, reply.text
    (call,) = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert call["name"] == "weather"
    jsonschema.validate(json.loads(call["arguments"]), CITY)
