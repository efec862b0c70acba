"""Anthropic's Messages API served on the chat path: the request translated
(translate.py), run as a chat request, and its output shaped as a Message or
Anthropic's stream events."""

from __future__ import annotations

import asyncio

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.router.api.chat.serving import ChatServing, ChatShape
from services.router.api.chat.tools import check_tools
from services.router.api.messages import translate
from services.router.api.messages.protocol import MessagesRequest
from services.router.api.protocol import named_bad_request
from services.router.api.streaming import Shape, named_event
from services.router.errors import bad_request


class MessagesShape(Shape):
    """The chat shape's output, translated into Anthropic's Messages API."""

    closing = b""

    def __init__(self, chat: ChatShape, stream: translate.MessagesStream) -> None:
        super().__init__(chat.card)
        self._chat = chat
        self._stream = stream

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        return translate.message_from_chat(
            self._chat.whole(request_id, text, finish_reason, usage, logprobs)
        )

    def opening_payloads(self, request_id):
        return self._stream.opening()

    def stream_payloads(self, request_id, message, include_usage):
        return [
            event
            for chunk in self._chat.stream_payloads(request_id, message, True)
            for event in self._stream.feed(chunk)
        ]

    def frame(self, payload):
        return named_event(payload)

    def error_event(self, error):
        return error.anthropic_sse()


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self._chat = chat

    async def messages(
        self, request: Request, body: MessagesRequest
    ) -> JSONResponse | StreamingResponse:
        """Anthropic's Messages API, translated onto the chat path."""
        if body.wants_thinking() and not self._chat.splits_reasoning:
            raise bad_request(
                "thinking: this server splits no reasoning out (start the "
                "router with --reasoning-parser)",
                param="thinking",
            )
        try:
            chat = translate.to_chat(body)
        except ValueError as exc:
            raise named_bad_request(exc) from None
        ereq, new_shape = await self._chat.prepare(request, chat)
        stream = translate.MessagesStream(
            ereq.request_id, self._chat.card.name, len(ereq.token_ids)
        )
        return await self._chat.responder.respond(
            request, ereq, MessagesShape(new_shape(), stream), body.stream, include_usage=True
        )

    async def count_tokens(self, body: MessagesRequest) -> dict:
        """Anthropic's token count: the prompt tokens this Messages request
        would send to the engines (template, tools and all)."""
        self._chat.requests.check_model(body)
        try:
            chat = translate.to_chat(body)
            messages = chat.template_messages()
            tools = [t.definition for t in check_tools(chat.tools or [])]
        except ValueError as exc:
            raise named_bad_request(exc) from None
        tokenizer = self._chat.tokenizer
        try:
            text = await asyncio.to_thread(tokenizer.render, messages, tools)
        except jinja2.TemplateError as exc:
            raise named_bad_request(ValueError(f"messages: {exc}")) from None
        ids = await asyncio.to_thread(tokenizer.ids, text, False)
        return {"input_tokens": len(ids)}
