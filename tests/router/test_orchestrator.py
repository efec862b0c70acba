"""The request path (`pd.Orchestrator`) over the routing core, with fake
engine stubs: which pods are called, with which KV parameters, and what is
counted when pods fail before the first byte. Fast; no engines."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import generate_latest

from common.proto import engine_pb2 as pb
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest, Orchestrator
from services.router.pods import PodPool
from services.router.routing import PodSpec, Replica, RoutingCore, RoutingSettings
from services.router.routing.policy import PolicySettings
from services.router.routing.shared_state import LocalState
from tests.helpers import metric_value


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="connection refused",
    )


class _Call:
    """A Generate call: its messages, then ``error`` if given; with ``stall``
    it sets that event after the messages and waits for a cancel."""

    def __init__(self, messages, error=None, stall=None):
        self._messages, self._error, self._stall = messages, error, stall

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        if self._error:
            raise self._error
        for m in self._messages:
            yield m
        if self._stall is not None:
            self._stall.set()
            await asyncio.Event().wait()

    def cancel(self):
        pass


class FakeStub:
    def __init__(self, dead: bool = False, cached_tokens: int = 0) -> None:
        self.dead = dead
        self.cached_tokens = cached_tokens
        self.calls: list[tuple[str, object]] = []

    async def Prefill(self, req, **_):
        self.calls.append(("Prefill", req))
        if self.dead:
            raise _unavailable()
        return pb.PrefillResponse(
            kv_transfer_params_json='{"remote": 1}',
            prompt_tokens=len(req.token_ids),
            cached_tokens=self.cached_tokens,
        )

    def Generate(self, req, **_):
        self.calls.append(("Generate", req))
        final = pb.GenerateResponse(
            text="hi",
            finish_reason="stop",
            usage=pb.Usage(
                prompt_tokens=len(req.token_ids),
                completion_tokens=1,
                cached_tokens=self.cached_tokens,
            ),
        )
        return _Call([final], _unavailable() if self.dead else None)

    async def ReleaseKv(self, req, **_):
        self.calls.append(("ReleaseKv", req))
        return pb.ReleaseKvResponse()


def _setup(specs, threshold=0, retention=None, **policy):
    """specs: (role, stub) or (role, stub, pool) per pod."""
    metrics = RouterMetrics()
    settings = RoutingSettings(
        block_size=16, policy=PolicySettings(remote_prefill_threshold=threshold, **policy)
    )
    core = RoutingCore(settings)
    pool = PodPool(core, poll_interval_s=60, shared_streams=False)
    for i, (role, stub, *pod_pool) in enumerate(specs):
        pod = pool.add_pod(PodSpec(f"127.0.0.1:{1000 + i}", role, pool="".join(pod_pool)))
        pod.stub = stub
        core.update_pod(pod.address, time.monotonic(), healthy=True)
    state = LocalState()
    metrics.watch(core, pool, state)
    return Orchestrator(pool, Replica(core, state), metrics, retention), metrics, core


def _idle(core) -> bool:
    return all(
        core.local_load(p).in_flight == 0 and core.local_load(p).pending_prefill_tokens == 0
        for p in core.pods
    )


def _request(n=100, session=None, source=None, end=False):
    return EngineRequest(
        request_id="r1",
        token_ids=list(range(1, n + 1)),
        sampling=pb.SamplingParams(max_tokens=1),
        cache_salt=None,
        arrival=time.perf_counter(),
        session=session,
        session_source=source,
        session_end=end,
    )


async def _run(orchestrator, req):
    return [m async for m in orchestrator.stream(req)]


def _metrics(metrics) -> str:
    return generate_latest(metrics.registry).decode()


async def test_prefill_then_decode_with_the_prefill_kv():
    prefill, decode = FakeStub(), FakeStub()
    orch, metrics, core = _setup([("prefill", prefill), ("decode", decode)])
    out = await _run(orch, _request())
    assert out[-1].finish_reason == "stop"
    assert [c[0] for c in prefill.calls] == ["Prefill"]
    assert decode.calls[0][1].kv_transfer_params_json == '{"remote": 1}'
    text = _metrics(metrics)
    assert metric_value(text, "tandem_routing_prediction_total", 'outcome="exact"') == 1
    assert _idle(core)


async def test_dead_prefill_pod_falls_back_to_local_prefill():
    prefill, decode = FakeStub(dead=True), FakeStub()
    orch, metrics, _ = _setup([("prefill", prefill), ("decode", decode)])
    await _run(orch, _request())
    assert decode.calls[0][1].kv_transfer_params_json == ""
    text = _metrics(metrics)
    assert (
        metric_value(text, "tandem_router_local_prefill_total", 'reason="prefill_unavailable"') == 1
    )
    assert (
        metric_value(
            text, "tandem_router_pod_state", 'pod="127.0.0.1:1000",role="prefill",state="unhealthy"'
        )
        == 1
    )


async def test_short_uncached_prompt_prefills_on_the_decode_pod():
    prefill, decode = FakeStub(), FakeStub()
    orch, metrics, _ = _setup([("prefill", prefill), ("decode", decode)], threshold=256)
    await _run(orch, _request(n=40))
    assert prefill.calls == []
    assert (
        metric_value(
            _metrics(metrics), "tandem_router_local_prefill_total", 'reason="short_uncached"'
        )
        == 1
    )


async def test_decode_failure_retries_on_another_decode_with_the_same_kv():
    prefill, dead, good = FakeStub(), FakeStub(dead=True), FakeStub()
    # Equal costs: the core tries the lower address, the dead pod, first.
    orch, metrics, _ = _setup([("prefill", prefill), ("decode", dead), ("decode", good)])
    out = await _run(orch, _request())
    assert out[-1].finish_reason == "stop"
    assert [c[0] for c in dead.calls] == ["Generate"]
    assert [c[0] for c in prefill.calls] == ["Prefill"]  # never prefilled twice
    assert good.calls[0][1].kv_transfer_params_json == '{"remote": 1}'
    assert metric_value(_metrics(metrics), "tandem_router_retries_total", 'stage="decode"') == 1


async def test_no_decode_pod_is_503_before_any_prefill():
    prefill, decode = FakeStub(), FakeStub()
    orch, _, core = _setup([("prefill", prefill), ("decode", decode)])
    core.update_pod("127.0.0.1:1001", time.monotonic(), healthy=False)
    with pytest.raises(OpenAIError) as err:
        await _run(orch, _request())
    assert err.value.status == 503 and "decode" in str(err.value.message)
    assert prefill.calls == []


async def test_aggregated_session_sticks_and_reports_cached_tokens():
    a, b = FakeStub(), FakeStub()
    orch, metrics, _ = _setup([("both", a), ("both", b)])
    for i in range(3):
        req = _request(session="s1")
        req.request_id = f"r{i}"
        await _run(orch, req)
    assert sorted([len(a.calls), len(b.calls)]) == [0, 3]
    assert (
        metric_value(_metrics(metrics), "tandem_routing_prediction_total", 'outcome="exact"')
        + metric_value(_metrics(metrics), "tandem_routing_prediction_total", 'outcome="over"')
        == 3
    )


class DecodingStub(FakeStub):
    """A token first, then the final message: a request that decodes."""

    def Generate(self, req, **_):
        call = super().Generate(req)
        return _Call([pb.GenerateResponse(token_ids=[7], text="h")] + call._messages)


async def test_a_decoding_request_holds_a_slot_but_no_pending_prefill():
    # Pending prefill tokens are work queued ahead of the next request's first
    # token; once this prompt's first token is out, a decode step is all it
    # costs there. Holding them until the end made a pod with long decodes look
    # busy, and the cost policy spread sub-agent forks off their parent's KV.
    orch, _, core = _setup([("both", DecodingStub())])
    stream = orch.stream(_request(n=100))
    first = await anext(stream)
    assert first.token_ids == [7]
    (pod,) = core.pods
    assert (core.local_load(pod).in_flight, core.local_load(pod).pending_prefill_tokens) == (1, 0)
    rest = [m async for m in stream]
    assert rest[-1].finish_reason == "stop"
    assert _idle(core)


class StallingStub(FakeStub):
    """Prefill and Generate that wait until the client leaves (a stopped replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def Prefill(self, req, **_):
        self.calls.append(("Prefill", req))
        self.waiting.set()
        await asyncio.Event().wait()

    def Generate(self, req, **_):
        self.calls.append(("Generate", req))
        return _Call([pb.GenerateResponse(token_ids=[7], text="h")], stall=self.waiting)


@pytest.mark.parametrize("stalls", ["prefill", "decode"])
async def test_a_client_leaving_mid_request_frees_the_pods_load(stalls):
    # A replay stopped between phases cancels its requests: whether in the
    # prefill or mid-stream on the decode pod, no load may stay behind, or
    # the pod looks busy to the cost policy from then on.
    prefill, decode = FakeStub(), DecodingStub()
    stalling = StallingStub()
    if stalls == "prefill":
        prefill = stalling
    else:
        decode = stalling
    orch, _, core = _setup([("prefill", prefill), ("decode", decode)])
    task = asyncio.create_task(_run(orch, _request(n=100, session="s")))
    await asyncio.wait_for(stalling.waiting.wait(), 5)
    assert not _idle(core)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _idle(core)


async def test_retention_hint_goes_to_the_engine_that_writes_the_kv():
    from services.router.retention import RetentionSettings, SessionRetention

    retention = SessionRetention(RetentionSettings(ttl_s=30), block_size=16)
    prefill, decode = FakeStub(), FakeStub()
    orch, metrics, _ = _setup([("prefill", prefill), ("decode", decode)], retention=retention)
    await _run(orch, _request(n=100, session="h:s", source="header"))
    sent = prefill.calls[0][1].retention
    assert (sent.session, sent.pin_ttl_ms, sent.release) == ("h:s", 30_000, False)
    # The decode pod pulls the KV over NIXL and writes nothing: no hint.
    assert not decode.calls[0][1].HasField("retention")
    # The session's last request: release, keeping nothing (no other session).
    await _run(orch, _request(n=120, session="h:s", source="header", end=True))
    sent = prefill.calls[1][1].retention
    assert (sent.release, sent.keep_tokens, sent.pin_ttl_ms) == (True, 0, 0)
    # A session the client did not name is not pinned (named-sessions policy).
    await _run(orch, _request(n=100, session="d:x", source="derived"))
    assert not prefill.calls[2][1].HasField("retention")
    text = _metrics(metrics)
    assert metric_value(text, "tandem_router_kv_retention_hints_total", 'kind="pin"') == 1
    assert metric_value(text, "tandem_router_kv_retention_hints_total", 'kind="release"') == 1


async def test_retention_hint_on_generate_when_the_pod_computes_the_prompt():
    from services.router.retention import RetentionSettings, SessionRetention

    retention = SessionRetention(RetentionSettings(ttl_s=30), block_size=16)
    a = FakeStub()
    orch, _, _ = _setup([("both", a)], retention=retention)
    await _run(orch, _request(session="u:alice", source="user"))
    assert a.calls[0][1].retention.pin_ttl_ms == 30_000


async def test_request_classes_route_to_their_prefill_pools_and_are_counted():
    from services.router.routing.classes import ClassPool

    fresh, warm, decode = FakeStub(), FakeStub(), FakeStub()
    orch, metrics, core = _setup(
        [("prefill", fresh, "fresh"), ("prefill", warm, "warm"), ("decode", decode)],
        long_request_tokens=64,
        prefill_pool_for=(ClassPool("long", "fresh"),),
    )
    # A session's first turn: nothing cached anywhere, a long prefill.
    await _run(orch, _request(n=100, session="s"))
    # Its next turn extends it: 96 tokens predicted cached, an append turn.
    await _run(orch, _request(n=120, session="s"))
    assert [len(fresh.calls), len(warm.calls)] == [1, 1]
    assert len(warm.calls[0][1].token_ids) == 120
    text = _metrics(metrics)
    assert (
        metric_value(
            text, "tandem_routing_class_requests_total", 'class="long",pod="127.0.0.1:1000"'
        )
        == 1
    )
    assert (
        metric_value(
            text, "tandem_routing_class_requests_total", 'class="append",pod="127.0.0.1:1001"'
        )
        == 1
    )
    for request_class in ("long", "append"):
        assert (
            metric_value(text, "tandem_router_class_ttft_seconds_count", f'class="{request_class}"')
            == 1
        )
    assert _idle(core)


class StalledStub(FakeStub):
    """A prefill engine stuck inside a step: its Prefill waits until the
    engine host gives up on it and fails the call with UNAVAILABLE."""

    def __init__(self) -> None:
        super().__init__()
        self.give_up = asyncio.Event()

    async def Prefill(self, req, **_):
        self.calls.append(("Prefill", req))
        await self.give_up.wait()
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="engine stalled",
        )


