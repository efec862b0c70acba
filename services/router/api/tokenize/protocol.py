"""vLLM's ``/tokenize`` and ``/detokenize`` requests."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from services.router.api.chat.protocol import ChatMessage, template_messages
from services.router.api.protocol import RequestBody, TokenId


class TokenizeRequest(RequestBody):
    """A prompt, or chat messages rendered by the chat template (exactly the
    tokens a chat request sends to the engines)."""

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
            raise ValueError("prompt: give either 'prompt' or 'messages'")
        if self.tools and self.messages is None:
            raise ValueError("tools: go with 'messages'")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (as chat requests do)."""
        return template_messages(self.messages or [])


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]
