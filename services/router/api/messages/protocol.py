"""Anthropic's Messages API requests (``POST /v1/messages`` and its
``/count_tokens``): what Tandem serves of them; anything else it cannot honour
is a 400 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.router.api.protocol import INT32_MAX, UINT32_MAX, RequestBody


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestBody):
    """What Tandem serves of a Messages request; anything else it cannot honour
    is a 400 naming the field."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, le=INT32_MAX)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # Structured output: {"format": {"type": "json_schema", "schema": ...}};
    # `effort` is a hint for models that reason, and has no effect here.
    output_config: dict[str, Any] | None = None

    # Thinking is the model's own: with a reasoning parser its reasoning comes
    # back in thinking blocks (`budget_tokens` is not enforced); without one,
    # enabling it is a 400 (messages/serving.py).
    thinking: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> MessagesRequest:
        for name in ("container", "mcp_servers"):
            if (self.model_extra or {}).get(name):
                raise ValueError(f"{name}: not supported by this server")
        return self

    def wants_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.get("type") in ("enabled", "adaptive")


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(default=1, ge=1, le=UINT32_MAX)