async def test_a_prefill_failed_by_a_stalled_engine_is_retried_on_another_prefill_pod():
    stalled, good, decode = StalledStub(), FakeStub(), FakeStub()
    # Equal costs: the core tries the lower address, the stalled pod, first.
    orch, metrics, core = _setup([("prefill", stalled), ("prefill", good), ("decode", decode)])
    run = asyncio.ensure_future(_run(orch, _request()))
    while not stalled.calls:
        await asyncio.sleep(0.01)
    stalled.give_up.set()
    out = await run
    assert out[-1].finish_reason == "stop"
    assert [c[0] for c in good.calls] == ["Prefill"]
    assert [c[0] for c in decode.calls] == ["Generate"]  # once, with the good pod's KV
    assert decode.calls[0][1].kv_transfer_params_json == '{"remote": 1}'
    text = _metrics(metrics)
    assert metric_value(text, "tandem_router_retries_total", 'stage="prefill"') == 1
    assert (
        metric_value(
            text, "tandem_router_pod_state", 'pod="127.0.0.1:1000",role="prefill",state="unhealthy"'
        )
        == 1
    )
    assert _idle(core)
    # The next request does not go near it until a poll finds it healthy.
    await _run(orch, _request())
    assert len(stalled.calls) == 1 and len(good.calls) == 2
