"""The router-overhead benchmark's pieces, without any router: statistics on
hand-built samples, the command lines it would run, and the fake backends'
protocols (the OpenAI SSE stream parses, the fake gRPC engine answers like
services/engine/servicer.py). The fakes run in-process on loopback; seconds."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from bench import router_overhead as ro
from bench import routers
from bench.router_fakes import (
    MODEL_NAME,
    TOKEN_TEXT,
    Timing,
    create_openai_app,
    sse_chunks,
    start_grpc_server,
)
from bench.routers import ROUTERS
from common.ports import free_port
from common.procs import ProcessError, Processes, wait_http_ok

FAST = Timing(first_token_ms=30.0, token_delay_ms=2.0, tokens=8)


def S(ttft_ms, e2e_ms, error=None):
    return ro.Sample(
        ttft=None if ttft_ms is None else ttft_ms / 1000,
        e2e=None if e2e_ms is None else e2e_ms / 1000,
        tokens=1,
        error=error,
    )


# -- statistics -----------------------------------------------------------------


def test_summarize_percentiles_over_successful_requests():
    samples = [S(10, 100), S(20, 200), S(30, 300), S(40, 400), S(None, None, error="HTTP 500")]
    s = ro.summarize(samples)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 4, 1)
    assert s["first_error"] == "HTTP 500"
    # linear interpolation, as numpy: p50 of [10, 20, 30, 40] = 25, p99 = 39.7
    assert s["ttft_p50_ms"] == pytest.approx(25.0)
    assert s["ttft_p99_ms"] == pytest.approx(39.7)
    assert s["e2e_p50_ms"] == pytest.approx(250.0)
    assert s["e2e_p99_ms"] == pytest.approx(397.0)


def test_summarize_without_successes_has_no_percentiles():
    s = ro.summarize([S(None, None, error="boom")])
    assert s["ok"] == 0 and s["ttft_p50_ms"] is None and s["e2e_p99_ms"] is None


def test_added_latency_is_router_minus_direct_per_percentile():
    routed = {"ttft_p50_ms": 25.0, "ttft_p99_ms": 40.0, "e2e_p50_ms": 110.0, "e2e_p99_ms": 130.0}
    direct = {"ttft_p50_ms": 21.0, "ttft_p99_ms": 30.0, "e2e_p50_ms": 100.0, "e2e_p99_ms": None}
    added = ro.added_latency(routed, direct)
    assert added == {
        "added_ttft_p50_ms": pytest.approx(4.0),
        "added_ttft_p99_ms": pytest.approx(10.0),
        "added_e2e_p50_ms": pytest.approx(10.0),
        "added_e2e_p99_ms": None,
    }


def test_rate_counts_only_the_window():
    finishes = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert ro.rate_in_window(finishes, 1.0, 3.0) == pytest.approx(4 / 2.0)
    assert ro.rate_in_window(finishes, 3.0, 3.0) == 0.0


def test_ratio_and_what_limited_the_rate():
    assert ro.ratio(2.0, 4.0) == pytest.approx(0.5)
    assert ro.ratio(1.0, 0.0) is None and ro.ratio(1.0, -0.2) is None
    assert ro.ratio(None, 1.0) is None
    assert ro.rate_limit(300, 97.0, 1000, 600) == "router CPU"
    assert ro.rate_limit(950, 40.0, 1000, 980) == "concurrency"
    assert ro.rate_limit(560, 40.0, 1000, 600) == "client/backend"
    assert ro.rate_limit(300, 40.0, 1000, 600, load_busy_pct=95.0) == "client/backend"
    assert (
        ro.rate_limit(300, 40.0, 1000, 600, load_busy_pct=50.0, router_core_busy_pct=99.0)
        == "core shared"
    )
    assert (
        ro.rate_limit(300, 40.0, 1000, 600, load_busy_pct=50.0, router_core_busy_pct=45.0)
        == "router latency"
    )


def test_table_and_ratios():
    rows = [
        {
            "router": "tandem",
            "policy": "round-robin",
            "added_ttft_p50_ms": 4.0,
            "added_ttft_p99_ms": 8.0,
            "added_e2e_p50_ms": 5.0,
            "added_e2e_p99_ms": 10.0,
            "max_rps": 200.0,
            "router_cpu_pct": 99.0,
            "router_core_busy_pct": 100.0,
            "load_cpu_busy_pct": 70.0,
            "limited_by": "router CPU",
            "rps_per_core": 202.0,
            "errors": 0,
        },
        {
            "router": "vllm-router",
            "policy": "round_robin",
            "added_ttft_p50_ms": 1.0,
            "added_ttft_p99_ms": 2.0,
            "added_e2e_p50_ms": 1.0,
            "added_e2e_p99_ms": None,
            "max_rps": 600.0,
            "router_cpu_pct": 30.0,
            "limited_by": "client/backend",
            "errors": 0,
        },
    ]
    table = ro.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith("| router | policy | added TTFT p50 ms")
    assert (
        "| tandem | round-robin | 4.00 | 8.00 | 5.00 | 10.00 | 200.0 | 99% / 100% / 70% "
        "| router CPU | 202 |"
    ) in table[2]
    # Not limited by the router: its maximum is only a lower bound.
    assert "| ≥ 600.0 | 30% / n/a / n/a |" in table[3]
    (line,) = ro.ratio_lines(rows)
    assert line.startswith("- vllm-router ÷ tandem: added TTFT p50 ×0.25")
    assert "added e2e p99 ×n/a" in line and "max req/s ≥×3.00" in line
    assert ro.ratio_lines(rows[1:]) == []


def test_stepped_tokens_of_requests_in_flight_are_due_together():
    # As an engine's step: tokens due within one step go out at its end.
    steps = Timing(first_token_ms=20.0, token_delay_ms=5.0, steps=True)
    boundary = steps.due(100.0, 0.0)
    a, b = boundary + 0.0001, boundary + 0.0032  # within one step of each other
    assert steps.due(a, 0.020) == steps.due(b, 0.020) == pytest.approx(boundary + 0.025)
    for arrival in (a, b):
        due = steps.due(arrival, 0.020)
        assert arrival + 0.020 <= due < arrival + 0.025 + 1e-9
    assert Timing(first_token_ms=20.0, token_delay_ms=5.0).due(a, 0.020) == a + 0.020


def test_parse_sse_line():
    assert ro.parse_sse_line(b"data: [DONE]\n") == (True, 0)
    assert ro.parse_sse_line(b"\n") == (False, 0)
    assert ro.parse_sse_line(b'data: {"choices":[{"delta":{"content":" a"}}]}\n') == (False, 1)
    assert ro.parse_sse_line(
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n'
    ) == (False, 0)
    assert ro.parse_sse_line(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n') == (
        False,
        0,
    )
    with pytest.raises(RuntimeError, match="error event"):
        ro.parse_sse_line(b'data: {"error":{"message":"no pod"}}\n')


# -- command lines --------------------------------------------------------------


def test_router_commands_use_round_robin(monkeypatch):
    monkeypatch.setattr(routers, "find_binary", lambda spec: f"/bin/{spec.binary}")
    tandem = ro.router_argv(ROUTERS["tandem"], 9000, "127.0.0.1:9001", "/m")
    assert tandem[1:3] == ["-m", "services.router"]
    assert tandem[tandem.index("--routing-policy") + 1] == "round-robin"
    assert tandem[tandem.index("--engine") + 1] == "127.0.0.1:9001"
    assert tandem[tandem.index("--model") + 1] == "/m"
    for name, first in (
        ("vllm-router", ["/bin/vllm-router"]),
        ("sglang-router", ["/bin/sglang-router", "launch"]),
        ("smg", ["/bin/smg", "launch"]),
    ):
        argv = ro.router_argv(ROUTERS[name], 9000, "http://127.0.0.1:9001", "/m")
        assert argv[: len(first)] == first
        assert argv[argv.index("--policy") + 1] == "round_robin"
        assert argv[argv.index("--worker-urls") + 1] == "http://127.0.0.1:9001"
        assert argv[argv.index("--port") + 1] == "9000"


def test_base_router_runs_from_its_own_tree(tmp_path):
    argv = ro.router_argv(ROUTERS["tandem-base"], 9000, "127.0.0.1:9001", "/m", str(tmp_path))
    assert argv[:4] == ["sh", "-c", 'cd "$0" && exec "$@"', str(tmp_path)]
    assert argv[5:7] == ["-m", "services.router"]
    with pytest.raises(ProcessError, match="--base-src"):
        ro.router_argv(ROUTERS["tandem-base"], 9000, "127.0.0.1:9001", "/m")


def test_rate_per_router_core():
    assert ro.per_core(300.0, 40.0) == pytest.approx(750.0)
    assert ro.per_core(300.0, None) is None and ro.per_core(300.0, 0.0) is None


def test_agent_variants_turn_features_on_in_the_router_and_the_requests():
    tools = ro.router_argv(ROUTERS["tandem-tools"], 9000, "127.0.0.1:9001", "/m")
    assert tools[tools.index("--tool-call-parser") + 1] == "hermes"
    assert "--chat-template" in tools
    body = json.loads(ro.chat_body(8, ROUTERS["tandem-tools"].request_fields))
    assert body["tool_choice"] == "auto" and len(body["tools"]) == 2
    body = json.loads(ro.chat_body(8, ROUTERS["tandem-structured"].request_fields))
    assert body["response_format"]["type"] == "json_schema"
    assert "tools" not in json.loads(ro.chat_body(8))


def test_missing_router_names_its_pip_package(monkeypatch):
    monkeypatch.setattr(routers.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SystemExit, match=r"pip install sglang-router==0\.3\.2"):
        routers.find_binary(ROUTERS["sglang-router"])
    with pytest.raises(SystemExit, match=r"venv-smg/bin/pip install smg==1\.13\.0"):
        routers.find_binary(ROUTERS["smg"])


def test_router_in_its_own_venv_is_found(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / ".tandem" / "venv-smg" / "bin" / "smg"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(routers.sys, "executable", "/nonexistent/python")
    assert routers.find_binary(ROUTERS["smg"]) == str(script)


def test_config_checks_routers_and_cpus():
    args = ro.build_parser().parse_args(
        ["--routers", "tandem", "--load-cpus", "0", "--router-cpu", "0"]
    )
    config = ro.config_from_args(args)
    assert config.routers == ["tandem"] and config.router_cpu == 0 and config.load_cpus == [0]
    with pytest.raises(SystemExit, match="unknown"):
        ro.config_from_args(ro.build_parser().parse_args(["--routers", "tandem,nginx"]))
    with pytest.raises(SystemExit, match="--base-src"):
        ro.config_from_args(ro.build_parser().parse_args(["--routers", "tandem,tandem-base"]))


# -- drivers, on a stand-in target -----------------------------------------------


class FixedTarget:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    async def one(self) -> ro.Sample:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return ro.Sample(ttft=self.delay_s / 2, e2e=self.delay_s, tokens=1)


async def test_latency_phase_runs_both_paths_equally():
    routed, direct = FixedTarget(0.002), FixedTarget(0.001)
    r, d = await ro.latency_phase(routed, direct, requests=12, concurrency=3, warmup=2)
    assert len(r) == len(d) == 12
    assert routed.calls == direct.calls == 14


class CountingTarget(FixedTarget):
    """Records the most requests in flight at once."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.in_flight = self.most_in_flight = 0

    async def one(self) -> ro.Sample:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().one()
        finally:
            self.in_flight -= 1


