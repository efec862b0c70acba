"""The pure parts of tool calling and structured outputs: checking tools,
tool_choice and history, the forcing schema, reading forced calls back, and
response_format to the wire's constraint. No engines."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.router.api.chat.structured import from_response_format, from_structured_outputs
from services.router.api.chat.tools import (
    ForcedCalls,
    ToolChoice,
    check_history,
    check_tools,
    forced_constraint,
    parse_forced,
    resolve_choice,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = check_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "now"}},
    ]
)


@pytest.mark.parametrize(
    "tools, field",
    [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "tools[1].function.name"),
    ],
)
def test_malformed_tools_name_the_field(tools, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}:"):
        check_tools(tools)


def test_tool_choice_resolution():
    assert resolve_choice(None, TOOLS) == ToolChoice("auto")
    assert resolve_choice(None, []) == ToolChoice("none")
    assert resolve_choice("required", TOOLS) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "now"}}
    assert resolve_choice(named, TOOLS) == ToolChoice("named", "now")
    for bad in ({"type": "function", "function": {"name": "nope"}}, "always", 3):
        with pytest.raises(ValueError, match="^tool_choice"):
            resolve_choice(bad, TOOLS)
    with pytest.raises(ValueError, match="^tool_choice"):
        resolve_choice("required", [])


def test_history_needs_a_call_before_each_tool_message():
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    check_history(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ]
    )
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_call_id"):
        check_history(
            [
                {"role": "user", "content": "x"},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            ]
        )
    with pytest.raises(ValueError, match=r"^messages\[0\]\.tool_call_id"):
        check_history([{"role": "tool", "content": "12:00"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.tool_calls"):
        check_history([{"role": "user", "content": "x", "tool_calls": [call]}])


def _schema(choice, parallel=True):
    return json.loads(forced_constraint(choice, TOOLS, parallel).json_schema)


def test_forcing_schemas_accept_what_the_parser_reads_back():
    named = ToolChoice("named", "get_weather")
    assert _schema(named) == WEATHER
    jsonschema.validate({"city": "Oslo"}, _schema(named))
    required = _schema(ToolChoice("required"), parallel=False)
    output = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(output, required)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel
        jsonschema.validate(output * 2, required)
    with pytest.raises(jsonschema.ValidationError):  # arguments must match the tool
        jsonschema.validate([{"name": "get_weather", "arguments": {"town": 1}}], required)
    jsonschema.validate(output * 2, _schema(ToolChoice("required")))
    calls = parse_forced(json.dumps(output), ToolChoice("required"))
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert forced_constraint(ToolChoice("auto"), TOOLS, True) is None
    assert forced_constraint(named, TOOLS, True).compact


def test_forced_calls_stream_whole_at_the_end_and_cut_output_stays_text():
    reader = ForcedCalls(ToolChoice("named", "get_weather"))
    assert reader.delta('{"city": ', [1], final=False) is None
    delta = reader.delta('"Oslo"}', [2], final=True)
    assert delta["tool_calls"][0]["index"] == 0 and reader.called
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    cut = ForcedCalls(ToolChoice("named", "get_weather"))
    assert cut.whole('{"city": "Os') == ('{"city": "Os', []) and not cut.called


def test_response_format():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).json_object
    constraint = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    )
    assert json.loads(constraint.json_schema) == WEATHER
    for bad, field in (
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "w", "schema": {"minimum": "a"}}},
            "response_format.json_schema.schema",
        ),
    ):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}:"):
            from_response_format(bad)


def test_structured_outputs_option():
    assert list(from_structured_outputs({"choice": ["a", "b"]}).choice.values) == ["a", "b"]
    assert from_structured_outputs({"regex": "[0-9]+"}).regex == "[0-9]+"
    assert json.loads(from_structured_outputs({"json": json.dumps(WEATHER)}).json_schema)
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"xml": "a"}):
        with pytest.raises(ValueError, match="^structured_outputs"):
            from_structured_outputs(bad)
