"""OpenAI chat and completions endpoints over the orchestrator.

The two families differ only in how the prompt is tokenized and how results
are shaped; both run the same `Orchestrator.stream` and share the streaming
and non-streaming assembly here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.proto import engine_pb2 as pb
from services.router.errors import OpenAIError, bad_request
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest, Orchestrator
from services.router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from services.router.routing import session_key
from services.router.routing.sessions import SessionKey
from services.router.structured import from_response_format, from_structured_outputs
from services.router.tokenizer import ChatTokenizer
from services.router.tools import (
    AutoParser,
    ForcedCalls,
    check_history,
    check_tools,
    forced_constraint,
    resolve_choice,
)


@dataclass
class ModelCard:
    name: str
    max_model_len: int
    created: int


def sampling_params(body: SamplingFields, max_tokens: int) -> pb.SamplingParams:
    params = pb.SamplingParams(max_tokens=max_tokens, stop=body.stop or [],
                               stop_token_ids=body.stop_token_ids or [],
                               ignore_eos=body.ignore_eos, skip_special_tokens=True)
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "min_tokens", "seed"):
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    return params


def _usage(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """An OpenAI event stream: the chunks, then ``data: [DONE]`` in the write
    that ends the body.

    Unlike StreamingResponse under uvicorn (ASGI 2.3), no anyio task group
    (its CPU cost per response is in routing/README.md, "Measured"): the
    chunks stream in this task and a watcher task cancels it if the client
    disconnects, which ends the response quietly, as StreamingResponse does."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        streaming = True

        def client_gone(watcher: asyncio.Future) -> None:
            if streaming and not watcher.cancelled():
                task.cancel()

        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        watcher.add_done_callback(client_gone)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # Ours (the client left) is swallowed; anyone else's goes on.
            if not watcher.done() or watcher.cancelled() or task.uncancel():
                raise
        finally:
            streaming = False
            watcher.cancel()


