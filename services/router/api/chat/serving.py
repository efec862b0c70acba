"""Chat completions: the one path every chat-like API (chat, Messages,
Responses) goes through — tools, structured output, the chat template,
tokenization, the session — and the chat response shape, with tool calls and
reasoning read back from the model's text."""

from __future__ import annotations

from collections.abc import Callable

import jinja2
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.proto import engine_pb2 as pb
from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.chat.reasoning import ReasoningParsers, ReasoningSplit
from services.router.api.chat.structured import from_response_format, from_structured_outputs
from services.router.api.chat.tools import (
    AutoParser,
    ForcedCalls,
    check_history,
    check_tools,
    forced_constraint,
    resolve_choice,
)
from services.router.api.choices import respond_choices
from services.router.api.engine_request import EngineRequests, ModelCard
from services.router.api.protocol import named_bad_request, unrenderable
from services.router.api.streaming import Responder, Shape, event
from services.router.errors import bad_request
from services.router.pd import EngineRequest
from services.router.tokenizer import ChatTokenizer


def _token_bytes(token: str) -> list[int]:
    return list(token.encode())


def chat_logprobs(entries, top: int) -> dict:
    """OpenAI chat `logprobs` for generated tokens."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _token_bytes(e.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)}
                    for t in e.top[:top]
                ],
            }
            for e in entries
        ]
    }


# A text no chunk holds, whose place in a framed chunk splits it into the
# bytes before and after any text (ChatShape.stream_chunk).
_MARKER = pb.GenerateResponse(text="tandem-text-marker-4f1c9e")
_MARKER_JSON = orjson.dumps(_MARKER.text)


class ChatShape(Shape):
    def __init__(
        self,
        card: ModelCard,
        calls: ForcedCalls | None = None,
        top_logprobs: int | None = None,
        reasoning: ReasoningSplit | None = None,
    ) -> None:
        super().__init__(card)
        self._calls = calls  # reads tool calls from the output (None: plain text)
        self._top = top_logprobs  # None: no logprobs
        self._reasoning = reasoning  # splits reasoning from the answer (None: no split)
        self.streams_logprobs = top_logprobs is not None
        self._plain = calls is None and reasoning is None and top_logprobs is None
        self._text_frame: tuple[bytes, bytes] | None = None  # around a text chunk's JSON text

    def stream_chunk(self, request_id, message, include_usage):
        # The common chunk (plain text, not the last) framed around the text
        # alone: what orjson makes of the whole payload, at a fraction of the
        # CPU, once per token.
        if self._plain and message.text and not message.finish_reason:
            if self._text_frame is None:
                prefix, _, suffix = event(self.deltas(request_id, _MARKER)[0]).partition(
                    _MARKER_JSON
                )
                self._text_frame = (prefix, suffix)
            prefix, suffix = self._text_frame
            return prefix + orjson.dumps(message.text) + suffix
        return super().stream_chunk(request_id, message, include_usage)

    def _logprobs(self, entries) -> dict | None:
        return None if self._top is None else chat_logprobs(entries, self._top)

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        reasoning = None
        if self._reasoning is not None:
            reasoning, text = self._reasoning.whole(text)
        message: dict = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self._calls is not None:
            content, calls = self._calls.whole(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls"
        return {
            **self._base(request_id, "chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": self._logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage,
        }

    def opening(self, request_id):
        return {
            **self._base(request_id, "chat.completion.chunk"),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }

    def deltas(self, request_id, message):
        finish_reason = message.finish_reason or None
        text, token_ids = message.text, list(message.token_ids)
        reasoning = None
        if self._reasoning is not None:
            reasoning, text = self._reasoning.delta(text, token_ids)
        if self._calls is None:
            delta = {"content": text} if text else {}
        else:
            delta = (
                self._calls.delta(text, token_ids, final=finish_reason is not None) or {}
                if text or finish_reason
                else {}
            )
            if finish_reason and self._calls.called:
                finish_reason = "tool_calls"
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if not delta and not finish_reason and not (self.streams_logprobs and message.logprobs):
            return []
        return [
            {
                **self._base(request_id, "chat.completion.chunk"),
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": self._logprobs(message.logprobs),
                        "finish_reason": finish_reason,
                    }
                ],
            }
        ]

    def usage_chunk(self, request_id, usage):
        return {**self._base(request_id, "chat.completion.chunk"), "choices": [], "usage": usage}


class ChatServing:
    def __init__(
        self,
        requests: EngineRequests,
        responder: Responder,
        tokenizer: ChatTokenizer,
        tool_parser: AutoParser | None = None,
        reasoning: ReasoningParsers | None = None,
    ) -> None:
        self.requests = requests
        self.responder = responder
        self.tokenizer = tokenizer
        self._tool_parser = tool_parser
        self._reasoning = reasoning

    @property
    def card(self) -> ModelCard:
        return self.requests.card

    @property
    def splits_reasoning(self) -> bool:
        """The router was started with a reasoning parser."""
        return self._reasoning is not None

    async def chat(
        self, request: Request, body: ChatCompletionRequest
    ) -> JSONResponse | StreamingResponse:
        ereq, new_shape = await self.prepare(request, body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shapes: list[Shape] = [new_shape() for _ in range(body.n)]
        return await respond_choices(
            self.responder, request, ereq, shapes, body.stream, include_usage
        )

    async def prepare(
        self, request: Request, body: ChatCompletionRequest
    ) -> tuple[EngineRequest, Callable[[], ChatShape]]:
        """The engine request of a chat request, and how to make the shape of
        a reply to it (one per choice: each reads its own tool calls). The one
        path every chat-like API (chat, Messages, Responses) goes through."""
        self.requests.check_model(body)
        try:
            messages = body.template_messages()
        except ValueError as exc:
            raise named_bad_request(exc) from None
        try:
            check_history(messages)
            tools = check_tools(body.tools or [])
            choice = resolve_choice(body.tool_choice, tools)
            structured = forced_constraint(choice, tools, body.parallel_tool_calls)
            if body.response_format is not None or body.structured_outputs is not None:
                if structured is not None:
                    raise ValueError(
                        "response_format: cannot be combined with tool_choice "
                        f"{choice.mode!r}, which constrains the output itself"
                    )
                if body.response_format is not None and body.structured_outputs is not None:
                    raise ValueError("structured_outputs: give it or response_format, not both")
                structured = (
                    from_response_format(body.response_format)
                    if body.response_format is not None
                    else from_structured_outputs(body.structured_outputs)
                )
        except ValueError as exc:
            raise named_bad_request(exc) from None
        # Tools are rendered under "none" too (as vLLM does by default): an
        # agent's answer turn then keeps the prompt prefix of its tool turns,
        # and hits the prefix cache.
        rendered = tools
        if rendered and not self.tokenizer.renders_tools:
            raise bad_request(
                "this model's chat template does not render tools; start the "
                "router with --chat-template (see docs/api.md, 'Tool calling')",
                param="tools",
            )
        session = self.requests.session(request, body, messages=messages)
        stages: dict[str, float] = {}
        try:
            token_ids = await self.tokenizer.chat_async(
                messages,
                session.key if session else None,
                [t.definition for t in rendered],
                stages,
            )
        except jinja2.TemplateError as exc:
            raise unrenderable(exc) from None
        ereq = self.requests.build("chatcmpl", request, body, token_ids, "messages", session)
        ereq.stages.update(stages)
        if structured is not None:
            ereq.sampling.structured.CopyFrom(structured)
        if body.logprobs:
            ereq.sampling.logprobs = body.top_logprobs or 0
        top_logprobs = body.top_logprobs or 0 if body.logprobs else None

        def new_shape() -> ChatShape:
            calls = None
            if choice.mode in ("required", "named"):
                calls = ForcedCalls(choice)
            elif choice.mode == "auto" and self._tool_parser is not None:
                calls = self._tool_parser.start(self.card.name, tools)
            split = self._reasoning.start() if self._reasoning is not None else None
            return ChatShape(self.card, calls, top_logprobs, split)

        return ereq, new_shape
