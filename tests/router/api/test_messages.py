"""The Messages API translation (`api/messages/translate.py`), pure: requests onto
chat, chat responses and stream chunks back, checked against the official
`anthropic` SDK's own types. No engines."""

from __future__ import annotations

import json

import anthropic.types as at
import pytest
from pydantic import TypeAdapter, ValidationError

from services.router.api.messages.protocol import MessagesRequest
from services.router.api.messages.translate import MessagesStream, message_from_chat, to_chat
from tests.helpers import chat_completion

TOOL = {
    "name": "add",
    "description": "Add",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
}


def _request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_system_sampling_and_user_map_onto_chat():
    chat = to_chat(
        _request(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            temperature=0.5,
            top_k=3,
            stop_sequences=["END"],
            metadata={"user_id": "u1"},
            stream=True,
        )
    )
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.stop, chat.user, chat.stream) == (
        8,
        0.5,
        3,
        ["END"],
        "u1",
        True,
    )


def test_tool_history_becomes_chat_tool_calls_and_tool_messages():
    chat = to_chat(
        _request(
            tools=[TOOL],
            tool_choice={"type": "auto"},
            messages=[
                {"role": "user", "content": "add 2"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Calling."},
                        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "4"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "bad",
                            "is_error": True,
                        },
                        {"type": "text", "text": "and "},
                        {"type": "text", "text": "then?"},
                    ],
                },
            ],
        )
    )
    assert chat.template_messages() == [
        {"role": "user", "content": "add 2"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "4"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: bad"},
        {"role": "user", "content": "and then?"},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add", "parameters": TOOL["input_schema"]},
        }
    ]
    assert chat.tool_choice == "auto"


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "any"}, "required", True),
        ({"type": "none"}, "none", True),
        (
            {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
            {"type": "function", "function": {"name": "add"}},
            False,
        ),
    ],
)
def test_tool_choice(choice, expected, parallel):
    chat = to_chat(_request(tools=[TOOL], tool_choice=choice))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "sub"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tools": [{**TOOL, "input_schema": {"type": "banana"}}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "add"}]}, "tools[0].input_schema"),
        ({"tools": [TOOL, TOOL]}, "tools[1].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}
                        ],
                    }
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "add", "input": "2"}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}],
                    }
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
    ],
)
def test_bad_requests_name_the_messages_field(fields, field):
    with pytest.raises(
        ValueError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]") + ":"
    ):
        to_chat(_request(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"temperature": 1.5},
        {"messages": []},
        {"messages": [{"role": "system", "content": "x"}]},
        {"container": "c"},
    ],
)
def test_schema_level_bad_requests(fields):
    with pytest.raises(ValidationError):
        _request(**fields)


USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 3,
    "total_tokens": 13,
    "prompt_tokens_details": {"cached_tokens": 4},
}


def _completion(message: dict, finish: str) -> dict:
    return chat_completion(message, finish, USAGE)


def test_whole_reply_is_an_sdk_message():
    reply = message_from_chat(
        _completion(
            {
                "role": "assistant",
                "content": "On it.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":1}'},
                    }
                ],
            },
            "tool_calls",
        )
    )
    message = at.Message.model_validate(reply)
    assert message.id == "msg_abc" and message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"a": 1}
    assert (
        message.usage.input_tokens,
        message.usage.cache_read_input_tokens,
        message.usage.output_tokens,
    ) == (6, 4, 3)
    plain = at.Message.model_validate(
        message_from_chat(_completion({"role": "assistant", "content": "x"}, "length"))
    )
    assert plain.stop_reason == "max_tokens"
    # A call whose arguments are no JSON object stays visible as text.
    odd = at.Message.model_validate(
        message_from_chat(
            _completion(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "add", "arguments": "[1"},
                        }
                    ],
                },
                "tool_calls",
            )
        )
    )
    assert [b.type for b in odd.content] == ["text"] and odd.stop_reason == "end_turn"


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "choices": choices,
        "usage": usage,
    }


def test_stream_events_are_sdk_events_and_assemble():
    stream = MessagesStream("chatcmpl-abc", "m", input_tokens=10)
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me "}),
        _chunk({"content": "add."}),
        _chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add"}}
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2}'},
                    }
                ]
            }
        ),
        _chunk({}, finish="tool_calls"),
        _chunk(
            usage={
                "prompt_tokens": 10,
                "completion_tokens": 9,
                "total_tokens": 19,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        ),
    ]
    events = stream.opening() + [e for c in chunks for e in stream.feed(c)]
    parsed = [TypeAdapter(at.RawMessageStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    blocks: dict[int, dict] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = {**e["content_block"], "json": ""}
        elif e["type"] == "content_block_delta":
            block, delta = blocks[e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["json"] += delta["partial_json"]
    assert blocks[0]["text"] == "Let me add."
    assert (blocks[1]["id"], json.loads(blocks[1]["json"])) == ("call_1", {"a": 1})
    assert json.loads(blocks[2]["json"]) == {"a": 2}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] == 9


def test_stream_of_plain_text_ends_the_turn():
    stream = MessagesStream("chatcmpl-abc", "m", input_tokens=2)
    events = [
        e
        for c in (
            _chunk({"content": "hi"}, finish="stop"),
            _chunk(
                usage={
                    "prompt_tokens": 2,
                    "completion_tokens": 1,
                    "total_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
            ),
        )
        for e in stream.feed(c)
    ]
    assert [e["type"] for e in events] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_reasoning_becomes_thinking_blocks():
    reply = at.Message.model_validate(
        message_from_chat(
            _completion(
                {"role": "assistant", "content": "4.", "reasoning_content": "2+2 is 4"}, "stop"
            )
        )
    )
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == "2+2 is 4"
    stream = MessagesStream("chatcmpl-abc", "m", input_tokens=2)
    events = [
        e
        for c in (
            _chunk({"reasoning_content": "2+2"}),
            _chunk({"reasoning_content": " is 4"}),
            _chunk({"content": "4."}, finish="stop"),
            _chunk(
                usage={
                    "prompt_tokens": 2,
                    "completion_tokens": 4,
                    "total_tokens": 6,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
            ),
        )
        for e in stream.feed(c)
    ]
    parsed = [TypeAdapter(at.RawMessageStreamEvent).validate_python(e) for e in events]
    assert [(e.type, getattr(e, "index", None)) for e in parsed[:5]] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
    ]
    assert parsed[0].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in parsed[1:3]) == "2+2 is 4"