async def test_latency_phase_open_loop_does_not_wait_for_answers():
    # 2,000 arrivals a second against 50 ms answers: ~100 in flight at once,
    # where a closed loop would hold its concurrency (1 here)
    routed, direct = CountingTarget(0.05), CountingTarget(0.05)
    r, d = await ro.latency_phase(
        routed, direct, requests=100, concurrency=1, warmup=0, arrival_rate=2000
    )
    assert len(r) == len(d) == 100
    assert routed.most_in_flight > 5 and direct.most_in_flight > 5
    assert routed.in_flight == direct.in_flight == 0


def test_arrival_rate_in_config_and_report_text():
    args = ro.build_parser().parse_args(["--routers", "tandem", "--arrival-rate", "80"])
    config = ro.config_from_args(args)
    assert config.arrival_rate == 80
    assert ro.latency_load(80, 4) == ("at random times, 80 a second over both paths")
    assert ro.latency_load(0, 4) == "at concurrency 4"
    with pytest.raises(SystemExit, match="--arrival-rate"):
        ro.config_from_args(ro.build_parser().parse_args(["--arrival-rate", "-1"]))


async def test_closed_loop_rate_and_cpu_window():
    ticks = iter([{"router": 10.0}, {"router": 10.05}])
    result = await ro.closed_loop(
        FixedTarget(0.01),
        concurrency=4,
        warmup_s=0.05,
        duration_s=0.2,
        cpu_seconds=lambda: next(ticks),
    )
    # 4 workers × 1 request per 10 ms: at most ~400 req/s, less on a busy machine
    assert 40 < result["rps"] <= 420
    assert result["errors"] == 0 and result["completed"] > 0
    assert 10 < result["cpu_pct"]["router"] < 60  # 0.05 s of CPU over a ~0.2 s window


