"""OpenAI request schemas the router accepts, validated before any work.

Only what Tandem serves is accepted; a field with an invalid value or an
unsupported option gets a 400 naming the field, never a silent ignore.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is served")
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

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        for name in ("logprobs", "top_logprobs", "echo", "best_of", "logit_bias",
                     "tools", "response_format", "suffix"):
            value = extra.get(name)
            harmless = value is None or value is False or value == [] or value == {} \
                or (name == "best_of" and value == 1) or (name == "top_logprobs" and value == 0)
            if not harmless:
                raise ValueError(f"'{name}' is not supported by this server")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _max_tokens_alias(self):
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them (text content only)."""
        try:
            return [{"role": m.role, "content": m.text()} for m in self.messages]
        except ValueError as exc:
            raise ValueError(f"messages: {exc}") from None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]

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
        return value
