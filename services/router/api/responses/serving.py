"""OpenAI's Responses API served on the chat path: the request translated
(translate.py), run as a chat request, its output shaped as a Response or the
Responses stream events; stored responses continue as conversations
(`previous_response_id`)."""

from __future__ import annotations

import time
from collections import OrderedDict
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


class ResponseStore:
    """Stored responses and the chat conversation each one ends, newest
    kept: what `previous_response_id` continues. Bounded; the oldest go first."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._max = max_entries

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

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
    def __init__(self, chat: ChatServing) -> None:
        self._chat = chat
        self._store = ResponseStore()

    async def responses(
        self, request: Request, body: ResponsesRequest
    ) -> JSONResponse | StreamingResponse:
        """OpenAI's Responses API, translated onto the chat path; stored
        responses continue as conversations (`previous_response_id`)."""
        previous: list[dict] = []
        if body.previous_response_id is not None:
            found = self._store.conversation(body.previous_response_id)
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
                self._store.put(response, translate.stored_conversation(messages, response))

        return await self._chat.responder.respond(
            request,
            ereq,
            ResponsesShape(new_shape(), builder, store),
            body.stream,
            include_usage=True,
        )

    def stored_response(self, response_id: str) -> dict:
        response = self._store.response(response_id)
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
