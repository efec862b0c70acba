"""Faults: a client that leaves mid-stream, pods that are down or die, a
decode that fails after its prefill succeeded. Each frees what it held and
the stack keeps serving. Real engines; pod failures are real dead processes
or closed ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from common.ports import free_port
from common.procs import launch, stop_process_group, wait_grpc_serving
from common.proto import engine_pb2 as pb
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest, Orchestrator
from services.router.pods import PodPool
from services.router.routing import PodSpec, Replica, RoutingCore, RoutingSettings
from services.router.routing.shared_state import LocalState
from services.stack import engine_env
from tandem.workload.endpoint import sse_data
from tests.helpers import (
    LONG_CONTEXT,
    MODEL_NAME,
    chat,
    engine,
    engine_load,
    metric_value,
    wait_for,
)

pytestmark = pytest.mark.stack


def _idle(address: str) -> bool:
    load = engine_load(address)
    return load.in_flight == 0 and load.kv_cache_usage == 0.0


@contextmanager
def router_process(tmp_path, *pod_args: str):
    port = free_port()
    log = tmp_path / f"router-{port}.log"
    argv = [
        sys.executable,
        "-m",
        "services.router",
        "--port",
        str(port),
        "--poll-interval-s",
        "0.5",
        *pod_args,
    ]
    proc, popen = launch("router", argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_for(lambda: popen.poll() is None and _answers(url), timeout=120)
        assert ready, f"router did not start:\n{log.read_text()[-2000:]}"
        yield url
    finally:
        stop_process_group(proc, 10)
        popen.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/v1/models", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_client_disconnect_mid_stream_frees_kv_on_both_engines(stack):
    prefill, decode = engine(stack, "prefill").grpc, engine(stack, "decode").grpc
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": LONG_CONTEXT}],
    }
    chunks = 0
    with httpx.stream(
        "POST", f"{stack.router_url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while chunks < 4:
            chunks += sse_data(next(lines)) is not None
        # Mid-generation: the decode engine is busy with this request. (Checked
        # while `lines` is alive: a dropped line iterator closes the stream.)
        assert engine_load(decode).in_flight == 1
    # Leaving the `with` closed the connection mid-stream.
    assert wait_for(lambda: _idle(decode), timeout=30), engine_load(decode)
    assert wait_for(lambda: _idle(prefill), timeout=30), engine_load(prefill)
    text = httpx.get(f"{stack.router_url}/metrics", timeout=10).text
    assert metric_value(text, "tandem_router_client_disconnects_total") >= 1
    # Engines report their KV size and the router has it (eviction pricing).
    blocks = engine_load(decode).kv_capacity_blocks
    assert blocks > 0
    assert metric_value(text, "tandem_routing_pod_kv_capacity_blocks", f'pod="{decode}"') == blocks
    # And the stack still serves.
    assert chat(stack.router_url, MODEL_NAME, "Hi!", max_tokens=4).status_code == 200


def test_release_kv_frees_a_prefill_lease_early(stack):
    """KV a prefill keeps for a decode that never comes is freed through any
    decode engine, long before its lease (120 s here) expires."""
    import grpc

    from common.proto import engine_pb2_grpc as pb_grpc

    prefill, decode = engine(stack, "prefill").grpc, engine(stack, "decode").grpc
    tokens = list(range(1000, 1700))  # 700 tokens: five full blocks of 128
    with grpc.insecure_channel(prefill) as p_channel, grpc.insecure_channel(decode) as d_channel:
        reply = pb_grpc.EngineStub(p_channel).Prefill(
            pb.PrefillRequest(
                request_id=f"lease-{uuid.uuid4().hex}",
                token_ids=tokens,
                sampling_params=pb.SamplingParams(max_tokens=1),
                cache_salt=uuid.uuid4().hex,
            ),
            timeout=120,
        )
        params = json.loads(reply.kv_transfer_params_json)
        assert params["do_remote_prefill"] and params["remote_block_ids"]
        assert engine_load(prefill).kv_cache_usage > 0, "prefill holds no KV for the decode"
        started = time.monotonic()
        pb_grpc.EngineStub(d_channel).ReleaseKv(
            pb.ReleaseKvRequest(
                request_id="test-release", kv_transfer_params_json=reply.kv_transfer_params_json
            ),
            timeout=30,
        )
        assert wait_for(lambda: engine_load(prefill).kv_cache_usage == 0.0, timeout=20)
        assert time.monotonic() - started < 20


async def test_decode_failure_after_prefill_releases_kv(stack):
    """Prefill succeeds, the chosen decode pod is gone: the request fails with
    503 and the prefill's KV is released at once, not at lease expiry."""
    prefill, decode = engine(stack, "prefill").grpc, engine(stack, "decode").grpc
    metrics = RouterMetrics()
    core = RoutingCore(RoutingSettings())
    pool = PodPool(core, poll_interval_s=60)  # no poller: states set by hand
    dead = f"127.0.0.1:{free_port()}"
    for spec in (PodSpec(prefill, "prefill"), PodSpec(dead, "decode"), PodSpec(decode, "decode")):
        pool.add_pod(spec)
    await pool.poll_once()
    now = time.monotonic()
    core.update_pod(dead, now, healthy=True)  # the router believes it is up (it died after)
    core.set_draining(decode)  # takes no new work, but can still release KV
    orchestrator = Orchestrator(pool, Replica(core, LocalState()), metrics)
    request = EngineRequest(
        request_id=f"fail-{uuid.uuid4().hex}",
        token_ids=list(range(2000, 2700)),
        sampling=pb.SamplingParams(max_tokens=8),
        cache_salt=None,
        arrival=time.perf_counter(),
    )
    with pytest.raises(OpenAIError) as failure:
        async for _ in orchestrator.stream(request):
            pass
    assert failure.value.status == 503
    await orchestrator.drain_background()
    assert metric_value(_text(metrics), "tandem_router_kv_released_total") == 1
    deadline = time.monotonic() + 20
    while engine_load(prefill).kv_cache_usage != 0.0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert engine_load(prefill).kv_cache_usage == 0.0
    await pool.close()


