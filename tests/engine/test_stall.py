"""A hung engine fails fast: the stall rule (pure, times passed in), the host's
watch loop, and the servicer failing in-flight calls with UNAVAILABLE over
real gRPC.

The engine here is a fake whose requests never progress, since a real hang
cannot be produced on demand without starting vLLM (a minute per engine; the
stall of a real engine whose worker is stopped was checked by hand, see the
branch's report). vLLM's own stat-logger base class is real: the tracker's
progress signal is its `record` call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.engine_stream import GenerateStreamClient
from common.ports import free_port
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from common.roles import Role
from services.engine.load import LoadTracker
from services.engine.metrics import EngineMetrics
from services.engine.server import watch_engine
from services.engine.servicer import EngineServicer

TIMEOUT_S = 60.0


# ----- the rule -------------------------------------------------------------


def test_an_idle_engine_never_stalls():
    load = LoadTracker()
    assert load.seconds_without_progress(1e6) == 0.0
    assert not load.stalled(1e6, TIMEOUT_S)


def test_the_clock_starts_when_work_reaches_an_idle_engine():
    load = LoadTracker()
    load.request_started(1000.0)  # idle for 1000 s before: no stall
    assert load.seconds_without_progress(1030.0) == 30.0
    assert not load.stalled(1059.9, TIMEOUT_S)
    assert load.stalled(1060.0, TIMEOUT_S)


def test_more_requests_at_a_stuck_engine_do_not_restart_the_clock():
    # The incident: the router kept sending to an engine hung inside a step.
    load = LoadTracker()
    load.request_started(100.0)
    for t in range(110, 170, 10):
        load.request_started(float(t))
    assert load.in_flight == 7
    assert load.stalled(160.0, TIMEOUT_S)


def test_an_engine_step_is_progress():
    load = LoadTracker()
    load.request_started(100.0)
    load.engine_stepped(150.0)
    assert not load.stalled(200.0, TIMEOUT_S)
    assert load.stalled(210.0, TIMEOUT_S)


def test_an_engine_that_goes_idle_is_not_stalled_and_starts_afresh():
    load = LoadTracker()
    load.request_started(100.0)
    load.request_ended()
    assert not load.stalled(500.0, TIMEOUT_S)
    load.request_started(500.0)
    assert load.seconds_without_progress(510.0) == 10.0


def test_timeout_zero_turns_the_rule_off():
    load = LoadTracker()
    load.request_started(0.0)
    assert load.seconds_without_progress(1e6) == 1e6
    assert not load.stalled(1e6, 0.0)


def test_every_call_of_vllms_stat_logger_is_progress():
    # vLLM calls it once per engine-core step, also for steps without outputs
    # (scheduler_stats only) and with stats off (None).
    load = LoadTracker()
    load.request_started(0.0)
    logger = load.stat_logger_factory()(vllm_config=None)
    logger.record(scheduler_stats=None, iteration_stats=None)
    assert load.last_progress > 0.0
    assert not load.stalled(load.last_progress + 1.0, TIMEOUT_S)


# ----- the watch loop -------------------------------------------------------


class _Engine:
    """Just what the host's watch loop and the servicer use of vLLM's AsyncLLM."""

    def __init__(self, dead: bool = False) -> None:
        self.dead = dead
        self.aborted: list[str] = []
        self.model_config = self
        self.started = asyncio.Event()

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return {}

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore encountered an issue")

    async def generate(self, prompt, params, request_id):
        """Never produces anything, like an engine stuck inside a step; aborts
        the request when cancelled, as vLLM's generator does."""
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        yield  # an async generator, as vLLM's


async def test_watch_reports_a_stall_with_requests_in_flight():
    load = LoadTracker()
    load.request_started(time.monotonic())
    reason, message = await asyncio.wait_for(
        watch_engine(_Engine(), load, stall_timeout_s=0.2, period_s=0.02), TIMEOUT_S
    )
    assert reason == "engine_stalled"
    assert "no engine step" in message and "1 request(s) in flight" in message


async def test_watch_reports_a_dead_engine():
    reason, message = await asyncio.wait_for(
        watch_engine(_Engine(dead=True), LoadTracker(), stall_timeout_s=0.2, period_s=0.02),
        TIMEOUT_S,
    )
    assert reason == "engine_dead" and "EngineCore encountered an issue" in message


