"""Anthropic's Messages API through the router with the official `anthropic`
client, on the P/D stack: plain and streamed replies, a multi-turn tool loop,
and bad input answered in Anthropic's error format."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers import ADD_PARAMS, MODEL_NAME, TOOL_PARAMS, WEATHER_PARAMS

pytestmark = pytest.mark.stack

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city",
        "input_schema": WEATHER_PARAMS,
    },
    {"name": "add", "description": "Add two integers", "input_schema": ADD_PARAMS},
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.router_url, api_key="unused", max_retries=0)


# The SDK no longer offers sampling parameters; the Messages API still takes
# them (older clients send them), and greedy decoding keeps replies comparable.
GREEDY = {"extra_body": {"temperature": 0}}


def test_plain_and_streamed_replies_agree(stack, client):
    kwargs = dict(
        model=MODEL_NAME,
        max_tokens=24,
        **GREEDY,
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    reply = client.messages.create(**kwargs)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.id.startswith("msg_") and reply.model == MODEL_NAME
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens > 0
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text == final.content[0].text
    assert final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens

    # The system prompt reaches the model: the prompt is exactly the chat
    # template's rendering of it and the user turn.
    rendered = httpx.post(
        f"{stack.router_url}/tokenize",
        timeout=60,
        json={"messages": [{"role": "system", "content": kwargs["system"]}, *kwargs["messages"]]},
    ).json()
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == rendered["count"]
    counted = client.messages.count_tokens(
        model=MODEL_NAME, system=kwargs["system"], messages=kwargs["messages"]
    )
    assert counted.input_tokens == rendered["count"]


def _tool_uses(message, names=None):
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        assert use.id and use.name in (names or TOOL_PARAMS)
        jsonschema.validate(use.input, TOOL_PARAMS[use.name])
    return uses


def test_multi_turn_tool_loop(client):
    """Two forced calls, their results sent back as tool_result blocks, then
    a free answer: every turn is well-formed, the history round-trips."""
    messages = list(ASK)
    for name, result in (("get_weather", '{"temp_c": 18}'), ("add", "20")):
        reply = client.messages.create(
            model=MODEL_NAME,
            max_tokens=60,
            **GREEDY,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": name},
        )
        (use,) = _tool_uses(reply, [name])
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        messages += [
            {"role": "assistant", "content": content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": result},
                    {"type": "text", "text": "Now answer."},
                ],
            },
        ]
    final = client.messages.create(
        model=MODEL_NAME,
        max_tokens=30,
        **GREEDY,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "auto"},
    )
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    if final.stop_reason == "tool_use":
        _tool_uses(final)
    else:
        assert final.content and final.content[0].type == "text"
    # The last turn extends the first: its prompt is mostly served from cache.
    assert final.usage.cache_read_input_tokens > 0


def test_streamed_tool_use_any(client):
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=80,
        **GREEDY,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert len(_tool_uses(final)) == 1


def test_structured_output_format(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.messages.create(
        model=MODEL_NAME,
        max_tokens=60,
        **GREEDY,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)


BAD = {
    "unknown tool in tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
    ),
    "malformed input_schema": (
        {"tools": [{"name": "f", "input_schema": {"type": "banana"}}]},
        "tools[0].input_schema",
    ),
    "tool_result without a tool_use": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18"}],
                }
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
    "image block": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                    ],
                }
            ]
        },
        "messages[0].content[0].type",
    ),
    "missing max_tokens": ({"max_tokens": None}, "max_tokens"),
    "huge top_k": ({"top_k": 2**40}, "top_k"),
    "malformed output schema": (
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "banana"}}}},
        "output_config.format.schema",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_an_anthropic_400_naming_the_field(stack, name, stream):
    extra, field = BAD[name]
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, "stream": stream, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{stack.router_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_sdk_raises_the_matching_errors(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=4,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
        )
