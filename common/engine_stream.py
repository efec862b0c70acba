"""Many Generate calls over one ``GenerateStream`` RPC, both ends.

A Generate call costs the router a gRPC message per token: at one token per
engine step and hundreds of requests in flight, receiving them is about a
third of the router's CPU (docs/benchmarks.md, "Router overhead"). On a
``GenerateStream`` the router starts and cancels requests one way, and the
engine sends, the other way, one message per batch of events: every event
ready when its sender gets to it, which is all the tokens of an engine step
(vLLM hands a step's outputs to every request at once).

* ``GenerateStreamServer`` (the engine's end): a task per started request
  running the engine's own Generate; their events wait in one outbox.
* ``GenerateStreamClient`` (the router's end): one per engine connection; its
  ``generate`` returns a call that reads like ``EngineStub.Generate``'s (an
  async iterator of ``GenerateResponse`` raising ``grpc.aio.AioRpcError``,
  with ``cancel()``), so the request path is the same over either.

Per request, the semantics are Generate's: an error ends that request alone,
as an event with its status code; a cancel aborts it (freeing its KV). The
stream ending (the engine gone, or its server stopped) ends every request
still on it with UNAVAILABLE, as the engine's death ends every Generate call,
and the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from common.proto import engine_pb2 as pb

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Messages a request's reader may fall behind by before new ones merge into
# the last (as vLLM merges a slow reader's outputs): a stalled client holds
# its tokens, not a message per token.
_MERGE_BEYOND = 16


class RequestFailed(Exception):
    """A request ends with this gRPC status: the call's status for Prefill and
    Generate, the request's error event on a GenerateStream."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _error_event(request_id: str, code: grpc.StatusCode, details: str) -> pb.GenerateEvent:
    return pb.GenerateEvent(request_id=request_id, error_code=code.value[0], error_message=details)


