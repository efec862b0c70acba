"""How every API family answers: a response shape per family, and one
`Responder` that runs an engine request through the orchestrator and returns
the whole response or its server-sent events, ending every request in a
response or an explicit error (client gone: 499, too slow: 504)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.proto import engine_pb2 as pb
from services.router.api.engine_request import ModelCard
from services.router.api.protocol import usage
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest, Orchestrator

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_event(payload: dict) -> bytes:
    """An event whose name is its payload's type (Anthropic's and the
    Responses API's framing)."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """Watches a request's client for its disconnect: one task per request,
    from the wait for the first engine message to the stream's end. While
    armed, the client leaving cancels the task that armed it."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._task: asyncio.Task | None = None
        self._watcher = asyncio.ensure_future(self._until_disconnected(receive))
        self._watcher.add_done_callback(self._left)

    @staticmethod
    async def _until_disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def _left(self, watcher: asyncio.Future) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    def arm(self) -> None:
        """From now on the client leaving cancels this task (at once, if it has left)."""
        self._task = asyncio.current_task()
        if self.gone:
            self._task.cancel()

    def disarm(self) -> None:
        self._task = None

    def swallows(self) -> bool:
        """Whether a CancelledError in the armed task was ours (the client
        left) and nobody else's, and may end the request quietly."""
        task = asyncio.current_task()
        return self.gone and task is not None and task.uncancel() == 0

    def close(self) -> None:
        self._watcher.cancel()


