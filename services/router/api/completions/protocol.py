"""The completions request (``POST /v1/completions``): one prompt, text or
token ids."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from services.router.api.protocol import UINT32_MAX, SamplingFields


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[tuple[str, ...]] = (
        *SamplingFields.unsupported,
        "tools",
        "response_format",
    )

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
