"""OpenAI's Responses API through the router with the official `openai`
client, on the P/D stack: create, stream, `previous_response_id`, a
multi-turn function-tool loop, and bad input in OpenAI's error format."""

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
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS,
        "strict": True,
    },
    {
        "type": "function",
        "name": "add",
        "description": "Add two integers",
        "parameters": ADD_PARAMS,
        "strict": True,
    },
]
ASK = "What is the weather in Paris, in celsius?"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0)


def test_create_stream_and_retrieve_agree(client):
    kwargs = dict(
        model=MODEL_NAME,
        input="What is the capital of France?",
        instructions="You answer in one short sentence.",
        max_output_tokens=24,
        temperature=0,
    )
    response = client.responses.create(**kwargs)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0

    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == response.output_text
    assert final.status == response.status

    stored = client.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text


def _calls(response, names=None):
    calls = [i for i in response.output if i.type == "function_call"]
    assert calls
    for c in calls:
        assert c.call_id and c.name in (names or TOOL_PARAMS)
        jsonschema.validate(json.loads(c.arguments), TOOL_PARAMS[c.name])
    return calls


def test_tool_loop_over_previous_response_id(client):
    """Forced calls, their outputs sent back as function_call_output items on
    top of `previous_response_id`, then a free answer; the follow-up turns
    reuse the conversation's KV (cached tokens)."""
    response = client.responses.create(
        model=MODEL_NAME,
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = _calls(response, ["get_weather"])
    response = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=response.id,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'},
            {"role": "user", "content": "Now add 2 and 3."},
        ],
    )
    (call,) = _calls(response)
    assert response.usage.input_tokens_details.cached_tokens > 0
    with client.responses.stream(
        model=MODEL_NAME,
        previous_response_id=response.id,
        tools=TOOLS,
        tool_choice="auto",
        max_output_tokens=30,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
    ) as stream:
        final = stream.get_final_response()
    assert final.status in ("completed", "incomplete")
    assert final.previous_response_id == response.id
    assert final.output and final.usage.input_tokens_details.cached_tokens > 0


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="Describe a person as JSON.",
        max_output_tokens=60,
        temperature=0,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


BAD = {
    "unknown tool in tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice.name",
    ),
    "malformed schema": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "banana"}}}},
        "text.format.schema",
    ),
    "output without a call": (
        {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "18"}]},
        "input[0].call_id",
    ),
    "huge max_output_tokens": ({"max_output_tokens": 2**40}, "max_output_tokens"),
    "built-in tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_an_openai_400_naming_the_field(stack, name, stream):
    extra, param = BAD[name]
    body = {"model": MODEL_NAME, "input": ASK, "stream": stream, **extra}
    response = httpx.post(f"{stack.router_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_previous_response_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_x")
    assert caught.value.body["param"] == "previous_response_id"