def _text(metrics: RouterMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_no_healthy_decode_pod_is_503(stack, tmp_path):
    prefill = engine(stack, "prefill").grpc
    with router_process(
        tmp_path, "--prefill", prefill, "--decode", f"127.0.0.1:{free_port()}"
    ) as url:
        started = time.monotonic()
        response = chat(url, MODEL_NAME, "hello", max_tokens=4)
        assert response.status_code == 503
        assert "decode" in response.json()["error"]["message"]
        assert time.monotonic() - started < 10, "503 must be immediate, not a hang"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    assert engine_load(prefill).kv_cache_usage == 0.0  # nothing was prefilled for it


def test_dead_prefill_pod_falls_back_to_local_prefill(stack, tmp_path):
    decode = engine(stack, "decode").grpc
    with router_process(
        tmp_path, "--prefill", f"127.0.0.1:{free_port()}", "--decode", decode
    ) as url:
        fallback = chat(url, MODEL_NAME, "What is 2+2?", temperature=0, max_tokens=12)
        normal = chat(stack.router_url, MODEL_NAME, "What is 2+2?", temperature=0, max_tokens=12)
        assert fallback.status_code == 200, fallback.text
        assert (
            fallback.json()["choices"][0]["message"]["content"]
            == normal.json()["choices"][0]["message"]["content"]
        )
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert (
            metric_value(text, "tandem_router_local_prefill_total", 'reason="prefill_unavailable"')
            == 1
        )


def _content_events(lines, events: list[dict], until: int) -> None:
    """Read a chat stream's events into `events` until `until` carry tokens."""
    while sum(bool(_tokens(e)) for e in events) < until:
        data = sse_data(next(lines))
        if data is not None and data != "[DONE]":
            events.append(json.loads(data))


def _tokens(event: dict) -> list[str]:
    """The tokens of one chat chunk, from its logprobs."""
    for choice in event.get("choices", ()):
        return [t["token"] for t in (choice.get("logprobs") or {}).get("content") or ()]
    return []


def _rest(lines, events: list[dict], arrivals: list[tuple[float, int]] | None = None) -> list[str]:
    """Read the stream to its end; returns its raw data payloads after
    `events`. `arrivals`: (time, tokens so far) as each event came."""
    raw = []
    tokens = sum(len(_tokens(e)) for e in events)
    for line in lines:
        if (data := sse_data(line)) is None:
            continue
        raw.append(data)
        if data != "[DONE]":
            events.append(json.loads(data))
            tokens += len(_tokens(events[-1]))
            if arrivals is not None:
                arrivals.append((time.monotonic(), tokens))
    return raw


def _content(events: list[dict]) -> str:
    return "".join(c["delta"].get("content", "") for e in events for c in e["choices"])


def _finish(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def _on_doomed(streams: ExitStack, url: str, body: dict, doomed: str, busy: int):
    """A stream of `body` whose decode runs on the doomed pod (the routers
    take turns: round-robin), read to its first tokens; earlier tries, on the
    other pod, are closed."""
    for _ in range(8):
        response = streams.enter_context(
            httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120)
        )
        assert response.status_code == 200
        lines, events = response.iter_lines(), []
        _content_events(lines, events, 2)
        if engine_load(doomed).in_flight == busy:
            return lines, events
        response.close()
        time.sleep(0.5)
    raise AssertionError("no stream landed on the doomed decode pod")


def test_decode_pod_dying_mid_stream_resumes_on_another_pod(stack, tmp_path):
    """A decode engine killed mid-stream of a greedy request: the router
    resumes it on the other decode pod and the client's stream is token for
    token the undisturbed output, usage included. With --max-migrations 0
    the stream ends in an error event and [DONE] instead. Both routers keep
    serving; the rest of the stack is untouched."""
    prefill, decode = engine(stack, "prefill").grpc, engine(stack, "decode").grpc
    grpc_port, nixl_port = free_port(), free_port()
    log = tmp_path / "doomed-decode.log"
    argv = [
        sys.executable,
        "-m",
        "services.decode",
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(free_port()),
        "--nixl-port",
        str(nixl_port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "4096",
    ]
    doomed, popen = launch("doomed", argv, log, env=engine_env(1, None))
    doomed.grpc = f"127.0.0.1:{grpc_port}"
    pods = ("--prefill", prefill, "--decode", doomed.grpc, "--decode", decode)
    pods += ("--routing-policy", "round-robin")
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": 300,
        "logprobs": True,
        "messages": [{"role": "user", "content": "Count from 1 to 200, separated by commas."}],
    }
    try:
        wait_grpc_serving(doomed.grpc, doomed, time.monotonic() + 600)
        with (
            router_process(tmp_path, *pods) as on,
            router_process(tmp_path, *pods, "--max-migrations", "0") as off,
            ExitStack() as streams,
        ):
            on_lines, on_events = _on_doomed(streams, on, body, doomed.grpc, 1)
            off_lines, off_events = _on_doomed(streams, off, body, doomed.grpc, 2)
            os.killpg(popen.pid, signal.SIGKILL)
            killed, arrivals = time.monotonic(), []
            on_raw = _rest(on_lines, on_events, arrivals)
            off_raw = _rest(off_lines, off_events)

            # Undisturbed, on the surviving pods (its own cache salt: no KV reuse).
            reference: list[dict] = []
            with httpx.stream(
                "POST",
                f"{on}/v1/chat/completions",
                json={**body, "cache_salt": uuid.uuid4().hex},
                timeout=120,
            ) as response:
                _rest(response.iter_lines(), reference)
            expected = [t for e in reference for t in _tokens(e)]
            tokens = [t for e in on_events for t in _tokens(e)]
            assert on_raw[-1] == "[DONE]"
            assert not any("error" in e for e in on_events), on_events[-3:]
            assert tokens == expected, "output differs from the undisturbed run"
            assert _content(on_events) == _content(reference)
            assert _finish(on_events) == _finish(reference)
            for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert on_events[-1]["usage"][count] == reference[-1]["usage"][count], count
            metrics = httpx.get(f"{on}/metrics", timeout=10).text
            assert metric_value(metrics, "tandem_router_migrations_total", 'outcome="resumed"') == 1
            carried = metric_value(metrics, "tandem_router_migrated_tokens_total")
            assert 2 <= carried < len(expected)
            to_resume = metric_value(metrics, "tandem_router_migration_seconds_sum")
            next_token = next(t for t, n in arrivals if n > carried) - killed
            print(
                f"\nmigration: {carried:.0f} tokens resumed of {len(expected)}; "
                f"kill to next token {next_token:.2f} s (router: lost to next message "
                f"{to_resume:.2f} s); output identical: {tokens == expected}"
            )

            # Migration off: the old behaviour, an error event then [DONE].
            assert off_raw[-1] == "[DONE]"
            assert "error" in off_events[-1], off_events[-3:]
            metrics = httpx.get(f"{off}/metrics", timeout=10).text
            assert (
                metric_value(metrics, "tandem_router_migrations_total", 'outcome="disabled"') == 1
            )
            for url in (on, off):
                assert chat(url, MODEL_NAME, "hello", max_tokens=4).status_code == 200
    finally:
        stop_process_group(doomed, 5)
        popen.wait(timeout=10)
    assert chat(stack.router_url, MODEL_NAME, "Still there?", max_tokens=4).status_code == 200
