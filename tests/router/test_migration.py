"""Request migration: the pure bookkeeping (`services/router/migration.py`:
the resumed request, usage, stop strings across the seam) and the request
path (`pd.Orchestrator`) resuming a stream whose decode pod is lost, with fake
engine stubs. Fast; no engines."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import generate_latest

from common.proto import engine_pb2 as pb
from services.router.config import parse_settings
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.migration import DEADLINE, DISABLED, LIMIT, UNSUPPORTED, Migration
from services.router.pd import EngineRequest, Orchestrator
from services.router.pods import PodPool
from services.router.routing import PodSpec, Replica, RoutingCore, RoutingSettings
from services.router.routing.policy import PolicySettings
from services.router.routing.shared_state import LocalState
from tests.helpers import metric_value

PROMPT = list(range(1, 41))


def _text(ids) -> str:
    """The fake model's detokenizer: token 7 reads "t7 "."""
    return "".join(f"t{i} " for i in ids)


def _message(ids, finish="", prompt=0, cached=0) -> pb.GenerateResponse:
    message = pb.GenerateResponse(token_ids=ids, text=_text(ids), finish_reason=finish)
    if finish:
        message.usage.CopyFrom(
            pb.Usage(prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=cached)
        )
    return message


def _migration(max_migrations=2, **sampling) -> Migration:
    params = pb.SamplingParams(max_tokens=10, **sampling)
    return Migration("req", list(PROMPT), params, max_migrations, _text)


# -- the pure part ---------------------------------------------------------


def test_resume_is_prompt_plus_sent_tokens_with_the_budget_reduced():
    m = _migration(temperature=0.0, seed=7, min_tokens=5, stop=["END"], top_k=3)
    for ids in ([100], [101, 102]):
        assert m.relay(_message(ids)) is not None
    resume = m.resume()
    assert resume.token_ids == PROMPT + [100, 101, 102]
    assert resume.request_id == "req-m1"
    assert resume.sampling.max_tokens == 7
    assert resume.sampling.min_tokens == 2
    # Everything else as the client asked.
    for name in ("temperature", "seed", "top_k"):
        assert getattr(resume.sampling, name) == getattr(m.sampling, name)
    assert list(resume.sampling.stop) == ["END"]
    assert m.sampling.max_tokens == 10  # the original is untouched
    assert m.resume().request_id == "req-m2"


def test_usage_counts_the_original_prompt_and_every_generated_token():
    m = _migration()
    m.relay(_message([100, 101, 102]))
    untouched = m.relay(_message([103], finish="stop", prompt=40, cached=32))
    assert untouched.usage.completion_tokens == 1  # no migration: the engine's own
    m = _migration()
    m.relay(_message([100, 101, 102]))
    m.resume()
    m.relay(_message([103]))
    final = m.relay(_message([104, 105], finish="length", prompt=43, cached=43))
    assert final.finish_reason == "length"  # the last pod's
    assert final.usage.prompt_tokens == 40
    assert final.usage.completion_tokens == 6
    assert final.usage.cached_tokens == 40  # at most the prompt


def test_a_stop_string_across_the_seam_ends_the_request():
    """The lost pod held back the text that could start a stop string ("t2 "
    with stop "t2 t3"): the router recovers it and catches the stop string
    that the new pod, which sees only its own text, cannot."""
    m = _migration(stop=["t2 t3"])
    first = _message([1, 2])
    first.text = "t1 "  # "t2 " held back: it may begin "t2 t3"
    m.relay(first)
    m.resume()
    assert m.relay(_message([3])) is None  # held: not enough text to decide
    out = m.relay(_message([4]))
    assert out.text == ""
    assert out.finish_reason == "stop"
    assert m.stopped
    assert m.sent_text == "t1 "


def test_held_back_text_is_released_when_no_stop_string_spans_the_seam():
    m = _migration(stop=["t2 t9"])
    first = _message([1, 2])
    first.text = "t1 "
    m.relay(first)
    m.resume()
    assert m.relay(_message([3])) is None
    out = m.relay(_message([4]))
    assert (out.text, out.finish_reason) == ("t2 t3 t4 ", "")
    assert list(out.token_ids) == [3, 4]  # the held message's token too
    assert m.relay(_message([5])).text == "t5 "  # seam passed: text flows as it comes
    assert m.sent_text == _text([1, 2, 3, 4, 5])


