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
from dataclasses import dataclass, replace

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.proto import engine_pb2 as pb
from services.router import anthropic_messages, openai_responses
from services.router.anthropic_messages import MessagesRequest
from services.router.errors import OpenAIError, bad_request
from services.router.metrics import RouterMetrics
from services.router.openai_responses import ResponseBuilder, ResponsesRequest, ResponseStore
from services.router.pd import EngineRequest, Orchestrator
from services.router.protocol import (
    INT64_MAX,
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from services.router.reasoning import ReasoningParsers, ReasoningSplit
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


DONE = b"data: [DONE]\n\n"


def _named_event(payload: dict) -> bytes:
    """An event whose name is its payload's type (Anthropic's and the
    Responses API's framing)."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _named_bad_request(exc: ValueError) -> OpenAIError:
    """A 400 for a ValueError whose message starts with the field it names."""
    message = str(exc)
    return bad_request(message, param=message.split(":", 1)[0])


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """An event stream: the chunks, then `closing` (OpenAI's ``data: [DONE]``)
    in the write that ends the body.

    Unlike StreamingResponse under uvicorn (ASGI 2.3), no anyio task group
    (its CPU cost per response is in routing/README.md, "Measured"): the
    chunks stream in this task and a watcher task cancels it if the client
    disconnects, which ends the response quietly, as StreamingResponse does."""

    def __init__(self, chunks: AsyncIterator[bytes], closing: bytes = DONE) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.closing = closing

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": self.closing, "more_body": False})

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
                 tool_parser: AutoParser | None = None,
                 reasoning: ReasoningParsers | None = None) -> None:
        self.card = card
        self._tool_parser = tool_parser
        self._reasoning = reasoning
        self._session_header = session_header
        self._session_end_header = session_end_header
        self._tokenizer = tokenizer
        self._orchestrator = orchestrator
        self._metrics = metrics
        self._timeout_s = request_timeout_s
        self._responses = ResponseStore()

    # -- shared ------------------------------------------------------------
    def _check_model(self, body: SamplingFields | TokenizeRequest | DetokenizeRequest) -> None:
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

    async def _respond(self, request: Request, ereq: EngineRequest, shape: _Shape,
                       stream: bool, include_usage: bool) -> JSONResponse | StreamingResponse:
        if not stream:
            return JSONResponse(await self._until_done_or_gone(request, self._collect(ereq, shape)))
        # Wait for the first message before answering, so that errors before
        # the first byte (no pod, invalid input) keep their HTTP status.
        messages = self._orchestrator.stream(ereq)
        try:
            first = await self._until_done_or_gone(request, anext(messages))
        except StopAsyncIteration:
            raise OpenAIError(502, "the decode pod ended the stream without output") from None
        except BaseException:
            await messages.aclose()
            raise
        return EventStream(self._sse(ereq, shape, first, messages, include_usage), shape.closing)

    async def _respond_choices(self, request: Request, ereq: EngineRequest,
                               shapes: list[_Shape], stream: bool,
                               include_usage: bool) -> JSONResponse | StreamingResponse:
        """`n` choices: one engine request each (seeds apart, when given). The
        first runs until its first token — its prompt is then in the prefix
        cache — before the others start, so they reuse its KV."""
        if len(shapes) == 1:
            return await self._respond(request, ereq, shapes[0], stream, include_usage)
        ereqs = [ereq, *(_another_choice(ereq, i) for i in range(1, len(shapes)))]
        streams = [self._orchestrator.stream(e) for e in ereqs]
        try:
            first = await self._until_done_or_gone(request, anext(streams[0]))
            others = await self._until_done_or_gone(request, _all_or_none(
                [anext(s) for s in streams[1:]]))
        except StopAsyncIteration:
            await asyncio.gather(*(s.aclose() for s in streams))
            raise OpenAIError(502, "the decode pod ended the stream without output") from None
        except BaseException:
            await asyncio.gather(*(s.aclose() for s in streams))
            raise
        firsts = [first, *others]
        if not stream:
            wholes = await self._until_done_or_gone(request, _all_or_none([
                self._collect_rest(e, shape, m, s)
                for e, shape, m, s in zip(ereqs, shapes, firsts, streams, strict=True)]))
            return JSONResponse(_merged_choices(wholes))
        return EventStream(self._sse_choices(ereqs, shapes, firsts, streams, include_usage),
                           shapes[0].closing)

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
        return await self._collect_rest(ereq, shape, None, self._orchestrator.stream(ereq))

    async def _collect_rest(self, ereq: EngineRequest, shape: _Shape,
                            first: pb.GenerateResponse | None,
                            rest: AsyncIterator[pb.GenerateResponse]) -> dict:
        """The whole response from a stream's messages (`first` already read)."""
        text: list[str] = []
        logprobs: list[pb.TokenLogprob] = []
        final = None

        async def messages() -> AsyncIterator[pb.GenerateResponse]:
            if first is not None:
                yield first
            async for message in rest:
                yield message

        async for message in messages():
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
            for payload in shape.stream_payloads(rid, message, include_usage):
                chunk += shape.frame(payload)
            return chunk

        try:
            async with asyncio.timeout(self._timeout_s):
                opening = b"".join(shape.frame(p) for p in shape.opening_payloads(rid))
                if chunk := events(first, opening):
                    yield chunk
                async for message in rest:
                    if chunk := events(message):
                        yield chunk
        except OpenAIError as exc:
            yield shape.error_event(exc)
        except TimeoutError:
            yield shape.error_event(
                OpenAIError(504, f"request took longer than {self._timeout_s:.0f}s"))
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.client_disconnects.inc()
            raise
        finally:
            await rest.aclose()

    async def _sse_choices(self, ereqs: list[EngineRequest], shapes: list[_Shape],
                           firsts: list[pb.GenerateResponse],
                           streams: list[AsyncIterator[pb.GenerateResponse]],
                           include_usage: bool) -> AsyncIterator[bytes]:
        """The events of `n` choices, interleaved as their tokens come, each
        chunk's choice numbered; one usage chunk (all choices) at the end."""
        queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = \
            asyncio.Queue()

        async def pump(index: int, rest: AsyncIterator[pb.GenerateResponse]) -> None:
            try:
                async for message in rest:
                    await queue.put((index, message))
            except Exception as exc:  # noqa: BLE001 (handed to the stream, which reports it)
                await queue.put((index, exc))
            await queue.put((index, None))

        def events(index: int, message: pb.GenerateResponse) -> bytes:
            payloads = shapes[index].stream_payloads(ereqs[0].request_id, message, False)
            return b"".join(shapes[0].frame(_numbered(p, index)) for p in payloads)

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        finals: list[pb.GenerateResponse] = []
        try:
            async with asyncio.timeout(self._timeout_s):
                chunk = b"".join(shapes[0].frame(_numbered(p, i)) for i, shape in enumerate(shapes)
                                 for p in shape.opening_payloads(ereqs[0].request_id))
                for i, message in enumerate(firsts):
                    chunk += events(i, message)
                    finals += [message] if message.finish_reason else []
                if chunk:
                    yield chunk
                running = len(streams)
                while running:
                    index, item = await queue.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        finals += [item] if item.finish_reason else []
                        if chunk := events(index, item):
                            yield chunk
                if include_usage and finals:
                    usage = _summed_usage([m.usage for m in finals])
                    yield shapes[0].frame(shapes[0].usage_chunk(ereqs[0].request_id, usage))
        except OpenAIError as exc:
            yield shapes[0].error_event(exc)
        except TimeoutError:
            yield shapes[0].error_event(
                OpenAIError(504, f"request took longer than {self._timeout_s:.0f}s"))
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.client_disconnects.inc()
            raise
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

    # -- endpoints ---------------------------------------------------------
    async def chat(self, request: Request, body: ChatCompletionRequest):
        ereq, new_shape = await self._chat_request(request, body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shapes: list[_Shape] = [new_shape() for _ in range(body.n)]
        return await self._respond_choices(request, ereq, shapes, body.stream, include_usage)

    async def _chat_request(self, request: Request, body: ChatCompletionRequest
                            ) -> tuple[EngineRequest, Callable[[], _ChatShape]]:
        """The engine request of a chat request, and how to make the shape of
        a reply to it (one per choice: each reads its own tool calls). The one
        path every chat-like API (chat, Messages, Responses) goes through."""
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
            raise _named_bad_request(exc) from None
        # Tools are rendered under "none" too (as vLLM does by default): an
        # agent's answer turn then keeps the prompt prefix of its tool turns,
        # and hits the prefix cache.
        rendered = tools
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
        top_logprobs = body.top_logprobs or 0 if body.logprobs else None

        def new_shape() -> _ChatShape:
            calls = None
            if choice.mode in ("required", "named"):
                calls = ForcedCalls(choice)
            elif choice.mode == "auto" and self._tool_parser is not None:
                calls = self._tool_parser.start(self.card.name, tools)
            split = self._reasoning.start() if self._reasoning is not None else None
            return _ChatShape(self.card, calls, top_logprobs, split)

        return ereq, new_shape

    async def messages(self, request: Request, body: MessagesRequest):
        """Anthropic's Messages API, translated onto the chat path."""
        if body.wants_thinking() and self._reasoning is None:
            raise bad_request("thinking: this server splits no reasoning out (start the "
                              "router with --reasoning-parser)", param="thinking")
        try:
            chat = anthropic_messages.to_chat(body)
        except ValueError as exc:
            raise _named_bad_request(exc) from None
        ereq, new_shape = await self._chat_request(request, chat)
        stream = anthropic_messages.MessagesStream(ereq.request_id, self.card.name,
                                                   len(ereq.token_ids))
        return await self._respond(request, ereq, _MessagesShape(new_shape(), stream),
                                   body.stream, include_usage=True)

    async def responses(self, request: Request, body: ResponsesRequest):
        """OpenAI's Responses API, translated onto the chat path; stored
        responses continue as conversations (`previous_response_id`)."""
        previous: list[dict] = []
        if body.previous_response_id is not None:
            found = self._responses.conversation(body.previous_response_id)
            if found is None:
                raise OpenAIError(404, f"Previous response with id "
                                  f"'{body.previous_response_id}' not found",
                                  param="previous_response_id",
                                  code="previous_response_not_found")
            previous = found
        try:
            messages = openai_responses.conversation(body, previous)
            chat = openai_responses.to_chat(body, messages)
        except ValueError as exc:
            raise _named_bad_request(exc) from None
        ereq, new_shape = await self._chat_request(request, chat)
        builder = ResponseBuilder(ereq.request_id, body, int(time.time()))

        def store(response: dict) -> None:
            if body.store:
                self._responses.put(response,
                                    openai_responses.stored_conversation(messages, response))

        return await self._respond(request, ereq, _ResponsesShape(new_shape(), builder, store),
                                   body.stream, include_usage=True)

    def stored_response(self, response_id: str) -> dict:
        response = self._responses.response(response_id)
        if response is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found",
                              param="response_id", code="response_not_found")
        return response

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
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shapes: list[_Shape] = [_CompletionShape(self.card, body.logprobs)
                                for _ in range(body.n)]
        return await self._respond_choices(request, ereq, shapes, body.stream, include_usage)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's `/tokenize`: the ids the router would send for this prompt
        or conversation (chat: the same template and tools as a chat request)."""
        if body.model is not None:
            self._check_model(body)
        if body.messages is not None:
            try:
                messages = body.template_messages()
                tools = [t.definition for t in check_tools(body.tools or [])]
            except ValueError as exc:
                raise _named_bad_request(exc) from None
            if tools and not self._tokenizer.renders_tools:
                raise bad_request("this model's chat template does not render tools",
                                  param="tools")
            text = await asyncio.to_thread(self._tokenizer.render, messages, tools,
                                           body.add_generation_prompt)
            add_special = bool(body.add_special_tokens)
        else:
            assert body.prompt is not None
            text = body.prompt
            add_special = body.add_special_tokens is not False
        ids = await asyncio.to_thread(self._tokenizer.ids, text, add_special)
        result = {"count": len(ids), "max_model_len": self.card.max_model_len, "tokens": ids,
                  "token_strs": None}
        if body.return_token_strs:
            result["token_strs"] = self._tokenizer.hf_tokenizer.convert_ids_to_tokens(ids)
        return result

    async def count_message_tokens(self, body: MessagesRequest) -> dict:
        """Anthropic's token count: the prompt tokens this Messages request
        would send to the engines (template, tools and all)."""
        self._check_model(body)
        try:
            chat = anthropic_messages.to_chat(body)
            messages = chat.template_messages()
            tools = [t.definition for t in check_tools(chat.tools or [])]
        except ValueError as exc:
            raise _named_bad_request(exc) from None
        text = await asyncio.to_thread(self._tokenizer.render, messages, tools)
        ids = await asyncio.to_thread(self._tokenizer.ids, text, False)
        return {"input_tokens": len(ids)}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's `/detokenize`: the text of token ids."""
        if body.model is not None:
            self._check_model(body)
        tokenizer = self._tokenizer.hf_tokenizer
        unknown = [t for t in body.tokens if t >= len(tokenizer)]
        if unknown:
            raise bad_request(f"tokens: {unknown[0]} is not a token id of this model "
                              f"(it has {len(tokenizer)})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.card.name, "object": "model", "created": self.card.created,
            "owned_by": "tandem", "max_model_len": self.card.max_model_len}]}


