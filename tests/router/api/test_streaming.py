"""The streaming response: `streaming.EventStream` over `Responder.sse` (one
choice) and `choices.sse_choices` (n), with a stand-in for the orchestrator's
stream. Fast; no engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import generate_latest

from common.proto import engine_pb2 as pb
from services.router.api.chat.serving import ChatShape
from services.router.api.choices import sse_choices
from services.router.api.engine_request import ModelCard
from services.router.api.streaming import EventStream, Responder
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest
from tests.helpers import metric_value

CARD = ModelCard(name="m", max_model_len=1024, created=0)


def _responder(metrics: RouterMetrics) -> Responder:
    return Responder(orchestrator=None, metrics=metrics, timeout_s=30)


def _ereq() -> EngineRequest:
    return EngineRequest(
        request_id="chatcmpl-1",
        token_ids=[1, 2],
        sampling=pb.SamplingParams(),
        cache_salt=None,
        arrival=0.0,
    )


def _messages(n: int) -> list[pb.GenerateResponse]:
    out = [pb.GenerateResponse(text=f" t{i}") for i in range(n)]
    out[-1].finish_reason = "length"
    out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens = 2, n
    return out


class _Rest:
    """The orchestrator's stream after its first message."""

    def __init__(self, messages, error: BaseException | None = None, hang: bool = False):
        self.messages, self.error, self.hang = messages, error, hang
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.messages:
            return self.messages.pop(0)
        if self.hang:
            await asyncio.Event().wait()
        if self.error:
            raise self.error
        raise StopAsyncIteration

    async def aclose(self):
        self.closed = True


async def _run(response: EventStream, disconnect_after: int | None = None):
    """Serve `response`; the client leaves after `disconnect_after` body messages."""
    sent: list[dict] = []
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if disconnect_after is not None and len(sent) > disconnect_after:
            gone.set()

    await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
    return sent


def _events(sent: list[dict]) -> list[bytes]:
    return [e for m in sent[1:] for e in m["body"].split(b"\n\n") if e]


@pytest.mark.parametrize("text", [" tok", 'say "hi"\n', "naïve ☃ 𝄞", "\\ \u0000 </s>", "tandem"])
def test_a_plain_text_chunk_is_the_payload_orjson_would_make(text):
    # The per-token fast path must be byte for byte the general one.
    shape = ChatShape(ModelCard(name='m"x', max_model_len=1024, created=0))
    message = pb.GenerateResponse(token_ids=[1], text=text)
    general = b"".join(
        shape.frame(p) for p in shape.stream_payloads("chatcmpl-1", message, include_usage=True)
    )
    assert shape.stream_chunk("chatcmpl-1", message, include_usage=True) == general
    assert shape._text_frame is not None  # it took the fast path
    assert json.loads(general[len(b"data: ") :])["choices"][0]["delta"] == {"content": text}


