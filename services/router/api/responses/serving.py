"""OpenAI's Responses API served on the chat path: the request translated
(translate.py), run as a chat request, its output shaped as a Response or the
Responses stream events; stored responses continue as conversations
(`previous_response_id`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.router.api.chat.serving import ChatServing, ChatShape
from services.router.api.protocol import named_bad_request
from services.router.api.responses import translate
from services.router.api.responses.protocol import ResponsesRequest
from services.router.api.streaming import Shape, named_event
from services.router.errors import OpenAIError
from services.router.routing.lru import BoundedLru


class ResponseStore:
    """Stored responses and the chat conversation each one ends, newest
    kept: what `previous_response_id` continues.

    Bounded: at most ``max_entries`` responses whose conversations hold at
    most ``max_chars`` characters of message content in all (a message shared
    by several stored conversations counts in each: an upper bound); beyond
    either, the oldest stored go first (``evictions`` counts them), and a
    request continuing one gets the API's 404 ``previous_response_not_found``."""

    # What a message costs beside its text (its dict and keys), in characters' worth.
    MESSAGE_OVERHEAD_CHARS = 64

    def __init__(self, max_entries: int = 10_000, max_chars: int = 200_000_000) -> None:
        # id -> (response, conversation, its weight in characters)
        self._entries: BoundedLru[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = (
            BoundedLru(max_entries, max_chars, weigh=lambda entry: entry[2])
        )

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        """Characters the stored conversations hold, as ``max_chars`` counts them."""
        return self._entries.weight

    @property
    def evictions(self) -> int:
        return self._entries.evictions

    @classmethod
    def weight(cls, conversation: list[dict[str, Any]]) -> int:
        total = 0
        for message in conversation:
            content = message.get("content")
            total += cls.MESSAGE_OVERHEAD_CHARS + (
                len(content) if isinstance(content, str) else len(str(content or ""))
            )
            if message.get("tool_calls"):
                total += len(str(message["tool_calls"]))
        return total

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._entries.put(response["id"], (response, conversation, self.weight(conversation)))

    def response(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        return entry[0] if entry else None

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._entries.get(response_id)
        return entry[1] if entry else None


class ResponsesShape(Shape):
    """The chat shape's output, translated into OpenAI's Responses API; the
    finished response goes to `store`."""

    closing = b""

    def __init__(
        self, chat: ChatShape, builder: translate.ResponseBuilder, store: Callable[[dict], None]
    ) -> None:
        super().__init__(chat.card)
        self._chat = chat
        self._builder = builder
        self._stream = translate.ResponsesStream(builder)
        self._store = store

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        response = self._builder.from_chat(
            self._chat.whole(request_id, text, finish_reason, usage, logprobs)
        )
        self._store(response)
        return response

    def opening_payloads(self, request_id):
        return self._stream.opening()

    def stream_payloads(self, request_id, message, include_usage):
        events = [
            event
            for chunk in self._chat.stream_payloads(request_id, message, True)
            for event in self._stream.feed(chunk)
        ]
        if message.finish_reason and self._stream.final is not None:
            self._store(self._stream.final)
        return events

    def frame(self, payload):
        return named_event(payload)

    def error_event(self, error):
        return named_event(self._stream.error(error.body()["error"]))


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self._chat = chat
        self.store = ResponseStore() if store is None else store

    async def responses(
        self, request: Request, body: ResponsesRequest
    ) -> JSONResponse | StreamingResponse:
        """OpenAI's Responses API, translated onto the chat path; stored
        responses continue as conversations (`previous_response_id`)."""
        previous: list[dict] = []
        if body.previous_response_id is not None:
            found = self.store.conversation(body.previous_response_id)
            if found is None:
                raise OpenAIError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            previous = found
        try:
            messages = translate.conversation(body, previous)
            chat = translate.to_chat(body, messages)
        except ValueError as exc:
            raise named_bad_request(exc) from None
        try:
            ereq, new_shape = await self._chat.prepare(request, chat)
        except OpenAIError as exc:
            raise _in_responses_terms(exc) from None
        builder = translate.ResponseBuilder(ereq.request_id, body, int(time.time()))

        def store(response: dict) -> None:
            if body.store:
                self.store.put(response, translate.stored_conversation(messages, response))

        return await self._chat.responder.respond(
            request,
            ereq,
            ResponsesShape(new_shape(), builder, store),
            body.stream,
            include_usage=True,
        )

    def stored_response(self, response_id: str) -> dict:
        response = self.store.response(response_id)
        if response is None:
            raise OpenAIError(
                404,
                f"Response with id '{response_id}' not found",
                param="response_id",
                code="response_not_found",
            )
        return response


def _in_responses_terms(exc: OpenAIError) -> OpenAIError:
    """A refusal of the chat path, naming the Responses field: chat's
    `max_tokens` is `max_output_tokens`, its `messages` come from `input`
    (and `instructions`, so a chat message index says nothing here)."""
    if exc.param == "max_tokens":
        exc.param = "max_output_tokens"
    elif exc.param is not None and exc.param.startswith("messages"):
        exc.param = "input"
    return exc