class GenerateStreamServer:
    """One GenerateStream call at the engine: `generate` (the engine's
    Generate, raising `RequestFailed`) for each request started on it."""

    def __init__(
        self, generate: Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]
    ) -> None:
        self._generate = generate
        self._running: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[pb.GenerateEvent] = []
        self._ready = asyncio.Event()

    async def run(self, request_iterator: Any) -> AsyncIterator[pb.GenerateStreamResponse]:
        """The responses to send, until the caller has half-closed and every
        request it started has ended; on the way out (the call cancelled)
        every request still running is cancelled."""
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator))
        reader.add_done_callback(lambda _: self._ready.set())
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._outbox:
                    events, self._outbox = self._outbox, []
                    yield pb.GenerateStreamResponse(events=events)
                if reader.done() and not self._running and not self._outbox:
                    return
        finally:
            reader.cancel()
            for task in self._running.values():
                task.cancel()

    def _emit(self, event: pb.GenerateEvent) -> None:
        self._outbox.append(event)
        self._ready.set()

    async def _read(self, request_iterator: Any) -> None:
        loop = asyncio.get_running_loop()
        async for message in request_iterator:
            for request in message.starts:
                if request.request_id in self._running:
                    self._emit(
                        _error_event(
                            request.request_id,
                            grpc.StatusCode.ALREADY_EXISTS,
                            f"request {request.request_id} is already running",
                        )
                    )
                    continue
                self._running[request.request_id] = loop.create_task(self._serve(request))
            for request_id in message.cancels:
                task = self._running.pop(request_id, None)
                if task is not None:
                    task.cancel()

    async def _serve(self, request: pb.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            async for message in self._generate(request):
                self._emit(pb.GenerateEvent(request_id=request_id, response=message))
        except RequestFailed as exc:
            self._emit(_error_event(request_id, exc.code, exc.details))
        except Exception as exc:  # a bug: fail this request, as gRPC fails a call (UNKNOWN)
            log.exception("request %s failed", request_id)
            self._emit(
                _error_event(request_id, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
            )
        finally:
            if self._running.get(request_id) is asyncio.current_task():
                del self._running[request_id]
            self._ready.set()


class GenerateRpcs:
    """Generate and GenerateStream for an Engine servicer, over its
    ``_generate(request)`` (an async iterator of GenerateResponse raising
    `RequestFailed`)."""

    _generate: Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]

    async def Generate(self, request: pb.GenerateRequest, context: Any):
        try:
            async for message in self._generate(request):
                yield message
        except RequestFailed as exc:
            await context.abort(exc.code, exc.details)

    async def GenerateStream(self, request_iterator: Any, context: Any):
        """Generate for every request started on this stream, their tokens
        sent together as they are ready."""
        async for response in GenerateStreamServer(self._generate).run(request_iterator):
            yield response


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class StreamedCall:
    """One request on a GenerateStream, read like a Generate call."""

    def __init__(self, stream: _ClientStream, request_id: str) -> None:
        self._stream = stream
        self._request_id = request_id
        self._messages: collections.deque[pb.GenerateResponse] = collections.deque()
        self._error: grpc.aio.AioRpcError | None = None
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None

    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        while not self._messages:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._messages.popleft()

    def cancel(self) -> None:
        """Abort the request at the engine (a no-op once it has ended)."""
        if not self._ended:
            self._ended = True
            self._stream.cancel(self._request_id)

    def _deliver(self, event: pb.GenerateEvent) -> bool:
        """Take one event; True when it was the request's last."""
        if event.error_code:
            code = _CODES.get(event.error_code, grpc.StatusCode.UNKNOWN)
            return self._fail(_rpc_error(code, event.error_message))
        message = event.response
        if len(self._messages) < _MERGE_BEYOND:
            self._messages.append(message)
        else:
            last = self._messages[-1]
            last.token_ids.extend(message.token_ids)
            last.text += message.text
            last.logprobs.extend(message.logprobs)
            last.finish_reason = message.finish_reason
            if message.HasField("usage"):
                last.usage.CopyFrom(message.usage)
        if message.finish_reason:
            self._ended = True
        self._wake()
        return self._ended

    def _fail(self, error: grpc.aio.AioRpcError) -> bool:
        self._error, self._ended = error, True
        self._wake()
        return True

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _ClientStream:
    """One open GenerateStream RPC and the requests on it."""

    def __init__(self, stub: Any) -> None:
        self._calls: dict[str, StreamedCall] = {}
        self._starts: list[pb.GenerateRequest] = []
        self._cancels: list[str] = []
        self._wake = asyncio.Event()
        self._closing = False
        self.ended = False
        self._rpc = stub.GenerateStream(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def start(self, request: pb.GenerateRequest) -> StreamedCall:
        call = StreamedCall(self, request.request_id)
        if request.request_id in self._calls:
            call._fail(
                _rpc_error(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request {request.request_id} is already running",
                )
            )
            return call
        self._calls[request.request_id] = call
        self._starts.append(request)
        self._wake.set()
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.ended:
            self._cancels.append(request_id)
            self._wake.set()

    def close_when_idle(self) -> None:
        """Start nothing more; half-close once the requests on it end."""
        self._closing = True
        self._wake.set()

    async def _requests(self) -> AsyncIterator[pb.GenerateStreamRequest]:
        while True:
            await self._wake.wait()
            # One more turn of the event loop lets every request started in
            # this one join the message: 20 starts a message instead of 6 at
            # ~950 req/s, and ~12% less router CPU a request (docs/benchmarks.md).
            await asyncio.sleep(0)
            self._wake.clear()
            if self._starts or self._cancels:
                message = pb.GenerateStreamRequest(starts=self._starts, cancels=self._cancels)
                self._starts, self._cancels = [], []
                yield message
            if self.ended or (self._closing and not self._calls):
                return

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine ended the stream")
        try:
            async for response in self._rpc:
                for event in response.events:
                    call = self._calls.get(event.request_id)
                    if call is not None and call._deliver(event):
                        del self._calls[event.request_id]
                        if self._closing and not self._calls:
                            self._wake.set()
        except grpc.aio.AioRpcError as exc:
            # The engine gone or its server stopping: what callers retry.
            code = exc.code()
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
                code = grpc.StatusCode.UNAVAILABLE
            error = _rpc_error(code, f"engine stream ended: {exc.details()}")
        finally:
            self.ended = True
            self._wake.set()
            calls, self._calls = self._calls, {}
            for call in calls.values():
                call._fail(error)

    async def aclose(self) -> None:
        """End the RPC now (the requests still on it fail with UNAVAILABLE)."""
        self._rpc.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class GenerateStreamClient:
    """Generate calls to one engine over a shared GenerateStream, opened on
    first use and again after it ends."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._stream: _ClientStream | None = None

    @property
    def in_flight(self) -> int:
        return 0 if self._stream is None else self._stream.in_flight

    def generate(self, request: pb.GenerateRequest) -> StreamedCall:
        if self._stream is None or self._stream.ended or self._stream._closing:
            self._stream = _ClientStream(self._stub)
        return self._stream.start(request)

    def close_when_idle(self) -> None:
        """Open no new stream here; the open one half-closes once its
        requests end (a channel being replaced or closed with a grace)."""
        if self._stream is not None:
            self._stream.close_when_idle()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