class OpenAIServing:
    def __init__(self, card: ModelCard, tokenizer: ChatTokenizer,
                 orchestrator: Orchestrator, metrics: RouterMetrics,
                 request_timeout_s: float, session_header: str = "x-session-id",
                 session_end_header: str = "x-session-end",
                 tool_parser: AutoParser | None = None) -> None:
        self.card = card
        self._tool_parser = tool_parser
        self._session_header = session_header
        self._session_end_header = session_end_header
        self._tokenizer = tokenizer
        self._orchestrator = orchestrator
        self._metrics = metrics
        self._timeout_s = request_timeout_s

    # -- shared ------------------------------------------------------------
    def _check_model(self, body: SamplingFields) -> None:
        if body.model != self.card.name:
            raise OpenAIError(404, f"The model '{body.model}' does not exist; this server "
                              f"serves '{self.card.name}'", param="model",
                              code="model_not_found")

    def _session(self, request: Request, body: SamplingFields,
                 **conversation) -> SessionKey | None:
        """Session key: the session header, else `user`, else derived from the
        conversation's opening (so clients that send neither still stick)."""
        return session_key(request.headers, {"user": body.user, **conversation},
                           header_name=self._session_header)

    def _session_ends(self, request: Request) -> bool:
        """The client marked this request as its session's last one."""
        value = request.headers.get(self._session_end_header, "")
        return value.strip().lower() in ("1", "true", "yes")

    def _engine_request(self, prefix: str, request: Request, body: SamplingFields,
                        token_ids: list[int], prompt_param: str,
                        session: SessionKey | None) -> EngineRequest:
        limit = self.card.max_model_len
        if len(token_ids) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; "
                              f"the prompt has {len(token_ids)} tokens", param=prompt_param,
                              code="context_length_exceeded")
        max_tokens = body.max_tokens or (limit - len(token_ids))
        if len(token_ids) + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; "
                              f"you requested {len(token_ids) + max_tokens} "
                              f"({len(token_ids)} in the prompt, {max_tokens} to generate)",
                              param="max_tokens", code="context_length_exceeded")
        return EngineRequest(request_id=f"{prefix}-{uuid.uuid4().hex}", token_ids=token_ids,
                             sampling=sampling_params(body, max_tokens),
                             cache_salt=body.cache_salt,
                             arrival=request.state.arrival,
                             session=session.key if session else None,
                             session_source=session.source if session else None,
                             session_end=self._session_ends(request))

    async def _respond(self, request: Request, body: SamplingFields, ereq: EngineRequest,
                       shape: _Shape) -> JSONResponse | StreamingResponse:
        if not body.stream:
            return JSONResponse(await self._until_done_or_gone(request, self._collect(ereq, shape)))
        # Wait for the first message before answering, so that errors before
        # the first byte (no pod, invalid input) keep their HTTP status.
        stream = self._orchestrator.stream(ereq)
        try:
            first = await self._until_done_or_gone(request, anext(stream))
        except StopAsyncIteration:
            raise OpenAIError(502, "the decode pod ended the stream without output") from None
        except BaseException:
            await stream.aclose()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(self._sse(ereq, shape, first, stream, include_usage))

    async def _until_done_or_gone(self, request: Request, work):
        """Await `work`, cancelling it (which aborts it on the engines) if the
        client disconnects or the request outlives its timeout."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, timeout=self._timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                # Let the work unwind (its finally blocks abort engine calls)
                # before anyone touches the generator it was driving.
                await asyncio.gather(task, return_exceptions=True)
        if task in done:
            return task.result()
        if watch in done:
            self._metrics.client_disconnects.inc()
            raise OpenAIError(499, "client closed the request")
        raise OpenAIError(504, f"request took longer than {self._timeout_s:.0f}s")

    async def _collect(self, ereq: EngineRequest, shape: _Shape) -> dict:
        text: list[str] = []
        logprobs: list[pb.TokenLogprob] = []
        final = None
        async for message in self._orchestrator.stream(ereq):
            text.append(message.text)
            logprobs.extend(message.logprobs)
            if message.finish_reason:
                final = message
        if final is None:
            raise OpenAIError(502, "the decode pod ended the stream without a final message")
        return shape.whole(ereq.request_id, "".join(text), final.finish_reason,
                           _usage(final.usage), logprobs)

    async def _sse(self, ereq: EngineRequest, shape: _Shape, first: pb.GenerateResponse,
                   rest: AsyncIterator[pb.GenerateResponse],
                   include_usage: bool) -> AsyncIterator[bytes]:
        """The events before ``[DONE]`` (which `EventStream` adds): one chunk
        per engine message, holding every event it makes (the role opening
        goes with the first message, usage with the last), so events that are
        ready together take one write."""
        rid = ereq.request_id

        def events(message: pb.GenerateResponse, chunk: bytes = b"") -> bytes:
            if message.text or message.finish_reason:
                for payload in shape.deltas(rid, message):
                    chunk += _event(payload)
            if message.finish_reason and include_usage:
                chunk += _event(shape.usage_chunk(rid, _usage(message.usage)))
            return chunk

        try:
            async with asyncio.timeout(self._timeout_s):
                opening = _event(shape.opening(rid)) if shape.opening is not None else b""
                if chunk := events(first, opening):
                    yield chunk
                async for message in rest:
                    if chunk := events(message):
                        yield chunk
        except OpenAIError as exc:
            yield exc.sse()
        except TimeoutError:
            yield OpenAIError(504, f"request took longer than {self._timeout_s:.0f}s").sse()
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.client_disconnects.inc()
            raise
        finally:
            await rest.aclose()

    # -- endpoints ---------------------------------------------------------
    async def chat(self, request: Request, body: ChatCompletionRequest):
        self._check_model(body)
        try:
            messages = body.template_messages()
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        try:
            check_history(messages)
            tools = check_tools(body.tools or [])
            choice = resolve_choice(body.tool_choice, tools)
            structured = forced_constraint(choice, tools, body.parallel_tool_calls)
            if body.response_format is not None or body.structured_outputs is not None:
                if structured is not None:
                    raise ValueError("response_format: cannot be combined with tool_choice "
                                     f"{choice.mode!r}, which constrains the output itself")
                if body.response_format is not None and body.structured_outputs is not None:
                    raise ValueError("structured_outputs: give it or response_format, not both")
                structured = (from_response_format(body.response_format)
                              if body.response_format is not None
                              else from_structured_outputs(body.structured_outputs))
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(":", 1)[0]) from None
        rendered = tools if choice.mode != "none" else []
        if rendered and not self._tokenizer.renders_tools:
            raise bad_request("this model's chat template does not render tools; start the "
                              "router with --chat-template (see README, 'Tool calling')",
                              param="tools")
        session = self._session(request, body, messages=messages)
        token_ids = await self._tokenizer.chat_async(
            messages, session.key if session else None, [t.definition for t in rendered])
        ereq = self._engine_request("chatcmpl", request, body, token_ids, "messages", session)
        if structured is not None:
            ereq.sampling.structured.CopyFrom(structured)
        if body.logprobs:
            ereq.sampling.logprobs = body.top_logprobs or 0
        calls = None
        if choice.mode in ("required", "named"):
            calls = ForcedCalls(choice)
        elif choice.mode == "auto" and self._tool_parser is not None:
            calls = self._tool_parser.start(self.card.name, tools)
        shape = _ChatShape(self.card, calls, body.top_logprobs or 0 if body.logprobs else None)
        return await self._respond(request, body, ereq, shape)

    async def completions(self, request: Request, body: CompletionRequest):
        self._check_model(body)
        if isinstance(body.prompt, str):
            token_ids = await self._tokenizer.prompt_async(body.prompt)
        else:
            token_ids = list(body.prompt)
        session = self._session(request, body, prompt=body.prompt)
        ereq = self._engine_request("cmpl", request, body, token_ids, "prompt", session)
        if body.logprobs is not None:
            ereq.sampling.logprobs = body.logprobs
        return await self._respond(request, body, ereq, _CompletionShape(self.card, body.logprobs))

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.card.name, "object": "model", "created": self.card.created,
            "owned_by": "tandem", "max_model_len": self.card.max_model_len}]}


def _token_bytes(token: str) -> list[int]:
    return list(token.encode())


def chat_logprobs(entries, top: int) -> dict:
    """OpenAI chat `logprobs` for generated tokens."""
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": _token_bytes(e.token),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                           "bytes": _token_bytes(t.token)} for t in e.top[:top]]}
        for e in entries]}


class _Shape:
    """How one API family shapes whole responses and stream chunks, for one
    request."""

    opening: Callable[[str], dict] | None = None

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.created = int(time.time())

    def _base(self, request_id: str, obj: str) -> dict:
        return {"id": request_id, "object": obj, "created": self.created,
                "model": self.card.name}

    def whole(self, request_id: str, text: str, finish_reason: str, usage: dict,
              logprobs: list[pb.TokenLogprob]) -> dict:
        raise NotImplementedError

    def deltas(self, request_id: str, message: pb.GenerateResponse) -> list[dict]:
        raise NotImplementedError

    def usage_chunk(self, request_id: str, usage: dict) -> dict:
        raise NotImplementedError


class _ChatShape(_Shape):
    def __init__(self, card: ModelCard, calls: ForcedCalls | None = None,
                 top_logprobs: int | None = None) -> None:
        super().__init__(card)
        self._calls = calls  # reads tool calls from the output (None: plain text)
        self._top = top_logprobs  # None: no logprobs

    def _logprobs(self, entries) -> dict | None:
        return None if self._top is None else chat_logprobs(entries, self._top)

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        message: dict = {"role": "assistant", "content": text}
        if self._calls is not None:
            content, calls = self._calls.whole(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls"
        return {**self._base(request_id, "chat.completion"),
                "choices": [{"index": 0, "message": message,
                             "logprobs": self._logprobs(logprobs),
                             "finish_reason": finish_reason}],
                "usage": usage}

    def opening(self, request_id):
        return {**self._base(request_id, "chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]}

    def deltas(self, request_id, message):
        finish_reason = message.finish_reason or None
        if self._calls is None:
            delta = {"content": message.text} if message.text else {}
        else:
            delta = self._calls.delta(message.text, list(message.token_ids),
                                      final=finish_reason is not None) or {}
            if finish_reason and self._calls.called:
                finish_reason = "tool_calls"
        if not delta and not finish_reason:
            return []
        return [{**self._base(request_id, "chat.completion.chunk"),
                 "choices": [{"index": 0, "delta": delta,
                              "logprobs": self._logprobs(message.logprobs),
                              "finish_reason": finish_reason}]}]

    def usage_chunk(self, request_id, usage):
        return {**self._base(request_id, "chat.completion.chunk"), "choices": [],
                "usage": usage}


class _CompletionShape(_Shape):
    def __init__(self, card: ModelCard, logprobs: int | None = None) -> None:
        super().__init__(card)
        self._top = logprobs  # None: no logprobs
        self._offset = 0  # text offset of the next token, across stream chunks

    def _logprobs(self, entries) -> dict | None:
        if self._top is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top[:self._top]}
                                 for e in entries],
                "text_offset": offsets}

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        return {**self._base(request_id, "text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": self._logprobs(logprobs),
                             "finish_reason": finish_reason}],
                "usage": usage}

    def deltas(self, request_id, message):
        return [{**self._base(request_id, "text_completion"),
                 "choices": [{"index": 0, "text": message.text,
                              "logprobs": self._logprobs(message.logprobs),
                              "finish_reason": message.finish_reason or None}]}]

    def usage_chunk(self, request_id, usage):
        return {**self._base(request_id, "text_completion"), "choices": [], "usage": usage}
