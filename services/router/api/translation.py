"""What the APIs translated onto chat completions (Messages, Responses) share:
the chat request they become, the text of their content lists, and the base
of their stream translators. Pure: no I/O."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pydantic import ValidationError

from services.router.api.chat.protocol import ChatCompletionRequest


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built by translating another API's; ValueError
    ("<field>: <problem>") when it is not a valid one."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        raise ValueError(f"{where}: {first['msg']}") from None


def text_of(
    content: Any, where: str, unit: str = "blocks", kinds: tuple[str, ...] = ("text",)
) -> str:
    """The text of a string or of a list of text `unit`s (Anthropic's blocks,
    the Responses API's parts: dicts whose type is one of `kinds`);
    ValueError naming the field `where` otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: a string or a list of text {unit}")  # noqa: TRY004 (a 400)
    parts = []
    for i, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in kinds
            or not isinstance(part.get("text"), str)
        ):
            raise ValueError(f"{where}[{i}]: only text {unit} are supported")
        parts.append(part["text"])
    return "".join(parts)


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