async def test_stream_events_and_writes():
    responder = _responder(RouterMetrics())
    first, *rest = _messages(3)
    sent = await _run(
        EventStream(responder.sse(_ereq(), ChatShape(CARD), first, _Rest(rest), include_usage=True))
    )
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    # One write per engine message: the opening rides with the first token,
    # usage with the last; [DONE] ends the body.
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
    assert sent[-1]["body"] == b"data: [DONE]\n\n"
    events = _events(sent)
    assert all(e.startswith(b"data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:4]] == [" t0", " t1", " t2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:4]] == [None, None, "length"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 3
    assert all(c["id"] == "chatcmpl-1" and c["model"] == "m" for c in chunks)


def _held_back(logprob: float) -> pb.GenerateResponse:
    """A message whose token's text the engine holds back (half a character,
    or a possible stop string): no text, but the token and its logprob."""
    message = pb.GenerateResponse(token_ids=[7])
    message.logprobs.add(token="\ufffd", logprob=logprob)
    return message


@pytest.mark.parametrize("shape", ["chat", "completions"])
async def test_messages_without_text_keep_their_logprobs(shape):
    from services.router.api.completions.serving import CompletionShape

    def new_shape(top):
        return ChatShape(CARD, top_logprobs=top) if shape == "chat" else CompletionShape(CARD, top)

    first, last = _messages(2)
    last.logprobs.add(token=" t1", logprob=-0.5)
    messages = [first, _held_back(-1.5), last]
    responder = _responder(RouterMetrics())

    async def tokens_logprobs(top):
        sent = await _run(
            EventStream(
                responder.sse(_ereq(), new_shape(top), messages[0], _Rest(messages[1:]), False)
            )
        )
        chunks = [json.loads(e[6:]) for e in _events(sent)[:-1]]
        lp = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        if shape == "chat":
            return len(chunks), [e["logprob"] for x in lp for e in x["content"]]
        return len(chunks), [v for x in lp for v in x["token_logprobs"]]

    # Asked for: the held-back token's logprob comes in a chunk of its own.
    n, logprobs = await tokens_logprobs(0)
    assert logprobs == [-1.5, -0.5]
    assert n == (4 if shape == "chat" else 3)  # (chat: the role opening first)
    # Not asked for: a message without text makes no chunk.
    n, logprobs = await tokens_logprobs(None)
    assert logprobs == [] and n == (3 if shape == "chat" else 2)


async def test_error_after_the_first_byte_is_an_event_then_done():
    responder = _responder(RouterMetrics())
    first, *rest = _messages(3)
    stream = _Rest(rest[:1], error=OpenAIError(502, "decode pod failed"))
    sent = await _run(
        EventStream(responder.sse(_ereq(), ChatShape(CARD), first, stream, include_usage=False))
    )
    events = _events(sent)
    assert json.loads(events[-2][6:])["error"]["message"] == "decode pod failed"
    assert events[-1] == b"data: [DONE]" and stream.closed


async def test_client_disconnect_stops_the_stream_quietly():
    metrics = RouterMetrics()
    responder = _responder(metrics)
    first, *rest = _messages(3)
    stream = _Rest(rest, hang=True)
    # start + 3 chunks, then the client leaves while the engine is silent:
    # the response ends without raising, and without [DONE].
    sent = await _run(
        EventStream(responder.sse(_ereq(), ChatShape(CARD), first, stream, include_usage=False)),
        disconnect_after=3,
    )
    assert stream.closed
    assert all(m.get("more_body", True) for m in sent)
    assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    assert (
        metric_value(
            generate_latest(metrics.registry).decode(), "tandem_router_client_disconnects_total"
        )
        == 1
    )


async def test_someone_elses_cancellation_goes_on():
    responder = _responder(RouterMetrics())
    first, *rest = _messages(3)
    task = asyncio.ensure_future(
        _run(
            EventStream(
                responder.sse(
                    _ereq(), ChatShape(CARD), first, _Rest(rest, hang=True), include_usage=False
                )
            )
        )
    )
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _Orchestrator:
    """Streams `messages`, then hangs (before the first one, with none)."""

    def __init__(self, messages: list[pb.GenerateResponse]) -> None:
        self.messages = messages
        self.closed = False

    async def stream(self, ereq):
        try:
            for message in self.messages:
                yield message
            await asyncio.Event().wait()
        finally:
            self.closed = True


def _request(gone: asyncio.Event):
    from starlette.requests import Request

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_client_leaving_before_the_first_token_is_a_499():
    metrics = RouterMetrics()
    engine = _Orchestrator([])
    responder = Responder(engine, metrics, timeout_s=30)
    gone = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, gone.set)
    with pytest.raises(OpenAIError) as raised:
        await responder.respond(_request(gone), _ereq(), ChatShape(CARD), True, False)
    assert raised.value.status == 499 and engine.closed
    text = generate_latest(metrics.registry).decode()
    assert metric_value(text, "tandem_router_client_disconnects_total") == 1


async def test_no_first_token_within_the_timeout_is_a_504():
    engine = _Orchestrator([])
    responder = Responder(engine, RouterMetrics(), timeout_s=0.05)
    with pytest.raises(OpenAIError) as raised:
        await responder.respond(_request(asyncio.Event()), _ereq(), ChatShape(CARD), True, False)
    assert raised.value.status == 504 and engine.closed


async def test_the_first_tokens_watch_carries_on_into_the_stream():
    """One watch per request: the client leaving mid-stream ends the stream
    quietly, as before the first token it is a 499."""
    metrics = RouterMetrics()
    engine = _Orchestrator(_messages(3)[:2])
    responder = Responder(engine, metrics, timeout_s=30)
    gone = asyncio.Event()
    response = await responder.respond(_request(gone), _ereq(), ChatShape(CARD), True, False)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if len(sent) == 3:  # start, two chunks; then the engine is silent
            gone.set()

    async def no_receive():  # the request's watch listens, not the response's
        await asyncio.Event().wait()

    await asyncio.wait_for(response({"type": "http"}, no_receive, send), 5)
    assert len(sent) == 3 and engine.closed
    text = generate_latest(metrics.registry).decode()
    assert metric_value(text, "tandem_router_client_disconnects_total") == 1


async def test_choices_stream_interleaved_numbered_with_one_usage():
    responder = _responder(RouterMetrics())
    (first_a, *rest_a), (first_b, *rest_b) = _messages(3), _messages(2)
    streams = [_Rest(rest_a), _Rest(rest_b)]
    sent = await _run(
        EventStream(
            sse_choices(
                responder,
                [_ereq(), _ereq()],
                [ChatShape(CARD), ChatShape(CARD)],
                [first_a, first_b],
                streams,
                include_usage=True,
            )
        )
    )
    events = _events(sent)
    assert events[-1] == b"data: [DONE]" and all(s.closed for s in streams)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    texts = ["", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == [" t0 t1 t2", " t0 t1"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert sum(1 for c in chunks if c.get("usage")) == 1


async def test_a_failing_choice_ends_the_stream_with_an_error():
    responder = _responder(RouterMetrics())
    (first_a, *rest_a), (first_b, *rest_b) = _messages(3), _messages(3)
    streams = [_Rest(rest_a, hang=True), _Rest(rest_b[:1], error=OpenAIError(502, "gone"))]
    sent = await _run(
        EventStream(
            sse_choices(
                responder,
                [_ereq(), _ereq()],
                [ChatShape(CARD), ChatShape(CARD)],
                [first_a, first_b],
                streams,
                include_usage=True,
            )
        )
    )
    events = _events(sent)
    assert json.loads(events[-2][6:])["error"]["message"] == "gone"
    assert all(s.closed for s in streams)
