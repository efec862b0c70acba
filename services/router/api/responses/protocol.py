"""OpenAI's Responses API request (``POST /v1/responses``): what Tandem
serves of it; options it cannot honour are a 400 naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from services.router.api.protocol import UINT32_MAX, RequestBody


class ResponsesRequest(RequestBody):
    """What Tandem serves of a Responses request; options it cannot honour
    are a 400 naming the field."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        extra = self.model_extra or {}
        for name in ("background", "conversation", "prompt", "top_logprobs"):
            if extra.get(name):
                raise ValueError(f"{name}: not supported by this server")
        return self
