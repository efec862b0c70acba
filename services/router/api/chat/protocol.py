"""The chat completions request (``POST /v1/chat/completions``): what every
chat-like API (Messages, Responses) becomes before it reaches the engines."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.router.api.protocol import UINT32_MAX, SamplingFields


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as text; ValueError naming the part (``content[j]``)
        that is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content[{j}]: only text content parts are supported "
                    f"(this is a text model), got type {part.get('type')!r}"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # vLLM's option: one of json, json_object, regex, choice, grammar.
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _max_tokens_alias(self):
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (text content only)."""
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """`messages` as the chat template expects them; ValueError naming
    the part (``messages[i].content[j]``) that holds more than text."""
    out = []
    for i, message in enumerate(messages):
        try:
            out.append(_template_message(message))
        except ValueError as exc:
            raise ValueError(f"messages[{i}].{exc}") from None
    return out


def _template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
        if message.content is None:
            out["content"] = None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