class EventStream(StreamingResponse):
    """An event stream: the chunks, then `closing` (OpenAI's ``data: [DONE]``)
    in the write that ends the body.

    Unlike StreamingResponse under uvicorn (ASGI 2.3), no anyio task group
    (its CPU cost per response is in routing/README.md, "Measured"): the
    chunks stream in this task and a `ClientWatch` (the request's own, when
    given) cancels it if the client disconnects, which ends the response
    quietly, as StreamingResponse does."""

    def __init__(
        self, chunks: AsyncIterator[bytes], closing: bytes = DONE, watch: ClientWatch | None = None
    ) -> None:
        super().__init__(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.closing = closing
        self.watch = watch

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": self.closing, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch or ClientWatch(receive)
        watch.arm()
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # Ours (the client left) is swallowed; anyone else's goes on.
            if not watch.swallows():
                raise
        finally:
            watch.disarm()
            watch.close()


class Shape:
    """How one API family shapes whole responses and stream chunks, for one
    request, and frames them as server-sent events."""

    opening: Callable[[str], dict] | None = None
    closing = DONE  # what ends the event stream
    streams_logprobs = False  # the client asked for logprobs (its chunks carry them)

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.created = int(time.time())

    def _base(self, request_id: str, obj: str) -> dict:
        return {"id": request_id, "object": obj, "created": self.created, "model": self.card.name}

    def whole(
        self,
        request_id: str,
        text: str,
        finish_reason: str,
        usage: dict,
        logprobs: list[pb.TokenLogprob],
    ) -> dict:
        raise NotImplementedError

    def deltas(self, request_id: str, message: pb.GenerateResponse) -> list[dict]:
        raise NotImplementedError

    def usage_chunk(self, request_id: str, usage: dict) -> dict:
        raise NotImplementedError

    def opening_payloads(self, request_id: str) -> list[dict]:
        return [self.opening(request_id)] if self.opening is not None else []

    def stream_payloads(
        self, request_id: str, message: pb.GenerateResponse, include_usage: bool
    ) -> list[dict]:
        """The stream events one engine message makes (usage goes with the last).
        A message without text still carries its tokens' logprobs, when asked
        for (the engine holds text back mid-character or for stop strings)."""
        payloads = []
        if (
            message.text
            or message.finish_reason
            or (self.streams_logprobs and len(message.logprobs))
        ):
            payloads.extend(self.deltas(request_id, message))
        if message.finish_reason and include_usage:
            payloads.append(self.usage_chunk(request_id, usage(message.usage)))
        return payloads

    def stream_chunk(
        self, request_id: str, message: pb.GenerateResponse, include_usage: bool
    ) -> bytes:
        """`stream_payloads` framed: the bytes one engine message adds to the stream."""
        return b"".join(
            self.frame(p) for p in self.stream_payloads(request_id, message, include_usage)
        )

    def frame(self, payload: dict) -> bytes:
        return event(payload)

    def error_event(self, error: OpenAIError) -> bytes:
        """An error after streaming began, as this API streams it."""
        return error.sse()


class Responder:
    """Runs engine requests through the orchestrator and answers with their
    whole response or its event stream, within the request timeout."""

    def __init__(
        self, orchestrator: Orchestrator, metrics: RouterMetrics, timeout_s: float
    ) -> None:
        self._orchestrator = orchestrator
        self.metrics = metrics
        self.timeout_s = timeout_s

    def stream(self, ereq: EngineRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The engine messages of `ereq` (Prefill, then Generate's tokens)."""
        return self._orchestrator.stream(ereq)

    def timed_out(self) -> OpenAIError:
        return OpenAIError(504, f"request took longer than {self.timeout_s:.0f}s")

    async def respond(
        self, request: Request, ereq: EngineRequest, shape: Shape, stream: bool, include_usage: bool
    ) -> JSONResponse | StreamingResponse:
        if not stream:
            return JSONResponse(await self.until_done_or_gone(request, self.collect(ereq, shape)))
        # Wait for the first message before answering, so that errors before
        # the first byte (no pod, invalid input) keep their HTTP status. The
        # wait runs in this task; one watch on the client serves it and the
        # stream after it.
        messages = self.stream(ereq)
        watch = ClientWatch(request.receive)
        watch.arm()
        try:
            async with asyncio.timeout(self.timeout_s):
                first = await anext(messages)
        except StopAsyncIteration:
            watch.close()
            raise OpenAIError(502, "the decode pod ended the stream without output") from None
        except BaseException as exc:
            watch.close()
            await messages.aclose()
            if isinstance(exc, asyncio.CancelledError) and watch.swallows():
                self.metrics.client_disconnects.inc()
                raise OpenAIError(499, "client closed the request") from None
            if isinstance(exc, TimeoutError):
                raise self.timed_out() from None
            raise
        finally:
            watch.disarm()
        return EventStream(
            self.sse(ereq, shape, first, messages, include_usage), shape.closing, watch
        )

    async def until_done_or_gone(self, request: Request, work):
        """Await `work`, cancelling it (which aborts it on the engines) if the
        client disconnects or the request outlives its timeout."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait(
                {task, watch}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
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
            self.metrics.client_disconnects.inc()
            raise OpenAIError(499, "client closed the request")
        raise self.timed_out()

    async def collect(self, ereq: EngineRequest, shape: Shape) -> dict:
        return await self.collect_rest(ereq, shape, None, self.stream(ereq))

    async def collect_rest(
        self,
        ereq: EngineRequest,
        shape: Shape,
        first: pb.GenerateResponse | None,
        rest: AsyncIterator[pb.GenerateResponse],
    ) -> dict:
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
        return shape.whole(
            ereq.request_id, "".join(text), final.finish_reason, usage(final.usage), logprobs
        )

    async def sse(
        self,
        ereq: EngineRequest,
        shape: Shape,
        first: pb.GenerateResponse,
        rest: AsyncIterator[pb.GenerateResponse],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The events before ``[DONE]`` (which `EventStream` adds): one chunk
        per engine message, holding every event it makes (the role opening
        goes with the first message, usage with the last), so events that are
        ready together take one write."""
        rid = ereq.request_id

        try:
            async with asyncio.timeout(self.timeout_s):
                opening = b"".join(shape.frame(p) for p in shape.opening_payloads(rid))
                if chunk := opening + shape.stream_chunk(rid, first, include_usage):
                    yield chunk
                async for message in rest:
                    if chunk := shape.stream_chunk(rid, message, include_usage):
                        yield chunk
        except OpenAIError as exc:
            yield shape.error_event(exc)
        except TimeoutError:
            yield shape.error_event(self.timed_out())
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.client_disconnects.inc()
            raise
        finally:
            await rest.aclose()