def test_the_final_message_releases_the_held_text():
    m = _migration(stop=["t2 t9"])
    first = _message([1, 2])
    first.text = "t1 "
    m.relay(first)
    m.resume()
    out = m.relay(_message([3], finish="stop", prompt=42))
    assert out.text == "t2 t3 "
    assert out.usage.completion_tokens == 3


def test_refusals():
    assert _migration(max_migrations=0).refusal(0.0, 10.0) == DISABLED
    m = _migration(max_migrations=1)
    assert m.refusal(0.0, 10.0) is None
    assert m.refusal(10.0, 10.0) == DEADLINE
    m.resume()
    assert m.refusal(0.0, 10.0) == LIMIT
    structured = _migration(structured=pb.StructuredOutput(json_object=True))
    assert structured.refusal(0.0, 10.0) == UNSUPPORTED


def test_a_request_lost_after_its_last_token_ends_as_length():
    m = _migration(stop=["zz"])
    sent = _message(list(range(100, 110)))
    sent.text = _text(range(100, 109)) + "t1"  # "09 " held back
    m.relay(sent)
    assert m.resume() is None
    final = m.exhausted()
    assert (final.text, final.finish_reason) == ("09 ", "length")
    assert final.usage.completion_tokens == 10
    assert final.usage.prompt_tokens == 40


def test_the_flag_defaults_on_and_refuses_negative_counts(capsys, monkeypatch):
    assert parse_settings(["--decode", "a:1"]).max_migrations == 2
    assert parse_settings(["--decode", "a:1", "--max-migrations", "0"]).max_migrations == 0
    monkeypatch.setenv("TANDEM_ROUTER_MAX_MIGRATIONS", "5")
    assert parse_settings(["--decode", "a:1"]).max_migrations == 5
    with pytest.raises(SystemExit):
        parse_settings(["--decode", "a:1", "--max-migrations", "-1"])
    assert "--max-migrations: must be 0 (off) or more" in capsys.readouterr().err


# -- the request path ------------------------------------------------------


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone")


class _Call:
    def __init__(self, messages, error=None, hang=False):
        self._messages, self._error, self._hang = messages, error, hang
        self.cancelled = False

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        for m in self._messages:
            yield m
        if self._hang:
            await asyncio.sleep(3600)
        if self._error:
            raise self._error

    def cancel(self):
        self.cancelled = True


class DecodeStub:
    """A decode engine that continues the prompt 1, 2, ... with token
    len(prompt)+1, ..., one message per token; with `die_after`, it fails
    (`code`) after that many tokens."""

    def __init__(self, die_after=None, code=grpc.StatusCode.UNAVAILABLE, hang=False):
        self.die_after, self.code, self.hang = die_after, code, hang
        self.requests: list[pb.GenerateRequest] = []
        self.calls: list[_Call] = []

    def Generate(self, req, **_):
        self.requests.append(req)
        start = len(req.token_ids) + 1
        budget = req.sampling_params.max_tokens
        count = budget if self.die_after is None else min(self.die_after, budget)
        messages = [_message([start + i]) for i in range(count)]
        if self.die_after is None:
            messages[-1] = _message([start + count - 1], "length", len(req.token_ids))
            messages[-1].usage.completion_tokens = count
        failing = self.die_after is not None and not self.hang
        call = _Call(messages, _error(self.code) if failing else None, self.hang)
        self.calls.append(call)
        return call


def _orchestrator(stubs, max_migrations=2, timeout_s=600.0):
    metrics = RouterMetrics()
    settings = RoutingSettings(
        block_size=16, policy=PolicySettings(policy="round-robin", remote_prefill_threshold=0)
    )
    core = RoutingCore(settings)
    pool = PodPool(core, poll_interval_s=60, shared_streams=False)
    for i, stub in enumerate(stubs):
        pod = pool.add_pod(PodSpec(f"127.0.0.1:{1000 + i}", "decode"))
        pod.stub = stub
        core.update_pod(pod.address, time.monotonic(), healthy=True)
    orchestrator = Orchestrator(
        pool,
        Replica(core, LocalState()),
        metrics,
        max_migrations=max_migrations,
        request_timeout_s=timeout_s,
        detokenize=_text,
    )
    return orchestrator, metrics


def _request(max_tokens=8) -> EngineRequest:
    return EngineRequest(
        request_id="r1",
        token_ids=list(PROMPT),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        cache_salt=None,
        arrival=time.perf_counter(),
    )


