"""OpenAI's Responses API as a translation onto chat completions.

A Responses request — its input items on top of the conversation a
`previous_response_id` names — becomes a `ChatCompletionRequest`, so it takes
the one path every chat request takes (template, tokenization, session,
routing, tool parsing); the chat response, or the chat stream's chunks, come
back as a Response object or the Responses stream events. Pure: no I/O; the
conversations behind response ids are kept by serving.py's `ResponseStore`.
Field names in errors are the Responses API's own.
"""

from __future__ import annotations

from typing import Any

from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.chat.structured import check_schema
from services.router.api.responses.protocol import ResponsesRequest
from services.router.api.translation import ChatStreamTranslator, chat_request, text_of

# What a content list of the Responses API may hold.
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts."""
    return text_of(content, where, unit="parts", kinds=TEXT_PARTS)


def _string(item: dict[str, Any], field: str, where: str, empty: bool) -> str:
    value = item.get(field)
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"{where}.{field}: required, a string")
    return value


def _called(conversation: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in conversation for c in m.get("tool_calls") or []}


def conversation(body: ResponsesRequest, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of the conversation so far: the previous response's,
    then this request's input items (instructions are per request, not part
    of it)."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages = [dict(m) for m in previous]
    called = _called(messages)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: one of 'user', 'assistant', 'system', 'developer'")
            messages.append(
                {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            )
        elif kind == "function_call":
            call_id, name, arguments = (
                _string(item, field, where, empty=field == "arguments")
                for field in ("call_id", "name", "arguments")
            )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"] = [*last["tool_calls"], call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(call_id)
        elif kind == "function_call_output":
            answered = item.get("call_id")
            if not isinstance(answered, str) or answered not in called:
                raise ValueError(
                    f"{where}.call_id: {answered!r} answers no function_call "
                    "earlier in the conversation"
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": answered,
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # earlier turns' reasoning is not fed back to the model
        else:
            raise ValueError(
                f"{where}.type: {kind!r} items are not supported (message, "
                "function_call and function_call_output are)"
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name: required, a non-empty string")
        if any(t["function"]["name"] == name for t in out):
            raise ValueError(f"{where}.name: {name!r} is defined twice")
        parameters = tool.get("parameters") or {"type": "object"}
        check_schema(parameters, f"{where}.parameters")
        function: dict[str, Any] = {"name": name, "parameters": parameters}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise ValueError(f"tool_choice.name: no tool named {name!r} in `tools`")
        return {"type": "function", "function": {"name": name}}
    raise ValueError("tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise ValueError("text.format: an object")  # noqa: TRY004 (a 400)
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        check_schema(form.get("schema"), "text.format.schema")
        return {
            "type": "json_schema",
            "json_schema": {
                "name": form.get("name", "response"),
                "schema": form["schema"],
                "strict": bool(form.get("strict")),
            },
        }
    raise ValueError("text.format.type: one of 'text', 'json_object', 'json_schema'")


def to_chat(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request for `messages` (from `conversation`) under the
    request's options; ValueError naming the Responses field."""
    tools = _chat_tools(body.tools or [])
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    if not messages:
        raise ValueError("input: empty")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
    }
    if tools:
        chat["tools"] = tools
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice, tools)
    if body.text is not None and (form := _response_format(body.text)) is not None:
        chat["response_format"] = form
    return chat_request(chat)


def response_id(chat_id: str) -> str:
    return "resp_" + chat_id.rsplit("-", 1)[-1]


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "in_progress"
        else [],
    }


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else [],
    }


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat message that continues the
    conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in output
        if i["type"] == "function_call"
    ]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


