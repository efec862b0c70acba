"""Tool calling for chat requests: checking the tools and history, forcing
calls with structured output, and reading calls back from the model's text.

`tool_choice: "required"` and a named function are enforced by a JSON Schema
built from the tools' parameter schemas, so any model produces arguments that
parse and match them:

* named function f: the output is f's arguments object itself;
* required: the output is ``[{"name": ..., "arguments": {...}}, ...]`` (one
  item at most without `parallel_tool_calls`), each item one of the tools.

`auto` leaves the model free; a vLLM tool parser (``--tool-call-parser``)
reads its calls from the text. Everything here is pure except `AutoParser`,
which wraps the vLLM parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.proto import engine_pb2 as pb
from services.router.api.chat.structured import check_schema

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    # As the client sent it: what the chat template renders.
    definition: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None


def check_tools(tools: list[Any]) -> list[Tool]:
    """The request's `tools`; ValueError naming the field when malformed."""
    result: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: required, an object")  # noqa: TRY004 (a 400)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: required, a non-empty string")
        if any(t.name == name for t in result):
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        parameters = function.get("parameters", ANY_OBJECT)
        check_schema(parameters, f"{where}.function.parameters")
        result.append(Tool(name=name, parameters=parameters, definition=tool))
    return result


def resolve_choice(tool_choice: Any, tools: list[Tool]) -> ToolChoice:
    """`tool_choice` (default: auto with tools, none without)."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice: {tool_choice!r} needs `tools`")
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice.function.name: required, a string")
        if not any(t.name == name for t in tools):
            raise ValueError(f"tool_choice: no tool named {name!r} in `tools`")
        return ToolChoice("named", name)
    raise ValueError(
        "tool_choice: must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


def check_history(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call made earlier in the conversation."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or []):
            if message["role"] != "assistant":
                raise ValueError(
                    f"messages[{i}].tool_calls: only assistant messages carry tool calls"
                )
            call_id = call.get("id") if isinstance(call, dict) else None
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"messages[{i}].tool_calls[{j}].id: required, a string")
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(  # noqa: TRY004 (a 400)
                    f"messages[{i}].tool_calls[{j}].function.name: required"
                )
            called.add(call_id)
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_call_id: required in a tool message")
            if call_id not in called:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {call_id!r} answers no "
                    "tool call made earlier in the conversation"
                )


def forced_constraint(
    choice: ToolChoice, tools: list[Tool], parallel: bool
) -> pb.StructuredOutput | None:
    """The structured-output constraint that enforces `choice` (None: free)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        schema: dict[str, Any] = tool.parameters
    elif choice.mode == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    else:
        return None
    return pb.StructuredOutput(json_schema=json.dumps(schema, separators=(",", ":")), compact=True)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_forced(text: str, choice: ToolChoice) -> list[dict[str, Any]]:
    """The calls in a forced output (ValueError if it is not complete JSON,
    e.g. cut off by max_tokens)."""
    value = json.loads(text)
    if choice.mode == "named":
        assert choice.name is not None
        return [call(choice.name, json.dumps(value, ensure_ascii=False))]
    return [call(item["name"], json.dumps(item["arguments"], ensure_ascii=False)) for item in value]


class AutoParser:
    """vLLM's maintained tool parser for the model family, per request (the
    parsers keep streaming state). Imported only when a parser is configured:
    importing vllm.tool_parsers pulls in torch and vLLM's server modules."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self._cls = ToolParserManager.get_tool_parser(name)
        self._request_cls = ChatCompletionRequest
        self._tokenizer = tokenizer

    def start(self, model: str, tools: list[Tool]) -> AutoParse:
        request = self._request_cls(model=model, messages=[], tools=[t.definition for t in tools])
        return AutoParse(self._cls(self._tokenizer), request)


class ForcedCalls:
    """Reads back the calls of a forced output (required or a named
    function). Streamed, the JSON is held back and the calls go out whole
    when the output ends: partial arguments are no use to a client."""

    def __init__(self, choice: ToolChoice) -> None:
        self._choice = choice
        self._text: list[str] = []
        self.called = False

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            calls = parse_forced(text, self._choice)
        except (ValueError, KeyError, TypeError):
            # Cut short (max_tokens): not a call; the client sees the text.
            return text, []
        self.called = bool(calls)
        return None, calls

    def delta(self, text: str, token_ids: list[int], final: bool) -> dict[str, Any] | None:
        self._text.append(text)
        if not final:
            return None
        content, calls = self.whole("".join(self._text))
        if calls:
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return {"content": content} if content else None


class AutoParse:
    """One request's parse by a vLLM tool parser, whole or streamed."""

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser = parser
        self._request = request
        self._text = ""
        self._ids: list[int] = []
        self.called = False

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        info = self._parser.extract_tool_calls(text, self._request)
        if not info.tools_called:
            return text, []
        self.called = True
        return info.content or None, [
            call(c.function.name, c.function.arguments) for c in info.tool_calls
        ]

    def delta(self, text: str, token_ids: list[int], final: bool) -> dict[str, Any] | None:
        """The OpenAI chat delta for the next piece of output (None: nothing
        to send yet)."""
        previous_text, previous_ids = self._text, self._ids
        self._text = previous_text + text
        self._ids = previous_ids + list(token_ids)
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._ids, list(token_ids), self._request
        )
        if message is None:
            return None
        delta = message.model_dump(exclude_none=True)
        if delta.get("tool_calls"):
            self.called = True
            for tool_call in delta["tool_calls"]:
                if "id" in tool_call:
                    tool_call.setdefault("type", "function")
        return delta or None