def _count(metrics: RouterMetrics, outcome: str) -> float:
    text = generate_latest(metrics.registry).decode()
    return metric_value(text, "tandem_router_migrations_total", f'outcome="{outcome}"')


async def _collect(orchestrator, req) -> list[pb.GenerateResponse]:
    return [m async for m in orchestrator.stream(req)]


async def test_a_lost_decode_pod_resumes_on_another_in_the_same_stream():
    doomed, healthy = DecodeStub(die_after=3), DecodeStub()
    orchestrator, metrics = _orchestrator([doomed, healthy])
    messages = await _collect(orchestrator, _request(max_tokens=8))
    # Exactly the tokens an undisturbed run gives, each once.
    assert [t for m in messages for t in m.token_ids] == list(range(41, 49))
    assert "".join(m.text for m in messages) == _text(range(41, 49))
    resumed = healthy.requests[0]
    assert list(resumed.token_ids) == PROMPT + [41, 42, 43]
    assert resumed.sampling_params.max_tokens == 5
    assert resumed.sampling_params.temperature == 0.0
    final = messages[-1]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (40, 8)
    assert _count(metrics, "resumed") == 1
    text = generate_latest(metrics.registry).decode()
    assert metric_value(text, "tandem_router_migrated_tokens_total") == 3


async def test_with_migration_off_the_stream_ends_in_the_pods_error():
    doomed, healthy = DecodeStub(die_after=3), DecodeStub()
    orchestrator, metrics = _orchestrator([doomed, healthy], max_migrations=0)
    seen = []
    with pytest.raises(OpenAIError) as failure:
        async for message in orchestrator.stream(_request()):
            seen.append(message)
    assert failure.value.status == 503
    assert len(seen) == 3
    assert healthy.requests == []
    assert _count(metrics, "disabled") == 1


async def test_at_most_max_migrations_per_request():
    stubs = [DecodeStub(die_after=1) for _ in range(4)]
    orchestrator, metrics = _orchestrator(stubs, max_migrations=2)
    seen = []
    with pytest.raises(OpenAIError):
        async for message in orchestrator.stream(_request()):
            seen.append(message)
    assert [t for m in seen for t in m.token_ids] == [41, 42, 43]
    assert sum(len(s.requests) for s in stubs) == 3
    assert (_count(metrics, "resumed"), _count(metrics, "refused_limit")) == (2, 1)


async def test_a_request_past_its_deadline_is_not_resumed():
    doomed, healthy = DecodeStub(die_after=2), DecodeStub()
    orchestrator, metrics = _orchestrator([doomed, healthy], timeout_s=0.0)
    with pytest.raises(OpenAIError):
        await _collect(orchestrator, _request())
    assert healthy.requests == []
    assert _count(metrics, "refused_deadline") == 1


async def test_an_engines_deliberate_error_is_not_migrated():
    doomed = DecodeStub(die_after=2, code=grpc.StatusCode.INTERNAL)
    healthy = DecodeStub()
    orchestrator, _ = _orchestrator([doomed, healthy])
    with pytest.raises(OpenAIError) as failure:
        await _collect(orchestrator, _request())
    assert failure.value.status == 502
    assert healthy.requests == []


async def test_no_pod_left_to_resume_on_is_counted_failed():
    orchestrator, metrics = _orchestrator([DecodeStub(die_after=2)])
    with pytest.raises(OpenAIError) as failure:
        await _collect(orchestrator, _request())
    assert failure.value.status == 503
    # The client saw its tokens stop: the error says its decode pod was lost.
    assert failure.value.message.startswith("decode pod 127.0.0.1:")
    assert "is unavailable" in failure.value.message
    assert "not resumed on another pod: no healthy decode" in failure.value.message
    assert _count(metrics, "failed") == 1


async def test_a_client_that_leaves_is_never_migrated():
    """The client's cancel aborts the engine call; nothing resumes."""
    busy, other = DecodeStub(die_after=2, hang=True), DecodeStub()
    orchestrator, metrics = _orchestrator([busy, other])
    seen = []

    async def consume():
        async for message in orchestrator.stream(_request()):
            seen.append(message)

    task = asyncio.ensure_future(consume())
    while len(seen) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert busy.calls[0].cancelled
    assert other.requests == []
    assert _count(metrics, "resumed") == 0
