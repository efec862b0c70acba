"""The Responses API translation (`api/responses/translate.py`), pure: input items and
stored conversations onto chat, chat responses and stream chunks back,
checked against the official `openai` SDK's own types. No engines."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from services.router.api.responses.protocol import ResponsesRequest
from services.router.api.responses.serving import ResponsesServing, ResponseStore
from services.router.api.responses.translate import (
    ResponseBuilder,
    ResponsesStream,
    conversation,
    stored_conversation,
    to_chat,
)
from services.router.errors import OpenAIError
from tests.helpers import chat_completion

TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
}
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 4,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 6},
}


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def _chat(body: ResponsesRequest, previous=()):
    return to_chat(body, conversation(body, list(previous)))


def test_string_input_instructions_and_options():
    chat = _chat(
        _request(
            instructions="Be brief.",
            max_output_tokens=7,
            temperature=0.2,
            user="u",
            stream=True,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "p",
                    "strict": True,
                    "schema": {"type": "object"},
                }
            },
        )
    )
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert (chat.max_tokens, chat.temperature, chat.user, chat.stream) == (7, 0.2, "u", True)
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
    }


def test_items_and_previous_conversation_become_chat_history():
    previous = [
        {"role": "user", "content": "add 1"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
    ]
    body = _request(
        tools=[TOOL],
        tool_choice={"type": "function", "name": "add"},
        parallel_tool_calls=False,
        input=[
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            {"type": "reasoning", "id": "r", "summary": []},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "and "},
                    {"type": "input_text", "text": "2?"},
                ],
            },
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call", "call_id": "call_3", "name": "add", "arguments": '{"a": 3}'},
            {
                "type": "function_call_output",
                "call_id": "call_3",
                "output": [{"type": "input_text", "text": "3"}],
            },
        ],
    )
    chat = _chat(body, previous)
    messages = chat.template_messages()
    assert messages[:2] == previous
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "1"}
    assert messages[3] == {"role": "user", "content": "and 2?"}
    assert [c["id"] for c in messages[4]["tool_calls"]] == ["call_2", "call_3"]
    assert messages[5] == {"role": "tool", "tool_call_id": "call_3", "content": "3"}
    assert chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert chat.parallel_tool_calls is False
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add", "parameters": TOOL["parameters"]},
        }
    ]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"tools": [{**TOOL, "parameters": {"type": "banana"}}]}, "tools[0].parameters"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [TOOL, TOOL]}, "tools[1].name"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": []}, "input"),
    ],
)
def test_bad_requests_name_the_responses_field(fields, field):
    with pytest.raises(
        ValueError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]") + ":"
    ):
        _chat(_request(**fields))


@pytest.mark.parametrize(
    "fields", [{"max_output_tokens": 0}, {"background": True}, {"temperature": 3}, {"input": 5}]
)
def test_schema_level_bad_requests(fields):
    with pytest.raises(ValidationError):
        _request(**fields)


def _completion(message: dict, finish: str) -> dict:
    return chat_completion(message, finish, USAGE)


def test_whole_reply_is_an_sdk_response_and_continues_the_conversation():
    body = _request(tools=[TOOL])
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    raw = ResponseBuilder("chatcmpl-abc", body, 5).from_chat(
        _completion({"role": "assistant", "content": "Sure.", "tool_calls": [call]}, "tool_calls")
    )
    response = Response.model_validate(raw)
    assert response.id == "resp_abc" and response.status == "completed"
    assert response.output_text == "Sure."
    assert [i.type for i in response.output] == ["message", "function_call"]
    assert response.output[1].call_id == "call_1"
    assert (
        response.usage.input_tokens,
        response.usage.input_tokens_details.cached_tokens,
        response.usage.output_tokens,
    ) == (10, 6, 4)
    history = stored_conversation([{"role": "user", "content": "hi"}], raw)
    assert history[-1] == {"role": "assistant", "content": "Sure.", "tool_calls": [call]}
    cut = Response.model_validate(
        ResponseBuilder("chatcmpl-abc", body, 5).from_chat(
            _completion({"role": "assistant", "content": "x"}, "length")
        )
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "choices": choices,
        "usage": usage,
    }


def test_stream_events_are_sdk_events_and_assemble():
    stream = ResponsesStream(ResponseBuilder("chatcmpl-abc", _request(tools=[TOOL]), 5))
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
        _chunk({}, finish="tool_calls"),
        _chunk(usage=USAGE),
    ]
    events = stream.opening() + [e for c in chunks for e in stream.feed(c)]
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = parsed[-1].response
    assert final.output_text == "Let me add." and final.status == "completed"
    assert json.loads(final.output[1].arguments) == {"a": 1}
    assert stream.final is not None and stream.final["id"] == final.id
    error = TypeAdapter(ResponseStreamEvent).validate_python(
        stream.error({"message": "boom", "type": "server_error", "param": None, "code": None})
    )
    assert error.type == "error" and error.sequence_number == len(events)


def test_store_keeps_the_newest():
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert store.response("resp_0") is None and store.conversation("resp_0") is None
    assert store.conversation("resp_2") == [{"role": "user", "content": "2"}]
    assert store.response("resp_1") == {"id": "resp_1"}


def test_reasoning_becomes_a_reasoning_item():
    raw = ResponseBuilder("chatcmpl-abc", _request(), 5).from_chat(
        _completion({"role": "assistant", "content": "4.", "reasoning_content": "2+2 is 4"}, "stop")
    )
    response = Response.model_validate(raw)
    assert [i.type for i in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "2+2 is 4" and response.output_text == "4."
    assert stored_conversation([], raw) == [{"role": "assistant", "content": "4."}]
    stream = ResponsesStream(ResponseBuilder("chatcmpl-abc", _request(), 5))
    events = [
        e
        for c in (
            _chunk({"reasoning_content": "2+2"}),
            _chunk({"reasoning_content": " is 4"}),
            _chunk({"content": "4."}, finish="stop"),
            _chunk(usage=USAGE),
        )
        for e in stream.feed(c)
    ]
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed[:5]] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
    ]
    final = parsed[-1].response
    assert final.output[0].type == "reasoning" and final.output_text == "4."


def test_store_bounds_the_characters_it_holds():
    store = ResponseStore(max_entries=10, max_chars=3 * ResponseStore.MESSAGE_OVERHEAD_CHARS + 40)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": "x" * 10}])
    assert store.entries == 3 and store.evictions == 0
    store.put({"id": "resp_3"}, [{"role": "user", "content": "y" * 20}])  # over: resp_0 goes
    assert store.response("resp_0") is None and store.entries == 3 and store.evictions == 1
    assert store.chars == 2 * (ResponseStore.MESSAGE_OVERHEAD_CHARS + 10) + (
        ResponseStore.MESSAGE_OVERHEAD_CHARS + 20
    )


async def test_continuing_an_evicted_response_is_a_404_in_the_api_format():
    store = ResponseStore(max_entries=1)
    serving = ResponsesServing(chat=None, store=store)
    store.put({"id": "resp_old"}, [{"role": "user", "content": "a"}])
    store.put({"id": "resp_new"}, [{"role": "user", "content": "b"}])
    with pytest.raises(OpenAIError) as caught:
        await serving.responses(None, _request(previous_response_id="resp_old"))
    error = caught.value
    assert error.status == 404
    body = error.body()["error"]
    assert body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found" and "resp_old" in body["message"]