async def _all_or_none(work: list) -> list:
    """The results of all `work`, or the first failure — the rest then
    cancelled (which aborts their engine requests), not left running."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _another_choice(ereq: EngineRequest, index: int) -> EngineRequest:
    """Choice `index` of a request: its own id, and its own seed when one is set
    (else the choices would be the same)."""
    sampling = pb.SamplingParams()
    sampling.CopyFrom(ereq.sampling)
    if sampling.HasField("seed"):
        # Stays within int64: counts down from the top.
        step = index if sampling.seed <= INT64_MAX - MAX_CHOICES else -index
        sampling.seed += step
    return replace(ereq, request_id=f"{ereq.request_id}-{index}", sampling=sampling)


def _numbered(payload: dict, index: int) -> dict:
    for choice in payload.get("choices", ()):
        choice["index"] = index
    return payload


def _summed_usage(usages: list[pb.Usage]) -> dict:
    """The usage of `n` choices: one prompt, every choice's completion; the
    cached prompt tokens of the first (the others reuse its KV)."""
    total = pb.Usage(prompt_tokens=usages[0].prompt_tokens, cached_tokens=usages[0].cached_tokens,
                     completion_tokens=sum(u.completion_tokens for u in usages))
    return _usage(total)


def _merged_choices(wholes: list[dict]) -> dict:
    """`n` whole responses as one with `n` choices."""
    merged = wholes[0]
    merged["choices"] = [_numbered(w, i)["choices"][0] for i, w in enumerate(wholes)]
    merged["usage"]["completion_tokens"] = sum(w["usage"]["completion_tokens"] for w in wholes)
    merged["usage"]["total_tokens"] = (merged["usage"]["prompt_tokens"]
                                       + merged["usage"]["completion_tokens"])
    return merged


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
    request, and frames them as server-sent events."""

    opening: Callable[[str], dict] | None = None
    closing = DONE  # what ends the event stream

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

    def opening_payloads(self, request_id: str) -> list[dict]:
        return [self.opening(request_id)] if self.opening is not None else []

    def stream_payloads(self, request_id: str, message: pb.GenerateResponse,
                        include_usage: bool) -> list[dict]:
        """The stream events one engine message makes (usage goes with the last)."""
        payloads = []
        if message.text or message.finish_reason:
            payloads.extend(self.deltas(request_id, message))
        if message.finish_reason and include_usage:
            payloads.append(self.usage_chunk(request_id, _usage(message.usage)))
        return payloads

    def frame(self, payload: dict) -> bytes:
        return _event(payload)

    def error_event(self, error: OpenAIError) -> bytes:
        """An error after streaming began, as this API streams it."""
        return error.sse()