# ----- failing what is in flight ----------------------------------------------


@pytest.fixture
async def served():
    engine, load = _Engine(), LoadTracker()
    registry = CollectorRegistry()
    servicer = EngineServicer(
        engine, Role.BOTH, "model", "model", load, EngineMetrics("both", registry)
    )
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine, load, servicer, pb_grpc.EngineStub(channel), registry
    await channel.close()
    await server.stop(None)


async def test_failing_the_engine_ends_calls_in_flight_with_unavailable(served):
    engine, load, servicer, stub, registry = served
    prefill = asyncio.ensure_future(
        stub.Prefill(pb.PrefillRequest(request_id="p1", token_ids=[1, 2, 3]))
    )
    generate = stub.Generate(pb.GenerateRequest(request_id="g1", token_ids=[1, 2, 3]))
    streamed = asyncio.ensure_future(generate.read())
    while load.in_flight < 2:
        await asyncio.sleep(0.01)

    servicer.fail_all("engine_stalled", "engine stalled: no engine step for 120s")

    for call in (prefill, streamed):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call, TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine stalled" in err.value.details()
    assert sorted(engine.aborted) == ["g1", "p1"]  # vLLM frees their KV
    assert await servicer.wait_idle(TIMEOUT_S) and load.in_flight == 0
    for kind in ("prefill", "generate"):
        assert (
            registry.get_sample_value(
                "tandem_engine_request_errors_total", {"kind": kind, "reason": "engine_stalled"}
            )
            == 1
        )
    assert (
        registry.get_sample_value("tandem_engine_requests_cancelled_total", {"kind": "prefill"})
        is None
    )

    # A request that comes after is refused at once, with the same reason.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Prefill(pb.PrefillRequest(request_id="p2", token_ids=[1]), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine stalled" in err.value.details()


async def test_a_caller_that_leaves_is_still_a_cancellation(served):
    engine, load, servicer, stub, registry = served
    call = stub.Generate(pb.GenerateRequest(request_id="g1", token_ids=[1, 2, 3]))
    read = asyncio.ensure_future(call.read())
    await asyncio.wait_for(engine.started.wait(), TIMEOUT_S)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert await servicer.wait_idle(TIMEOUT_S) and not servicer.failed
    assert engine.aborted == ["g1"]
    assert (
        registry.get_sample_value("tandem_engine_requests_cancelled_total", {"kind": "generate"})
        == 1
    )


async def test_failing_the_engine_ends_streamed_requests_with_unavailable(served):
    # On the router's shared GenerateStream each request fails alone, as an
    # event; the stream stays open for what comes next.
    engine, load, servicer, stub, registry = served
    client = GenerateStreamClient(stub)
    call = client.generate(pb.GenerateRequest(request_id="s1", token_ids=[1, 2, 3]))
    read = asyncio.ensure_future(anext(call))
    await asyncio.wait_for(engine.started.wait(), TIMEOUT_S)

    servicer.fail_all("engine_stalled", "engine stalled: no engine step for 120s")

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(read, TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine stalled" in err.value.details()
    assert engine.aborted == ["s1"]
    later = client.generate(pb.GenerateRequest(request_id="s2", token_ids=[1]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(anext(later), TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await servicer.wait_idle(TIMEOUT_S) and load.in_flight == 0
    await client.aclose()


async def test_a_streamed_request_the_caller_cancels_is_a_cancellation(served):
    engine, load, servicer, stub, registry = served
    client = GenerateStreamClient(stub)
    call = client.generate(pb.GenerateRequest(request_id="s1", token_ids=[1, 2, 3]))
    await asyncio.wait_for(engine.started.wait(), TIMEOUT_S)
    call.cancel()
    async with asyncio.timeout(TIMEOUT_S):
        while engine.aborted != ["s1"] or load.in_flight:
            await asyncio.sleep(0.01)
    assert not servicer.failed
    assert (
        registry.get_sample_value("tandem_engine_requests_cancelled_total", {"kind": "generate"})
        == 1
    )
    await client.aclose()
