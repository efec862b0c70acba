"""Anthropic's Messages API as a translation onto chat completions.

A Messages request becomes a `ChatCompletionRequest`, so it takes the one
path every chat request takes (validation, template, tokenization, session,
routing, tool parsing); the chat response, or the chat stream's chunks, come
back as Anthropic's Message or its stream events. Pure: no I/O (serving.py
runs it). Field names in errors are the Messages API's own.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.chat.structured import check_schema
from services.router.api.messages.protocol import MessagesRequest
from services.router.api.translation import ChatStreamTranslator, chat_request, text_of

# Chat finish reasons → Anthropic stop reasons. ("abort" only reaches a
# client when the engine gave up on the request.)
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "abort": "end_turn",
}


def _user_messages(
    content: list[dict[str, Any]], where: str, called: set[str]
) -> list[dict[str, Any]]:
    """A user turn's blocks: tool results become tool messages, runs of text
    one user message, in order."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text":
            text = text_of([block], at)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{at}.tool_use_id: required, a string")
            if call_id not in called:
                raise ValueError(
                    f"{at}.tool_use_id: {call_id!r} answers no tool_use "
                    "block earlier in the conversation"
                )
            result = text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise ValueError(
                f"{at}.type: {kind!r} blocks are not supported in user turns "
                "(text and tool_result are)"
            )
    return out


def _assistant_message(
    content: list[dict[str, Any]], where: str, called: set[str]
) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(text_of([block], at))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{at}.id: required, a string")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{at}.name: required, a string")
            if not isinstance(arguments, dict):
                raise ValueError(f"{at}.input: required, an object")
            called.add(call_id)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' reasoning is not fed back to the model
        else:
            raise ValueError(
                f"{at}.type: {kind!r} blocks are not supported in assistant "
                "turns (text and tool_use are)"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return message


def _chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": text_of(body.system, "system")})
    called: set[str] = set()
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        content = message.content
        if isinstance(content, str):
            messages.append({"role": message.role, "content": content})
        elif message.role == "user":
            messages.extend(_user_messages(content, where, called))
        else:
            messages.append(_assistant_message(content, where, called))
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "custom") != "custom":
            raise ValueError(f"{where}.type: only custom (client) tools are supported")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name: required, a non-empty string")
        if any(t["function"]["name"] == name for t in out):
            raise ValueError(f"{where}.name: {name!r} is defined twice")
        if "input_schema" not in tool:
            raise ValueError(f"{where}.input_schema: required")
        check_schema(tool["input_schema"], f"{where}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise ValueError(f"tool_choice.name: no tool named {name!r} in `tools`")
        return {"type": "function", "function": {"name": name}}
    raise ValueError("tool_choice.type: one of 'auto', 'any', 'tool', 'none'")


def _response_format(output_config: dict[str, Any]) -> dict[str, Any] | None:
    form = output_config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise ValueError("output_config.format.type: only 'json_schema' is supported")
    check_schema(form.get("schema"), "output_config.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": form["schema"], "strict": True},
    }


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means; ValueError naming the
    Messages field when it cannot be served."""
    tools = _chat_tools(body.tools or [])
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _chat_messages(body),
        "max_tokens": body.max_tokens,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
    }
    if tools:
        chat["tools"] = tools
    if body.tool_choice is not None:
        if not tools and body.tool_choice.get("type") != "none":
            raise ValueError("tool_choice: needs `tools`")
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice, tools)
        if body.tool_choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if body.output_config and (form := _response_format(body.output_config)):
        chat["response_format"] = form
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str) and user:
        chat["user"] = user
    return chat_request(chat)


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.rsplit("-", 1)[-1]


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts cache reads apart from the (uncached) input tokens."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use block; arguments that are not a JSON
    object (a model writing its own calls may produce them) stay text."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return {"type": "text", "text": function["arguments"]}
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}


def message_from_chat(completion: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as an Anthropic Message."""
    choice = completion["choices"][0]
    content: list[dict[str, Any]] = []
    if choice["message"].get("reasoning_content"):
        content.append(
            {
                "type": "thinking",
                "thinking": choice["message"]["reasoning_content"],
                "signature": "",
            }
        )
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    content.extend(_tool_use(c) for c in choice["message"].get("tool_calls") or [])
    stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    if stop_reason == "tool_use" and not any(b["type"] == "tool_use" for b in content):
        stop_reason = "end_turn"
    return {
        "id": message_id(completion["id"]),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": _usage(completion["usage"]),
    }


class MessagesStream(ChatStreamTranslator):
    """Chat stream chunks → Anthropic stream events, for one request: the
    message opens, each run of text or tool call is a content block (text
    deltas, or the call's arguments as partial JSON), and the usage chunk
    that ends a chat stream closes the message."""

    def __init__(self, chat_id: str, model: str, input_tokens: int) -> None:
        super().__init__()
        self._id = message_id(chat_id)
        self._model = model
        self._input_tokens = input_tokens
        self._index = -1  # of the open content block
        self._open: str | None = None  # its type
        self._called = False

    def opening(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "message_start",
                "message": {
                    "id": self._id,
                    "type": "message",
                    "role": "assistant",
                    "model": self._model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": self._input_tokens, "output_tokens": 0},
                },
            }
        ]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        return [
            *events,
            {"type": "content_block_start", "index": self._index, "content_block": block},
        ]

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]},
                }
            )
        if delta.get("content"):
            if self._open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "text_delta", "text": delta["content"]},
                }
            )
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                self._called = True
                events += self._start(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": function.get("name", ""),
                        "input": {},
                    }
                )
            if function.get("arguments") and self._open == "tool_use":
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": function["arguments"],
                        },
                    }
                )
        return events

    def _complete(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        stop_reason = STOP_REASONS.get(self._finish or "stop", "end_turn")
        if stop_reason == "tool_use" and not self._called:
            stop_reason = "end_turn"
        return [
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": _usage(usage),
            },
            {"type": "message_stop"},
        ]