class ResponseBuilder:
    """The Response object of one request: its echo of the request's options,
    then the output and usage once known."""

    def __init__(self, chat_id: str, body: ResponsesRequest, created_at: int) -> None:
        self.id = response_id(chat_id)
        self._suffix = chat_id.rsplit("-", 1)[-1]
        self._base = {
            "id": self.id,
            "object": "response",
            "created_at": created_at,
            "model": body.model,
            "instructions": body.instructions,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "user": body.user,
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
        }

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self._suffix}{index}"

    def build(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return {
            **self._base,
            "status": status,
            "output": output,
            "usage": _usage(usage) if usage else None,
            "incomplete_details": incomplete,
        }

    def from_chat(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as the Response."""
        choice = completion["choices"][0]
        output: list[dict[str, Any]] = []
        if choice["message"].get("reasoning_content"):
            output.append(
                _reasoning_item(
                    self.item_id("rs", 0), choice["message"]["reasoning_content"], "completed"
                )
            )
        if choice["message"].get("content"):
            output.append(
                _message_item(
                    self.item_id("msg", len(output)), choice["message"]["content"], "completed"
                )
            )
        for call in choice["message"].get("tool_calls") or []:
            output.append(_call_item(self.item_id("fc", len(output)), call, "completed"))
        status, incomplete = _status(choice["finish_reason"])
        return self.build(status, output, completion["usage"], incomplete)


class ResponsesStream(ChatStreamTranslator):
    """Chat stream chunks → Responses stream events, for one request. Each run
    of text is a message item with one output_text part, each tool call a
    function_call item; the usage chunk that ends a chat stream completes the
    response (`final` then holds it)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        super().__init__()
        self._builder = builder
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self.final: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        response = self._builder.build("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self._output)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], item["text"], "completed")
            events = [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=item["text"]
                )
            ]
        elif item["type"] == "message":
            done = _message_item(item["id"], item["text"], "completed")
            part = done["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=item["text"],
                    logprobs=[],
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            done = _call_item(item["id"], item["call"], "completed")
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=done["name"],
                    arguments=done["arguments"],
                )
            ]
        self._output.append(done)
        return [*events, self._event("response.output_item.done", output_index=index, item=done)]

    def _start_reasoning(self) -> list[dict[str, Any]]:
        events = self._close()
        index = len(self._output)
        item_id = self._builder.item_id("rs", index)
        self._open = {"type": "reasoning", "id": item_id, "text": ""}
        return [
            *events,
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_reasoning_item(item_id, "", "in_progress"),
            ),
        ]

    def _start_message(self) -> list[dict[str, Any]]:
        events = self._close()
        index = len(self._output)
        item_id = self._builder.item_id("msg", index)
        self._open = {"type": "message", "id": item_id, "text": ""}
        return [
            *events,
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_message_item(item_id, "", "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def _start_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        index = len(self._output)
        item_id = self._builder.item_id("fc", index)
        function = call.get("function") or {}
        self._open = {
            "type": "function_call",
            "id": item_id,
            "call": {
                "id": call["id"],
                "function": {"name": function.get("name", ""), "arguments": ""},
            },
        }
        return [
            *events,
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_call_item(item_id, self._open["call"], "in_progress"),
            ),
        ]

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                events += self._start_reasoning()
            assert self._open is not None
            self._open["text"] += delta["reasoning_content"]
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self._output),
                    content_index=0,
                    delta=delta["reasoning_content"],
                )
            )
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._start_message()
            assert self._open is not None
            self._open["text"] += delta["content"]
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self._output),
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                events += self._start_call(call)
            piece = (call.get("function") or {}).get("arguments")
            if piece and self._open is not None and self._open["type"] == "function_call":
                self._open["call"]["function"]["arguments"] += piece
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self._output),
                        delta=piece,
                    )
                )
        return events

    def _complete(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        status, incomplete = _status(self._finish)
        self.final = self._builder.build(status, self._output, usage, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.final)]

    def error(self, error: dict[str, Any]) -> dict[str, Any]:
        """An error after streaming began, as the Responses stream reports it."""
        return self._event(
            "error",
            code=error.get("code") or error.get("type"),
            message=error["message"],
            param=error.get("param"),
        )


def stored_conversation(
    messages: list[dict[str, Any]], response: dict[str, Any]
) -> list[dict[str, Any]]:
    """The conversation a follow-up continues: this turn's messages and its
    reply."""
    return [*messages, assistant_message(response["output"])]