# -- fake OpenAI server ---------------------------------------------------------


def test_sse_chunks_shape():
    chunks = sse_chunks("chatcmpl-1", "chat", 3, prompt_tokens=5, include_usage=True)
    # role, 3 tokens, usage, [DONE]
    assert len(chunks) == 6 and chunks[-1] == b"data: [DONE]\n\n"
    events = [json.loads(c[6:]) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in events[1:4]] == [TOKEN_TEXT] * 3
    assert [e["choices"][0]["finish_reason"] for e in events[1:4]] == [None, None, "length"]
    assert events[4]["usage"]["completion_tokens"] == 3 and events[4]["choices"] == []
    assert all(e["model"] == MODEL_NAME for e in events)


@pytest.fixture
async def openai_url():
    from aiohttp import web

    runner = web.AppRunner(create_openai_app(FAST))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_fake_openai_stream_has_fixed_timing(openai_url):
    target = ro.HttpTarget(openai_url, tokens=5)
    await target.open()
    try:
        samples = [await target.one() for _ in range(3)]
    finally:
        await target.close()
    for s in samples:
        assert s.ok, s.error
        assert s.tokens == 5
        assert s.ttft >= 0.030 and s.e2e >= 0.030 + 4 * 0.002
        assert s.e2e < 1.0


