"""Completions: a prompt (text, tokenized without the chat template, or token
ids) onto the engines, and the text completion response shape."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.router.api.choices import respond_choices
from services.router.api.completions.protocol import CompletionRequest
from services.router.api.engine_request import EngineRequests, ModelCard
from services.router.api.streaming import Responder, Shape
from services.router.tokenizer import ChatTokenizer


class CompletionShape(Shape):
    def __init__(self, card: ModelCard, logprobs: int | None = None) -> None:
        super().__init__(card)
        self._top = logprobs  # None: no logprobs
        self.streams_logprobs = logprobs is not None
        self._offset = 0  # text offset of the next token, across stream chunks

    def _logprobs(self, entries) -> dict | None:
        if self._top is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top[: self._top]} for e in entries],
            "text_offset": offsets,
        }

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        return {
            **self._base(request_id, "text_completion"),
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": self._logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage,
        }

    def deltas(self, request_id, message):
        return [
            {
                **self._base(request_id, "text_completion"),
                "choices": [
                    {
                        "index": 0,
                        "text": message.text,
                        "logprobs": self._logprobs(message.logprobs),
                        "finish_reason": message.finish_reason or None,
                    }
                ],
            }
        ]

    def usage_chunk(self, request_id, usage):
        return {**self._base(request_id, "text_completion"), "choices": [], "usage": usage}


class CompletionsServing:
    def __init__(
        self, requests: EngineRequests, responder: Responder, tokenizer: ChatTokenizer
    ) -> None:
        self._requests = requests
        self._responder = responder
        self._tokenizer = tokenizer

    async def completions(
        self, request: Request, body: CompletionRequest
    ) -> JSONResponse | StreamingResponse:
        self._requests.check_model(body)
        stages: dict[str, float] = {}
        if isinstance(body.prompt, str):
            token_ids = await self._tokenizer.prompt_async(body.prompt, stages)
        else:
            token_ids = list(body.prompt)
        session = self._requests.session(request, body, prompt=body.prompt)
        ereq = self._requests.build("cmpl", request, body, token_ids, "prompt", session)
        ereq.stages.update(stages)
        if body.logprobs is not None:
            ereq.sampling.logprobs = body.logprobs
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shapes: list[Shape] = [
            CompletionShape(self._requests.card, body.logprobs) for _ in range(body.n)
        ]
        return await respond_choices(
            self._responder, request, ereq, shapes, body.stream, include_usage
        )
