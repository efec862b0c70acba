"""Tool calling, structured outputs and logprobs through the router with the
official `openai` client, on the P/D stack (prefill on one pod, decode with
the constraint on the other)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import ADD_PARAMS, MODEL_NAME, TOOL_PARAMS, WEATHER_PARAMS

pytestmark = pytest.mark.stack

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": WEATHER_PARAMS,
            "description": "Current weather in a city",
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "parameters": ADD_PARAMS, "description": "Add two integers"},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0)


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.id and c.type == "function"
        assert c.function.name in (names or TOOL_PARAMS)
        jsonschema.validate(json.loads(c.function.arguments), TOOL_PARAMS[c.function.name])


def test_named_tool_is_forced_and_schema_valid(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, ["add"])
    assert len(choice.message.tool_calls) == 1


def test_required_with_parallel_calls_off(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1


def test_required_streamed_and_reassembled(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert calls
    for entry in calls.values():
        assert entry["id"]
        jsonschema.validate(json.loads(entry["arguments"]), TOOL_PARAMS[entry["name"]])


def test_tool_round_trip_and_auto(client):
    """A call, its result in the history, and tool_choice auto: whatever the
    small model answers comes back correctly shaped."""
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'},
    ]
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=history,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=40,
            temperature=0,
            stream=stream,
        )
        if stream:
            chunks = [c for c in reply if c.choices]
            finish = chunks[-1].choices[0].finish_reason
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            called = any(c.choices[0].delta.tool_calls for c in chunks)
        else:
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            content, called = message.content or "", bool(message.tool_calls)
            if called:
                _check_calls(message.tool_calls)
        assert finish == ("tool_calls" if called else finish) and finish in (
            "stop",
            "length",
            "tool_calls",
        )
        assert called or content


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        temperature=0,
        max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_structured_outputs_choice(stack):
    response = httpx.post(
        f"{stack.router_url}/v1/chat/completions",
        timeout=120,
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Yes or no?"}],
            # A sampled choice may be spelled in up to a token a character
            # ('affirma' in 5 tokens was seen): room for the longest.
            "max_tokens": 16,
            "structured_outputs": {"choice": ["affirmative", "negative"]},
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("affirmative", "negative")


def test_chat_logprobs_match_the_text(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == reply.usage.completion_tokens
    assert "".join(t.token for t in tokens) == choice.message.content
    for t in tokens:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in tokens]


def test_completion_logprobs(client):
    reply = client.completions.create(
        model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=8, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


BAD = {
    "unknown tool in tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    "malformed schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "banana"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    "malformed tool parameters": (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    "tool message without a call": (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18"}]},
        "messages[1].tool_call_id",
    ),
    "huge seed": ({"seed": 1208925819614629174706176}, "seed"),
    "huge top_k": ({"top_k": 2**40}, "top_k"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_tool_and_schema_input_names_the_field(stack, name):
    extra, param = BAD[name]
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **extra}
    response = httpx.post(f"{stack.router_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