async def test_fake_openai_endpoints(openai_url):
    import httpx

    async with httpx.AsyncClient(base_url=openai_url) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL_NAME
        assert (await client.get("/get_model_info")).json()["is_generation"] is True
        whole = (
            await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                },
            )
        ).json()
        assert whole["choices"][0]["message"]["content"] == TOKEN_TEXT * 3
        assert whole["usage"]["completion_tokens"] == 3
        completion = (
            await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        ).text
        # no max_tokens: the server's default count; no role chunk for completions
        assert completion.count('"text":" tok"') == FAST.tokens
        assert completion.endswith("data: [DONE]\n\n")
        assert (await client.get("/nope")).status_code == 404
        paths = (await client.get("/_fake/paths")).json()
    assert paths["GET /health"] == 1 and paths["GET /nope"] == 1
    assert paths["POST /v1/chat/completions"] == 1


# -- fake gRPC engine -----------------------------------------------------------


async def test_fake_grpc_engine_answers_like_the_engine():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.proto import engine_pb2 as pb
    from common.proto import engine_pb2_grpc as pb_grpc

    server = await start_grpc_server("127.0.0.1", 0, FAST, model_path="/models/smol")
    address = f"127.0.0.1:{server.bound_port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.EngineStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert (info.served_model_name, info.model_path, info.block_size, info.role) == (
                MODEL_NAME,
                "/models/smol",
                128,
                "both",
            )
            assert info.max_model_len > 0
            load = await stub.GetLoad(pb.GetLoadRequest(), timeout=5)
            assert load.in_flight == 0 and not load.draining

            start = time.perf_counter()
            messages = [
                m
                async for m in stub.Generate(
                    pb.GenerateRequest(
                        request_id="r1",
                        token_ids=[1, 2, 3],
                        sampling_params=pb.SamplingParams(max_tokens=4),
                    ),
                    timeout=5,
                )
            ]
            elapsed = time.perf_counter() - start
            assert [m.text for m in messages] == [TOKEN_TEXT] * 4
            assert [m.finish_reason for m in messages] == ["", "", "", "length"]
            assert messages[-1].usage.prompt_tokens == 3
            assert messages[-1].usage.completion_tokens == 4
            assert elapsed >= 0.030 + 3 * 0.002

            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(pb.GenerateRequest(request_id="r2"), timeout=5):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        target = ro.GrpcTarget(address, tokens=6)
        await target.open()
        try:
            sample = await target.one()
        finally:
            await target.close()
        assert sample.ok, sample.error
        assert sample.tokens == 6 and sample.ttft >= 0.030
    finally:
        await server.stop(grace=None)


# -- the real Tandem router in front of the fake engine ----------------------------


@pytest.mark.timeout(120)
async def test_tandem_router_serves_through_the_fake_engine(tmp_path):
    """The fake engine is enough for the real router: it starts, polls it
    healthy and streams every token (a few requests; the router's start-up,
    mostly importing transformers, is most of the time)."""
    from common.model import resolve_model

    server = await start_grpc_server("127.0.0.1", 0, FAST)
    procs = Processes(tmp_path)
    try:
        port = free_port()
        argv = ro.router_argv(
            ROUTERS["tandem"], port, f"127.0.0.1:{server.bound_port}", str(resolve_model(None))
        )
        proc, _ = procs.launch("tandem", argv, os.sched_getaffinity(0))
        url = f"http://127.0.0.1:{port}"
        # Blocking wait off the loop: the fake engine answers on this loop.
        await asyncio.to_thread(wait_http_ok, f"{url}/health", proc, time.monotonic() + 90)
        target = ro.HttpTarget(url, tokens=5)
        await target.open()
        try:
            await ro.wait_serving(target, time.monotonic() + 30, proc)
            samples = await asyncio.gather(*(target.one() for _ in range(8)))
        finally:
            await target.close()
        assert all(s.ok for s in samples), [s.error for s in samples]
        assert all(s.tokens == 5 and s.ttft >= 0.030 for s in samples)
    finally:
        await asyncio.to_thread(procs.stop_all)
        await server.stop(grace=None)
