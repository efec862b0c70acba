"""How the replay client judges one response: a stream is ok only when it
ends with a finish_reason, then ``[DONE]``, with output; anything else is a
failure of a named kind (``replay.FAILURES``), whatever tokens came before
it. The endpoint is httpx's MockTransport, so no server is needed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tandem.workload.content import BuiltPrompt
from tandem.workload.replay import ReplayConfig, Replayer, RequestRecord


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {"id": "r1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
USAGE = f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 2}})}\n\n".encode()
ERROR = f"data: {json.dumps({'error': {'message': 'decode pod p is unavailable'}})}\n\n".encode()


def replayer_of(timeout_s: float = 30) -> Replayer:
    return Replayer(
        ReplayConfig(url="http://r", model="m", progress=False, timeout_s=timeout_s), [], {}
    )


async def _replay(respond, replayer: Replayer | None = None) -> tuple[RequestRecord, Replayer]:
    replayer = replayer or replayer_of()
    rec = RequestRecord("s", "", 0, 0, 0.0, 1, 2, 2, 1)
    transport = httpx.MockTransport(respond)
    async with httpx.AsyncClient(base_url="http://r", transport=transport) as client:
        await replayer._call(
            client, rec, BuiltPrompt([{"role": "user", "content": "x"}], [1], 1), "k"
        )
    assert replayer.streaming == 0  # every stream counted in was counted out
    return rec, replayer


def stream_of(*events: bytes, then: Exception | None = None):
    async def body() -> AsyncIterator[bytes]:
        for e in events:
            yield e
        if then is not None:
            raise then

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    return respond


async def test_a_finished_stream_is_ok():
    rec, _ = await _replay(stream_of(chunk(""), chunk("Hi"), chunk("!", "length"), USAGE, DONE))
    assert rec.ok and rec.failure is None and rec.error is None
    assert rec.output_tokens == 2 and rec.ttft is not None and rec.response_id == "r1"


@pytest.mark.parametrize(
    "events, missing",
    [
        ((chunk(""), chunk("Hi")), "a finish_reason and [DONE]"),
        ((chunk("Hi"), DONE), "a finish_reason"),
        ((chunk("Hi", "stop"),), "[DONE]"),
    ],
)
async def test_a_stream_cut_short_is_truncated_though_tokens_came(events, missing):
    rec, _ = await _replay(stream_of(*events))
    assert not rec.ok
    assert (rec.failure, rec.error) == ("truncated", f"stream ended without {missing}")
    assert rec.output_tokens == 1  # what streamed before it ended


async def test_an_error_event_after_tokens_is_a_failure():
    rec, _ = await _replay(stream_of(chunk("Hi"), ERROR, DONE))
    assert (rec.ok, rec.failure, rec.output_tokens) == (False, "error_event", 1)
    assert "decode pod p is unavailable" in (rec.error or "")


async def test_a_broken_connection_is_lost_not_truncated():
    rec, _ = await _replay(stream_of(chunk("Hi"), then=httpx.RemoteProtocolError("peer closed")))
    assert (rec.ok, rec.failure) == (False, "connection_lost")


async def test_a_finished_stream_without_output_fails():
    rec, _ = await _replay(stream_of(chunk(""), chunk(None, "stop"), DONE))
    assert (rec.ok, rec.failure) == (False, "no_output")


async def test_an_error_status_is_named_with_its_code():
    rec, _ = await _replay(
        lambda r: httpx.Response(503, json={"error": {"message": "no decode pod"}})
    )
    assert (rec.ok, rec.failure, rec.status, rec.error) == (
        False,
        "http_503",
        503,
        "HTTP 503: no decode pod",
    )


async def test_a_response_past_the_deadline_is_a_timeout():
    async def slow() -> AsyncIterator[bytes]:
        yield chunk("Hi")
        await asyncio.sleep(30)
        yield DONE

    rec, _ = await _replay(lambda r: httpx.Response(200, content=slow()), replayer_of(0.5))
    assert (rec.ok, rec.failure) == (False, "timeout")


async def test_streaming_counts_responses_with_output_in_flight():
    replayer = replayer_of()
    seen: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        yield chunk("")
        await asyncio.sleep(0)
        seen.append(replayer.streaming)  # before any output
        yield chunk("Hi")
        await asyncio.sleep(0)
        seen.append(replayer.streaming)
        yield chunk("!", "length")
        yield DONE

    rec, _ = await _replay(lambda r: httpx.Response(200, content=body()), replayer)
    assert rec.ok and seen == [0, 1]
