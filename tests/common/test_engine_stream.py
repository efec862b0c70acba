"""Many Generate calls over one GenerateStream (common/engine_stream.py): the
engine's end batching a step's events, and the router's end over real gRPC —
each request its own tokens, errors and cancels; the stream's end failing
what is on it with UNAVAILABLE; a new stream after."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.engine_stream import GenerateStreamClient, GenerateStreamServer, RequestFailed
from common.ports import free_port
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc

TIMEOUT_S = 30.0


class Steps:
    """An engine whose requests make a token per `step()`, all at once as
    vLLM hands out a step's outputs; a request asking for 0 tokens fails."""

    def __init__(self) -> None:
        self._step = asyncio.Condition()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def step(self) -> None:
        await asyncio.sleep(0)  # let every start reach its first wait
        async with self._step:
            self._step.notify_all()

    async def generate(self, request: pb.GenerateRequest):
        self.started.append(request.request_id)
        n = request.sampling_params.max_tokens
        if n == 0:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens is 0")
        if request.request_id == "bug":
            raise KeyError("a bug in the engine")
        try:
            for i in range(n):
                async with self._step:
                    await self._step.wait()
                message = pb.GenerateResponse(token_ids=[i], text=f"{request.request_id}:{i}")
                if i == n - 1:
                    message.finish_reason = "length"
                yield message
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


def _request(request_id: str, tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=[1, 2, 3],
        sampling_params=pb.SamplingParams(max_tokens=tokens),
    )


async def _until(predicate) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not predicate():
            await asyncio.sleep(0.005)


# ----- the engine's end, no gRPC ----------------------------------------------


async def test_a_steps_tokens_go_out_in_one_message():
    steps = Steps()
    starts: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()

    async def caller():
        while (message := await starts.get()) is not None:
            yield message

    responses = GenerateStreamServer(steps.generate).run(caller())
    starts.put_nowait(pb.GenerateStreamRequest(starts=[_request(f"r{i}", 2) for i in range(5)]))
    starts.put_nowait(None)  # half-closed: the stream ends once the five do
    pending = asyncio.ensure_future(anext(responses))
    await _until(lambda: len(steps.started) == 5)
    await steps.step()
    first = await asyncio.wait_for(pending, TIMEOUT_S)
    assert sorted(e.request_id for e in first.events) == [f"r{i}" for i in range(5)]
    assert not any(e.response.finish_reason for e in first.events)

    await steps.step()
    last = await asyncio.wait_for(anext(responses), TIMEOUT_S)
    assert [e.response.finish_reason for e in last.events] == ["length"] * 5
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(responses), TIMEOUT_S)


# ----- both ends over gRPC ----------------------------------------------------


@pytest.fixture
async def engine():
    steps = Steps()

    class Servicer(pb_grpc.EngineServicer):
        async def GenerateStream(self, request_iterator, context):
            async for response in GenerateStreamServer(steps.generate).run(request_iterator):
                yield response

    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(Servicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = GenerateStreamClient(pb_grpc.EngineStub(channel))
    yield steps, client, server
    await client.aclose()
    await channel.close()
    await server.stop(None)


async def _read_all(call) -> list[str]:
    return [m.text async for m in call]


async def test_each_request_gets_its_own_tokens(engine):
    steps, client, _ = engine
    calls = {f"r{i}": client.generate(_request(f"r{i}", i + 1)) for i in range(3)}
    reads = {rid: asyncio.ensure_future(_read_all(call)) for rid, call in calls.items()}
    await _until(lambda: len(steps.started) == 3)
    for _ in range(3):
        await steps.step()
    for rid, read in reads.items():
        n = int(rid[1:]) + 1
        assert await asyncio.wait_for(read, TIMEOUT_S) == [f"{rid}:{i}" for i in range(n)]
    assert client.in_flight == 0


async def test_one_requests_error_is_its_own(engine):
    steps, client, _ = engine
    bad = client.generate(_request("bad", 0))
    good = client.generate(_request("good", 1))
    good_read = asyncio.ensure_future(_read_all(good))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_read_all(bad), TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "max_tokens is 0"
    await _until(lambda: "good" in steps.started)
    await steps.step()
    assert await asyncio.wait_for(good_read, TIMEOUT_S) == ["good:0"]


async def test_a_bug_fails_that_request_only_as_unknown(engine):
    # As gRPC fails a call whose handler raises: the request must not hang.
    steps, client, _ = engine
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_read_all(client.generate(_request("bug", 1))), TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "a bug in the engine" in err.value.details()
    good = asyncio.ensure_future(_read_all(client.generate(_request("good", 1))))
    await _until(lambda: "good" in steps.started)
    await steps.step()
    assert await asyncio.wait_for(good, TIMEOUT_S) == ["good:0"]


async def test_a_cancel_aborts_that_request_only(engine):
    steps, client, _ = engine
    leaving = client.generate(_request("leaving", 5))
    staying = client.generate(_request("staying", 2))
    staying_read = asyncio.ensure_future(_read_all(staying))
    await _until(lambda: len(steps.started) == 2)
    leaving.cancel()
    await _until(lambda: steps.cancelled == ["leaving"])
    for _ in range(2):
        await steps.step()
    assert await asyncio.wait_for(staying_read, TIMEOUT_S) == ["staying:0", "staying:1"]
    with pytest.raises(StopAsyncIteration):
        await anext(leaving)


async def test_a_duplicate_request_id_is_refused(engine):
    steps, client, _ = engine
    first = client.generate(_request("same", 1))
    again = client.generate(_request("same", 1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await anext(again)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()


async def test_the_streams_end_fails_what_is_on_it_and_a_new_one_opens(engine):
    steps, client, server = engine
    call = client.generate(_request("r1", 5))
    read = asyncio.ensure_future(_read_all(call))
    await _until(lambda: steps.started == ["r1"])
    await server.stop(None)  # the engine goes away mid-request
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(read, TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.in_flight == 0
    # The next request opens a new stream (which fails too: nothing listens).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_read_all(client.generate(_request("r2", 1))), TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_closing_when_idle_ends_the_call_after_its_requests(engine):
    steps, client, _ = engine
    call = client.generate(_request("last", 1))
    read = asyncio.ensure_future(_read_all(call))
    await _until(lambda: steps.started == ["last"])
    stream = client._stream
    client.close_when_idle()
    await steps.step()
    assert await asyncio.wait_for(read, TIMEOUT_S) == ["last:0"]
    await asyncio.wait_for(stream._reader, TIMEOUT_S)  # the RPC ended, with no error
    assert stream.ended


async def test_a_reader_that_falls_behind_gets_its_tokens_merged(engine):
    # A stalled client must not hold a message per token: beyond a few
    # messages, new tokens join the last one, as vLLM merges them.
    steps, client, _ = engine
    call = client.generate(_request("slow", 40))
    await _until(lambda: steps.started == ["slow"])
    for _ in range(40):
        await steps.step()
        await asyncio.sleep(0.01)
    messages = [m async for m in call]
    assert len(messages) < 40
    assert [t for m in messages for t in m.token_ids] == list(range(40))
    assert "".join(m.text for m in messages) == "".join(f"slow:{i}" for i in range(40))
    assert messages[-1].finish_reason == "length"
