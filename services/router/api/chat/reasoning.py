"""Reasoning split out of a thinking model's output by vLLM's maintained
reasoning parser for the model family (``--reasoning-parser``, as vLLM names
them): chat's `reasoning_content`, Anthropic's thinking blocks, the Responses
API's reasoning items.

Imported only when a parser is configured: importing vllm.reasoning pulls in
vLLM's server modules.
"""

from __future__ import annotations

from typing import Any


class ReasoningParsers:
    """vLLM's reasoning parser for the model family, one instance per
    response (the parsers keep streaming state)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.reasoning import ReasoningParserManager

        self.name = name
        self._cls = ReasoningParserManager.get_reasoning_parser(name)
        self._tokenizer = tokenizer
        self._request = ChatCompletionRequest(model="", messages=[])
        # A parser whose markers the tokenizer lacks fails here, at start-up.
        self._cls(tokenizer)

    def start(self) -> ReasoningSplit:
        return ReasoningSplit(self._cls(self._tokenizer), self._request)


class ReasoningSplit:
    """One response's reasoning and content, whole or streamed."""

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser = parser
        self._request = request
        self._text = ""
        self._ids: list[int] = []

    def whole(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output."""
        reasoning, content = self._parser.extract_reasoning(text, self._request)
        return reasoning or None, content or ""

    def delta(self, text: str, token_ids: list[int]) -> tuple[str | None, str]:
        """(reasoning, content) pieces of the next piece of output."""
        previous_text, previous_ids = self._text, self._ids
        self._text = previous_text + text
        self._ids = previous_ids + token_ids
        message = self._parser.extract_reasoning_streaming(
            previous_text, self._text, text, previous_ids, self._ids, token_ids
        )
        if message is None:
            return None, ""
        return message.reasoning or None, message.content or ""