class _ChatShape(_Shape):
    def __init__(self, card: ModelCard, calls: ForcedCalls | None = None,
                 top_logprobs: int | None = None, reasoning: ReasoningSplit | None = None) -> None:
        super().__init__(card)
        self._calls = calls  # reads tool calls from the output (None: plain text)
        self._top = top_logprobs  # None: no logprobs
        self._reasoning = reasoning  # splits reasoning from the answer (None: no split)

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
        text, token_ids = message.text, list(message.token_ids)
        reasoning = None
        if self._reasoning is not None:
            reasoning, text = self._reasoning.delta(text, token_ids)
        if self._calls is None:
            delta = {"content": text} if text else {}
        else:
            delta = (self._calls.delta(text, token_ids, final=finish_reason is not None) or {}
                     if text or finish_reason else {})
            if finish_reason and self._calls.called:
                finish_reason = "tool_calls"
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
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


class _MessagesShape(_Shape):
    """The chat shape's output, translated into Anthropic's Messages API."""

    closing = b""

    def __init__(self, chat: _ChatShape, stream: anthropic_messages.MessagesStream) -> None:
        super().__init__(chat.card)
        self._chat = chat
        self._stream = stream

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        return anthropic_messages.message_from_chat(
            self._chat.whole(request_id, text, finish_reason, usage, logprobs))

    def opening_payloads(self, request_id):
        return self._stream.opening()

    def stream_payloads(self, request_id, message, include_usage):
        return [event for chunk in self._chat.stream_payloads(request_id, message, True)
                for event in self._stream.feed(chunk)]

    def frame(self, payload):
        return _named_event(payload)

    def error_event(self, error):
        return error.anthropic_sse()


class _ResponsesShape(_Shape):
    """The chat shape's output, translated into OpenAI's Responses API; the
    finished response goes to `store`."""

    closing = b""

    def __init__(self, chat: _ChatShape, builder: ResponseBuilder,
                 store: Callable[[dict], None]) -> None:
        super().__init__(chat.card)
        self._chat = chat
        self._builder = builder
        self._stream = openai_responses.ResponsesStream(builder)
        self._store = store

    def whole(self, request_id, text, finish_reason, usage, logprobs):
        response = self._builder.from_chat(
            self._chat.whole(request_id, text, finish_reason, usage, logprobs))
        self._store(response)
        return response

    def opening_payloads(self, request_id):
        return self._stream.opening()

    def stream_payloads(self, request_id, message, include_usage):
        events = [event for chunk in self._chat.stream_payloads(request_id, message, True)
                  for event in self._stream.feed(chunk)]
        if message.finish_reason and self._stream.final is not None:
            self._store(self._stream.final)
        return events

    def frame(self, payload):
        return _named_event(payload)

    def error_event(self, error):
        return _named_event(self._stream.error(error.body()["error"]))
