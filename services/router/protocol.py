"""OpenAI request schemas the router accepts, validated before any work.

Only what Tandem serves is accepted; a field with an invalid value or an
unsupported option gets a 400 naming the field, never a silent ignore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# What the wire's integer fields carry (engine.proto): larger values are a
# 400 naming the field, not an overflow in the router.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # n > 1: one engine request per choice, the first prefilled before the
    # others start so that they reuse its KV from the prefix cache.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, str):
            return [value]
        if value is not None and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    # Options this server does not serve: a 400, never a silent ignore.
    unsupported: ClassVar[tuple[str, ...]] = ("echo", "best_of", "logit_bias", "suffix")

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        for name in self.unsupported:
            value = extra.get(name)
            harmless = value is None or value is False or value == [] or value == {} \
                or (name == "best_of" and value == 1)
            if not harmless:
                raise ValueError(f"'{name}' is not supported by this server")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
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
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (text content only)."""
        try:
            return [_template_message(m) for m in self.messages]
        except ValueError as exc:
            raise ValueError(f"messages: {exc}") from None


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built by translating another API's; ValueError
    ("<field>: <problem>") when it is not a valid one."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        raise ValueError(f"{where}: {first['msg']}") from None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
        if message.content is None:
            out["content"] = None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[tuple[str, ...]] = (*SamplingFields.unsupported, "tools",
                                              "response_format")

    prompt: str | list[int] | list[str] | list[list[int]]
    # Top log-probabilities per token (OpenAI allows up to 5).
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt is empty")
            if isinstance(value[0], (str, list)):
                if len(value) != 1:
                    raise ValueError("batched prompts are not supported; send one per request")
                value = value[0]
        if isinstance(value, str) and not value:
            raise ValueError("prompt is empty")
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        if isinstance(value, list) and not all(0 <= t <= UINT32_MAX for t in value):
            raise ValueError("prompt token ids must be integers from 0 to 2**32-1")
        return value


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages rendered by the chat
    template (exactly the tokens a chat request sends to the engines)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # Default: true for a prompt, false for messages (the template adds them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        if self.tools and self.messages is None:
            raise ValueError("'tools' go with 'messages'")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (as chat requests do)."""
        try:
            return [_template_message(m) for m in self.messages or []]
        except ValueError as exc:
            raise ValueError(f"messages: {exc}") from None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


class ChatStreamTranslator(ABC):
    """Chat stream chunks → another API's stream events, for one request: each
    chunk's deltas as they come, and the closing events once the usage chunk
    that ends every chat stream arrives (with the last finish reason seen)."""

    def __init__(self) -> None:
        self._finish: str | None = None

    @abstractmethod
    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one choice's delta."""

    @abstractmethod
    def _complete(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that end the stream."""

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat chunk."""
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            events += self._delta(choice["delta"])
            self._finish = choice.get("finish_reason") or self._finish
        if chunk.get("usage") is None:
            return events
        return [*events, *self._complete(chunk["usage"])]
