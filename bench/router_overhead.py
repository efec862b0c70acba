"""The router's own overhead: Tandem's router and the Rust routers, side by side.

Every router sits in front of a fake backend with a fixed, configurable
latency (bench/router_fakes.py): the Tandem router in front of a fake gRPC
engine (``tandem.engine.v1.Engine``), vllm-router and sglang-router in front
of a fake OpenAI HTTP server. Both fakes send token *i* at ``first_token_ms +
i * token_delay_ms`` after the request arrives, so whatever a router adds is
its own cost. Two measurements per router, in one run:

* **Added latency** at low concurrency: streaming chat completions through the
  router, interleaved with the same requests sent straight to its backend (the
  direct path: HTTP for the HTTP routers, gRPC Generate for Tandem's). Added
  TTFT and end-to-end p50/p99 = percentile through the router minus the same
  percentile direct. A closed loop by default (``--concurrency`` clients, each
  sending its next request when the last one ends); ``--arrival-rate`` sends
  them at random times instead (an open loop, Poisson arrivals). Under
  ``--engine-steps`` a closed loop's requests end together at a step and the
  next arrive together, so a router's delay costs nothing until a request
  misses its step, then a whole step; random arrivals show the delay itself.
* **Max request rate on one core**: a closed loop at high concurrency for
  ``--duration`` seconds with the router pinned to one CPU (sched_setaffinity)
  and the backend and the client on the others. Requests per second completed,
  with the router's CPU use over the window (near 100% = the router is the
  limit). The same loop straight to each backend gives the ceiling of the
  client and backend themselves: a router at that ceiling is faster than this
  set-up can show.

Every router runs its simplest policy (round robin). The Tandem router does
more per request than the HTTP routers (chat template, tokenization, gRPC,
SSE re-encoding), which is part of what is measured.

    python -m bench.router_overhead                         # all three routers
    python -m bench.router_overhead --routers tandem --requests 50 --duration 5
    python -m bench.router_overhead --routers tandem,tandem-tools,tandem-structured
        # what tool parsing (hermes, tool_choice auto) and structured output cost

Results: a Markdown table and ratios on stdout, JSON in
bench/results/router_overhead.json, process logs in
bench/results/router_overhead_logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orjson import loads as _loads

from bench import router_fakes
from bench.harness import cpu_busy_seconds, sigterm_as_interrupt
from bench.router_fakes import MODEL_NAME
from bench.routers import HOST, ROUTERS, RouterSpec, find_binary, http_router_argv, in_dir
from common.ports import free_port
from common.procs import (
    Proc,
    ProcessError,
    Processes,
    group_cpu_seconds,
    raise_if_exited,
    wait_grpc_serving,
    wait_http_ok,
)
from tandem.workload.endpoint import is_done, output_deltas, sse_data
from tandem.workload.metrics import percentile

PROMPT = "Say hello in one short sentence."
DIRECT_HTTP = "direct-http"
DIRECT_GRPC = "direct-grpc"


# -- routers ------------------------------------------------------------------


def router_argv(
    spec: RouterSpec, port: int, backend: str, model_dir: str, base_src: str | None = None
) -> list[str]:
    """The command that starts `spec` on `port` in front of `backend` (a gRPC
    host:port for Tandem, an http:// URL for the others), with logging at
    warning level and nothing but round robin; ``tandem-base`` from the
    source tree `base_src`."""
    if spec.name == "tandem-base":
        if not base_src:
            raise ProcessError("tandem-base needs --base-src")
        argv = router_argv(ROUTERS["tandem"], port, backend, model_dir)
        return in_dir(argv, str(Path(base_src).resolve()))
    if spec.backend == "grpc":  # Tandem's router, plain or with agent features on
        return [
            sys.executable,
            "-m",
            "services.router",
            "--host",
            HOST,
            "--port",
            str(port),
            "--engine",
            backend,
            "--model",
            model_dir,
            "--routing-policy",
            spec.policy,
            # No admission limit: the HTTP routers run without one too.
            "--max-concurrent-requests",
            "0",
            "--shutdown-grace-s",
            "1",
            *spec.router_args,
        ]
    argv = http_router_argv(spec, port, [backend], spec.policy)
    if spec.name in ("sglang-router", "smg"):
        argv += ["--shutdown-grace-period-secs", "1"]
    return argv


# -- statistics ---------------------------------------------------------------


@dataclass
class Sample:
    """One request: seconds from send to the first content token and to the end."""

    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """TTFT and end-to-end p50/p99 in milliseconds over successful requests."""
    good = [s for s in samples if s.ok]
    out: dict[str, Any] = {
        "requests": len(samples),
        "ok": len(good),
        "errors": len(samples) - len(good),
    }
    for key in ("ttft", "e2e"):
        values = [getattr(s, key) * 1000.0 for s in good]
        for q in (50, 99):
            out[f"{key}_p{q}_ms"] = percentile(values, q)
    first_error = next((s.error for s in samples if s.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


def added_latency(routed: dict[str, Any], direct: dict[str, Any]) -> dict[str, float | None]:
    """What the router adds: each percentile through it minus the same
    percentile straight to the backend (ms)."""
    out: dict[str, float | None] = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
        a, b = routed.get(key), direct.get(key)
        out[f"added_{key}"] = None if a is None or b is None else a - b
    return out


def rate_in_window(finish_times: list[float], start: float, end: float) -> float:
    """Requests per second that finished within [start, end)."""
    if end <= start:
        return 0.0
    return sum(1 for t in finish_times if start <= t < end) / (end - start)


# A router using at least this share of its one core is what limits the rate.
ROUTER_BOUND_CPU_PCT = 85.0


NOT_ROUTER_LIMITS = ("concurrency", "client/backend", "core shared")


BUSY_PCT = 90.0


def rate_limit(
    rps: float,
    router_cpu_pct: float | None,
    ideal_rps: float,
    direct_rps: float | None,
    load_busy_pct: float | None = None,
    router_core_busy_pct: float | None = None,
) -> str:
    """What capped a closed-loop rate through a router, first match:

    * "router CPU": the router kept its one core at least 85% busy;
    * "concurrency": the loop reached concurrency ÷ backend latency;
    * "client/backend": a load CPU (fake backend, client) was at least 90%
      busy, or the rate is within 10% of the same loop without a router;
    * "core shared": the router's core was at least 90% busy, but not with
      the router (another process ran there: a busy machine);
    * "router latency": none of these — the router's latency under load held
      the closed loop back without filling its core.
    """
    if router_cpu_pct is not None and router_cpu_pct >= ROUTER_BOUND_CPU_PCT:
        return "router CPU"
    if ideal_rps > 0 and rps >= 0.9 * ideal_rps:
        return "concurrency"
    if (load_busy_pct is not None and load_busy_pct >= BUSY_PCT) or (
        direct_rps and rps >= 0.9 * direct_rps
    ):
        return "client/backend"
    if router_core_busy_pct is not None and router_core_busy_pct >= BUSY_PCT:
        return "core shared"
    return "router latency"


def per_core(rps: float, router_cpu_pct: float | None) -> float | None:
    """Requests per second one core of the router serves: the rate ÷ the
    share of a core the router used for it. On a machine too small for the
    client and backend to saturate the router, this is what its CPU cost per
    request allows (a router's rate at saturation may differ: batching helps,
    a full run queue hurts)."""
    if not router_cpu_pct or router_cpu_pct <= 0:
        return None
    return rps * 100.0 / router_cpu_pct


def ratio(value: float | None, base: float | None) -> float | None:
    """value ÷ base; None when either is missing or base is not positive
    (an added latency at or below zero has no meaningful ratio)."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| router | policy | added TTFT p50 ms | added TTFT p99 ms | added e2e p50 ms "
        "| added e2e p99 ms | max req/s (1 core) | CPU at max: router / its core / load "
        "| limited by | req/s per router core | errors |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        cpu = " / ".join(
            _pct(r.get(k)) for k in ("router_cpu_pct", "router_core_busy_pct", "load_cpu_busy_pct")
        )
        # Not limited by the router: its own maximum is at least this.
        at_least = "≥ " if r.get("limited_by") in NOT_ROUTER_LIMITS else ""
        lines.append(
            f"| {r['router']} | {r['policy']} | {_fmt(r.get('added_ttft_p50_ms'))} "
            f"| {_fmt(r.get('added_ttft_p99_ms'))} | {_fmt(r.get('added_e2e_p50_ms'))} "
            f"| {_fmt(r.get('added_e2e_p99_ms'))} | {at_least}{_fmt(r.get('max_rps'), 1)} "
            f"| {cpu} | {r.get('limited_by', 'n/a')} "
            f"| {_fmt(r.get('rps_per_core'), 0)} | {r.get('errors', 0)} |"
        )
    return "\n".join(lines)


def absolute_table(paths: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| path | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | requests |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in paths.items():
        lines.append(
            f"| {name} | {_fmt(s.get('ttft_p50_ms'))} | {_fmt(s.get('ttft_p99_ms'))} "
            f"| {_fmt(s.get('e2e_p50_ms'))} | {_fmt(s.get('e2e_p99_ms'))} "
            f"| {s.get('ok', 0)}/{s.get('requests', 0)} |"
        )
    return "\n".join(lines)


def ratio_lines(rows: list[dict[str, Any]], baseline: str = "tandem") -> list[str]:
    """One line per other router: its figures ÷ the baseline's."""
    base = next((r for r in rows if r["router"] == baseline), None)
    if base is None:
        return []
    lines = []
    for r in rows:
        if r is base:
            continue
        parts = [
            f"{label} ×{_fmt(ratio(r.get(key), base.get(key)))}"
            for label, key in (
                ("added TTFT p50", "added_ttft_p50_ms"),
                ("added TTFT p99", "added_ttft_p99_ms"),
                ("added e2e p50", "added_e2e_p50_ms"),
                ("added e2e p99", "added_e2e_p99_ms"),
                ("req/s per router core", "rps_per_core"),
            )
        ]
        # A rate the router did not limit is a lower bound, and so is its ratio.
        r_lower = r.get("limited_by") in NOT_ROUTER_LIMITS
        b_lower = base.get("limited_by") in NOT_ROUTER_LIMITS
        bound = {(True, False): "≥", (False, True): "≤"}.get((r_lower, b_lower), "")
        rps = f"max req/s {bound}×{_fmt(ratio(r.get('max_rps'), base.get('max_rps')))}"
        if r_lower and b_lower:
            rps += " (neither router was the limit)"
        lines.append(f"- {r['router']} ÷ {baseline}: " + ", ".join(parts + [rps]))
    return lines


# -- clients ------------------------------------------------------------------


def chat_body(tokens: int, fields: dict | None = None) -> bytes:
    return json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(fields or {}),
        }
    ).encode()


def latency_load(arrival_rate: float, concurrency: int) -> str:
    """How the latency test sent its requests, for the report."""
    if arrival_rate > 0:
        return f"at random times, {arrival_rate:g} a second over both paths"
    return f"at concurrency {concurrency}"


def parse_sse_line(line: bytes) -> tuple[bool, int]:
    """(is [DONE], output tokens in this line) for one line of an SSE stream."""
    data = sse_data(line)
    if data is None:
        return False, 0
    if is_done(data):
        return True, 0
    chunk = _loads(data)
    if "error" in chunk:
        raise RuntimeError(f"error event: {str(chunk['error'])[:200]}")
    return False, output_deltas(chunk)


class HttpTarget:
    """Streaming chat completions over one aiohttp session (keep-alive)."""

    def __init__(self, url: str, tokens: int, fields: dict | None = None) -> None:
        self.url = f"{url}/v1/chat/completions"
        self.tokens = tokens
        self.body = chat_body(tokens, fields)
        self._session = None

    async def open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=120),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def one(self) -> Sample:
        from time import perf_counter

        start = perf_counter()
        sample = Sample()
        try:
            async with self._session.post(
                self.url, data=self.body, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status != 200:
                    sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return sample
                async for line in resp.content:
                    done, n = parse_sse_line(line)
                    if n:
                        if sample.ttft is None:
                            sample.ttft = perf_counter() - start
                        sample.tokens += n
                    if done:
                        sample.e2e = perf_counter() - start
                # Read to the end so the connection goes back to the pool.
        except Exception as exc:  # a benchmark records failures, it does not stop
            sample.error = f"{type(exc).__name__}: {exc}"[:300]
        return _check(sample, self.tokens)


class GrpcTarget:
    """Generate straight to the fake engine: the Tandem router's direct path."""

    def __init__(self, address: str, tokens: int, prompt_tokens: int = 16) -> None:
        self.address = address
        self.tokens = tokens
        self.prompt_ids = list(range(1, prompt_tokens + 1))
        self._channel = None
        self._stub = None

    async def open(self) -> None:
        import grpc

        from common.proto import engine_pb2_grpc as pb_grpc

        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = pb_grpc.EngineStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def one(self) -> Sample:
        from time import perf_counter

        from common.proto import engine_pb2 as pb

        start = perf_counter()
        sample = Sample()
        request = pb.GenerateRequest(
            request_id=uuid.uuid4().hex,
            token_ids=self.prompt_ids,
            sampling_params=pb.SamplingParams(max_tokens=self.tokens, ignore_eos=True),
        )
        try:
            async for message in self._stub.Generate(request, timeout=120):
                if message.text:
                    if sample.ttft is None:
                        sample.ttft = perf_counter() - start
                    sample.tokens += len(message.token_ids)
            sample.e2e = perf_counter() - start
        except Exception as exc:
            sample.error = f"{type(exc).__name__}: {exc}"[:300]
        return _check(sample, self.tokens)


def _check(sample: Sample, tokens: int) -> Sample:
    if sample.error is None:
        if sample.e2e is None:
            sample.error = "stream ended without [DONE]"
        elif sample.tokens != tokens:
            sample.error = f"got {sample.tokens} content tokens, expected {tokens}"
    return sample


def make_target(kind: str, address: str, tokens: int, fields: dict | None = None):
    """``fields``: added to each chat request (the HTTP targets)."""
    return GrpcTarget(address, tokens) if kind == "grpc" else HttpTarget(address, tokens, fields)


async def wait_serving(target, deadline: float, proc: Proc | None = None) -> None:
    """Send requests until one succeeds (a router may report ready a moment
    before it can route)."""
    last = None
    while time.monotonic() < deadline:
        if proc is not None:
            raise_if_exited(proc)
        sample = await target.one()
        if sample.ok:
            return
        last = sample.error
        await asyncio.sleep(0.3)
    raise ProcessError(f"no successful request before the deadline; last error: {last}")


async def latency_phase(
    routed, direct, requests: int, concurrency: int, warmup: int, arrival_rate: float = 0.0
) -> tuple[list[Sample], list[Sample]]:
    """`requests` through the router and as many direct, interleaved (routed,
    direct, routed, ...) so both paths see the same machine at the same time:
    served by `concurrency` workers, or, with `arrival_rate` (requests a
    second, both paths together), each started at Poisson arrival times."""
    for _ in range(warmup):
        await routed.one()
        await direct.one()
    jobs: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        jobs.put_nowait("routed")
        jobs.put_nowait("direct")
    out: dict[str, list[Sample]] = {"routed": [], "direct": []}

    async def send(path: str) -> None:
        target = routed if path == "routed" else direct
        out[path].append(await target.one())

    if arrival_rate > 0:
        gaps = random.Random(0)  # the same arrival times for every router
        started = []
        while not jobs.empty():
            started.append(asyncio.ensure_future(send(jobs.get_nowait())))
            await asyncio.sleep(gaps.expovariate(arrival_rate))
        await asyncio.gather(*started)
        return out["routed"], out["direct"]

    async def worker() -> None:
        while True:
            try:
                path = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            await send(path)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return out["routed"], out["direct"]


async def closed_loop(
    target, concurrency: int, warmup_s: float, duration_s: float, cpu_seconds=None
) -> dict[str, Any]:
    """`concurrency` workers back to back for warmup + duration seconds; the
    rate counts requests finished in the window after the warm-up.
    `cpu_seconds()`, when given, returns CPU-second counters ({name: seconds})
    and is read at the window's start and end: the result's `cpu_pct` has each
    counter's growth over the window in percent of one core."""
    loop = asyncio.get_running_loop()
    loop_start = time.perf_counter()
    start, end = loop_start + warmup_s, loop_start + warmup_s + duration_s
    finished: list[float] = []
    errors: list[str] = []
    in_window: list[Sample] = []
    cpu: list[tuple[float, dict[str, float]]] = []
    if cpu_seconds is not None:

        def read_cpu() -> None:
            cpu.append((time.perf_counter(), cpu_seconds()))

        loop.call_later(warmup_s, read_cpu)
        loop.call_later(warmup_s + duration_s, read_cpu)

    async def worker() -> None:
        while time.perf_counter() < end:
            sample = await target.one()
            now = time.perf_counter()
            if sample.ok:
                finished.append(now)
                if start <= now < end:
                    in_window.append(sample)
            elif start <= now < end:
                errors.append(sample.error or "?")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu_pct = None
    if len(cpu) == 2:
        (t0, c0), (t1, c1) = cpu
        cpu_pct = {k: 100.0 * (c1[k] - c0[k]) / max(t1 - t0, 1e-9) for k in c0 if k in c1}
    return {
        "rps": rate_in_window(finished, start, end),
        "completed": len(in_window),
        "cpu_pct": cpu_pct,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "window_s": duration_s,
        **{k: v for k, v in summarize(in_window).items() if k.endswith("_ms")},
    }


def _rate_worker(spec_json: str) -> int:
    """Subprocess entry of the rate test: one closed loop, its result as JSON
    on stdout."""
    spec = json.loads(spec_json)

    async def run() -> dict:
        target = make_target(spec["kind"], spec["address"], spec["tokens"], spec["fields"])
        pgid, cpus = spec.get("cpu_pgid"), spec.get("watch_cpus") or []

        def counters() -> dict[str, float]:
            out = {f"cpu{n}": busy for n, busy in cpu_busy_seconds(cpus).items()}
            if pgid is not None:
                out["router"] = group_cpu_seconds(pgid)
            return out

        await target.open()
        try:
            return await closed_loop(
                target,
                spec["concurrency"],
                spec["warmup_s"],
                spec["duration_s"],
                cpu_seconds=counters,
            )
        finally:
            await target.close()

    print(json.dumps(asyncio.run(run())))
    return 0


# -- the run ------------------------------------------------------------------


@dataclass
class Config:
    routers: list[str]
    requests: int = 500
    concurrency: int = 4
    arrival_rate: float = 0.0  # latency test: Poisson arrivals a second; 0 = closed loop
    rate_concurrency: int = 128
    duration_s: float = 15.0
    warmup_s: float = 2.0
    tokens: int = 16
    first_token_ms: float = 20.0
    token_delay_ms: float = 5.0
    engine_steps: bool = False
    router_cpu: int = 0
    load_cpus: list[int] = field(default_factory=list)
    client_procs: int = 1
    startup_timeout_s: float = 120.0
    out: Path = Path("bench/results/router_overhead.json")
    base_src: str | None = None  # source tree of the "tandem-base" router

    @property
    def ideal_e2e_ms(self) -> float:
        return self.first_token_ms + (self.tokens - 1) * self.token_delay_ms


class Bench:
    def __init__(self, config: Config) -> None:
        self.c = config
        self.log_dir = config.out.parent / "router_overhead_logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = Processes(self.log_dir)
        self.load_cpus = set(config.load_cpus)
        self.backends: dict[str, str] = {}  # kind -> address
        self.backend_procs: dict[str, Proc] = {}
        from common.model import resolve_model

        self.model_dir = str(resolve_model(None))

    def _deadline(self) -> float:
        return time.monotonic() + self.c.startup_timeout_s

    def start_backend(self, kind: str) -> str:
        c = self.c
        port = free_port()
        argv = router_fakes.command(
            "openai" if kind == "http" else kind,
            HOST,
            str(port),
            self.model_dir,
            "--first-token-ms",
            str(c.first_token_ms),
            "--token-delay-ms",
            str(c.token_delay_ms),
            "--tokens",
            str(c.tokens),
            *(["--steps"] if c.engine_steps else []),
        )
        proc, _ = self.procs.launch(f"fake-{kind}", argv, self.load_cpus)
        if kind == "http":
            address = f"http://{HOST}:{port}"
            wait_http_ok(f"{address}/health", proc, self._deadline())
        else:
            address = f"{HOST}:{port}"
            wait_grpc_serving(address, proc, self._deadline(), poll_s=0.2)
        self.backends[kind], self.backend_procs[kind] = address, proc
        return address

    def _paths_seen(self) -> dict[str, int]:
        import httpx

        if "http" not in self.backends:
            return {}
        return httpx.get(f"{self.backends['http']}/_fake/paths", timeout=5).json()

    def rate_test(
        self,
        name: str,
        kind: str,
        address: str,
        router: Proc | None = None,
        fields: dict | None = None,
    ) -> dict[str, Any]:
        """The closed loop in `client_procs` subprocesses on the load CPUs;
        with `router`, its CPU use over the measured window too."""
        c = self.c
        per_proc = max(1, c.rate_concurrency // c.client_procs)
        spec = json.dumps(
            {
                "kind": kind,
                "address": address,
                "tokens": c.tokens,
                "fields": fields,
                "concurrency": per_proc,
                "warmup_s": c.warmup_s,
                "duration_s": c.duration_s,
                "cpu_pgid": router.pid if router else None,
                "watch_cpus": sorted({c.router_cpu, *self.load_cpus}),
            }
        )
        workers = []
        for i in range(c.client_procs):
            out_path = self.log_dir / f"rate-{name}-{i}.json"
            with open(out_path, "wb") as out:
                workers.append(
                    (
                        self.procs.launch(
                            f"rate-{name}-{i}",
                            [sys.executable, "-m", "bench.router_overhead", "--rate-worker", spec],
                            self.load_cpus,
                            stdout=out,
                        ),
                        out_path,
                    )
                )
        results = []
        for (proc, popen), out_path in workers:
            try:
                rc = popen.wait(timeout=c.warmup_s + c.duration_s + 180)
            finally:
                self.procs.stop(proc, grace_s=1)
            text = out_path.read_text().strip()
            if rc != 0 or not text:
                raise ProcessError(f"rate client {proc.name} failed (exit {rc}); see {proc.log}")
            results.append(json.loads(text.splitlines()[-1]))
        merged = {
            "rps": sum(r["rps"] for r in results),
            "completed": sum(r["completed"] for r in results),
            "errors": sum(r["errors"] for r in results),
            "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
            "concurrency": per_proc * c.client_procs,
            "clients": results,
        }
        # Each client read the counters over its own (nearly equal) window.
        probes = [r["cpu_pct"] for r in results if r.get("cpu_pct")]
        merged["cpu_pct"] = (
            {k: sum(p[k] for p in probes) / len(probes) for k in probes[0]} if probes else {}
        )
        merged["router_cpu_pct"] = merged["cpu_pct"].get("router")
        # How busy the router's core was (its process or anything else), and
        # the busiest load CPU (backend, client, anything else).
        merged["router_core_busy_pct"] = merged["cpu_pct"].get(f"cpu{c.router_cpu}")
        load = [
            merged["cpu_pct"][f"cpu{n}"]
            for n in sorted(self.load_cpus)
            if f"cpu{n}" in merged["cpu_pct"] and n != c.router_cpu
        ]
        merged["load_cpu_busy_pct"] = max(load) if load else None
        return merged

    def run_router(self, spec: RouterSpec) -> dict[str, Any]:
        c = self.c
        backend = self.backends[spec.backend]
        port = free_port()
        seen_before = self._paths_seen()
        env = {"TANDEM_LOG_LEVEL": "WARNING"}
        if c.base_src and spec.name == "tandem-base":
            env["PYTHONPATH"] = str(Path(c.base_src).resolve())
        proc, _ = self.procs.launch(
            spec.name,
            router_argv(spec, port, backend, self.model_dir, c.base_src),
            {c.router_cpu},
            env=env,
        )
        url = f"http://{HOST}:{port}"
        try:
            print(
                f"[{spec.name}] starting (pid {proc.pid}, CPU {c.router_cpu}) ...",
                file=sys.stderr,
                flush=True,
            )
            wait_http_ok(f"{url}{spec.ready_path}", proc, self._deadline())

            async def latency() -> tuple[list[Sample], list[Sample]]:
                routed = HttpTarget(url, c.tokens, spec.request_fields)
                direct = make_target(spec.backend, backend, c.tokens)
                await routed.open()
                await direct.open()
                try:
                    await wait_serving(routed, self._deadline(), proc)
                    return await latency_phase(
                        routed,
                        direct,
                        c.requests,
                        c.concurrency,
                        warmup=min(10, c.requests),
                        arrival_rate=c.arrival_rate,
                    )
                finally:
                    await routed.close()
                    await direct.close()

            seen_after = self._paths_seen()
            probes = {
                k: v - seen_before.get(k, 0)
                for k, v in seen_after.items()
                if v - seen_before.get(k, 0) > 0 and not k.endswith("/_fake/paths")
            }
            load = latency_load(c.arrival_rate, c.concurrency)
            print(
                f"[{spec.name}] latency: {c.requests} requests, {load} ...",
                file=sys.stderr,
                flush=True,
            )
            routed, direct = asyncio.run(latency())
            print(
                f"[{spec.name}] max rate: {c.duration_s:g} s at concurrency "
                f"{c.rate_concurrency} ...",
                file=sys.stderr,
                flush=True,
            )
            rate = self.rate_test(spec.name, "http", url, router=proc, fields=spec.request_fields)
            raise_if_exited(proc)
        finally:
            self.procs.stop(proc)
        return {
            "router": spec.name,
            "policy": spec.policy,
            "backend": spec.backend,
            "argv": proc.argv,
            "startup_probes": probes,
            "routed": summarize(routed),
            "direct": summarize(direct),
            "rate": rate,
        }

    def run(self) -> dict[str, Any]:
        c = self.c
        specs = [ROUTERS[name] for name in c.routers]
        for spec in specs:  # fail before starting anything
            if spec.binary:
                find_binary(spec)
        kinds = sorted({s.backend for s in specs})
        for kind in kinds:
            self.start_backend(kind)
        results = [self.run_router(spec) for spec in specs]
        ceilings = {}
        for kind in kinds:
            print(
                f"[direct-{kind}] max rate: {c.duration_s:g} s at concurrency "
                f"{c.rate_concurrency} ...",
                file=sys.stderr,
                flush=True,
            )
            ceilings[kind] = self.rate_test(f"direct-{kind}", kind, self.backends[kind])
        return self.report(results, ceilings)

    def report(self, results: list[dict], ceilings: dict[str, dict]) -> dict[str, Any]:
        c = self.c
        ideal_rps = c.rate_concurrency / (c.ideal_e2e_ms / 1000.0) if c.ideal_e2e_ms > 0 else 0
        rows = []
        for r in results:
            rate = r["rate"]
            rows.append(
                {
                    "router": r["router"],
                    "policy": r["policy"],
                    **added_latency(r["routed"], r["direct"]),
                    "max_rps": rate["rps"],
                    "rps_per_core": per_core(rate["rps"], rate["router_cpu_pct"]),
                    "router_cpu_pct": rate["router_cpu_pct"],
                    "router_core_busy_pct": rate["router_core_busy_pct"],
                    "load_cpu_busy_pct": rate["load_cpu_busy_pct"],
                    "limited_by": rate_limit(
                        rate["rps"],
                        rate["router_cpu_pct"],
                        ideal_rps,
                        ceilings[r["backend"]]["rps"],
                        rate["load_cpu_busy_pct"],
                        rate["router_core_busy_pct"],
                    ),
                    "direct_max_rps": ceilings[r["backend"]]["rps"],
                    "errors": r["routed"]["errors"] + rate["errors"],
                }
            )
        absolute = {}
        for r in results:
            absolute[r["router"]] = r["routed"]
            absolute[
                f"{DIRECT_GRPC if r['backend'] == 'grpc' else DIRECT_HTTP} (with {r['router']})"
            ] = r["direct"]
        report = {
            "config": {
                **asdict(c),
                "out": str(c.out),
                "ideal_e2e_ms": c.ideal_e2e_ms,
                "ideal_rps": ideal_rps,
                "prompt": PROMPT,
                "model": MODEL_NAME,
            },
            "rows": rows,
            "routers": results,
            "direct_rate": ceilings,
            "absolute": absolute,
            "ratios_vs_tandem": ratio_lines(rows),
        }
        return report


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"## Router overhead — fixed-latency backend: first token {c['first_token_ms']:g} ms, "
        f"then {c['token_delay_ms']:g} ms × {c['tokens'] - 1} (e2e {c['ideal_e2e_ms']:g} ms, "
        f"{c['tokens']} tokens)"
        + (
            "; tokens on a shared step clock (every request's token of a step together)"
            if c.get("engine_steps")
            else ""
        ),
        "",
        f"Added latency: {c['requests']} streaming chat requests per router, "
        f"{latency_load(c.get('arrival_rate', 0), c['concurrency'])}, "
        "interleaved with as many straight to its backend "
        f"(HTTP for vllm-router/sglang-router, gRPC Generate for Tandem); "
        f"added = router percentile − direct percentile.",
        f"Max req/s: closed loop, concurrency {c['rate_concurrency']}, {c['duration_s']:g} s "
        f"after {c['warmup_s']:g} s warm-up; router pinned to CPU {c['router_cpu']}, "
        f"backend and client on CPUs {c['load_cpus']}. Policy: round robin everywhere.",
        "",
        markdown_table(report["rows"]),
        "",
        "Same closed loop without a router (what the client and backend manage on the load "
        "CPUs): "
        + ", ".join(
            f"{DIRECT_GRPC if k == 'grpc' else DIRECT_HTTP} {v['rps']:.1f} req/s"
            for k, v in report["direct_rate"].items()
        )
        + f"; concurrency ÷ backend latency: {c['ideal_rps']:.1f} req/s.",
        "",
        "CPU at max, over the measured window, in % of one core: the router's processes; "
        "everything on the router's core; the busiest load CPU (fake backend, client, "
        "anything else). Limited by: 'router CPU' = the router used "
        f"≥ {ROUTER_BOUND_CPU_PCT:.0f}% of its core; 'concurrency' = within 10% of "
        "concurrency ÷ latency; 'client/backend' = a load CPU "
        f"≥ {BUSY_PCT:.0f}% busy or within 10% of the loop without a router; 'core shared' "
        f"= the router's core ≥ {BUSY_PCT:.0f}% busy with other processes; 'router "
        "latency' = none of these. 'router CPU' and 'router latency' name the router as "
        "the limit; for the others its own maximum is higher (≥). Req/s per router core = "
        "max req/s ÷ the router's CPU share: what its CPU cost per request allows one "
        "core to serve, also where the client and backend, not the router, were the limit.",
        "",
        "Measured latency per path (ms):",
        "",
        absolute_table(report["absolute"]),
    ]
    if report["ratios_vs_tandem"]:
        lines += [
            "",
            "Ratios (router ÷ tandem; >1 = more overhead, or more req/s):",
            *report["ratios_vs_tandem"],
        ]
    probes = {r["router"]: r["startup_probes"] for r in report["routers"] if r["backend"] == "http"}
    if probes:
        lines += [
            "",
            "Backend endpoints each HTTP router called at start-up: "
            + "; ".join(f"{k}: {', '.join(sorted(v)) or 'none'}" for k, v in probes.items()),
        ]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.router_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--routers",
        default="tandem,vllm-router,sglang-router",
        help=f"comma list of {', '.join(ROUTERS)}",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=Config.requests,
        help="requests per router in the latency test (and as many direct)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=Config.concurrency,
        help="concurrent requests in the latency test",
    )
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=Config.arrival_rate,
        help="latency test: send requests at random (Poisson) times, this many a second "
        "over both paths, instead of --concurrency clients back to back",
    )
    p.add_argument(
        "--rate-concurrency",
        type=int,
        default=Config.rate_concurrency,
        help="concurrent requests in the max-rate test (closed loop)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=Config.duration_s,
        help="seconds measured in the max-rate test, per router",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=Config.warmup_s,
        help="seconds of the max-rate loop before measuring",
    )
    p.add_argument("--tokens", type=int, default=Config.tokens, help="tokens per response")
    p.add_argument(
        "--first-token-ms",
        type=float,
        default=Config.first_token_ms,
        help="backend delay before the first token",
    )
    p.add_argument(
        "--token-delay-ms",
        type=float,
        default=Config.token_delay_ms,
        help="backend delay between tokens",
    )
    p.add_argument(
        "--engine-steps",
        action="store_true",
        help="the backends send tokens on a shared step clock (every --token-delay-ms), "
        "every request's token of a step together, as an engine does (without: each "
        "request on its own schedule)",
    )
    p.add_argument(
        "--router-cpu",
        type=int,
        default=None,
        help="CPU the router is pinned to (default: the first usable one)",
    )
    p.add_argument(
        "--load-cpus",
        default=None,
        help="comma list of CPUs for the backends and the client "
        "(default: every usable CPU but the router's)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=Config.client_procs,
        help="client processes in the max-rate test (more on machines with many load CPUs)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=Config.startup_timeout_s,
        help="seconds each backend and router may take to start",
    )
    p.add_argument("--out", type=Path, default=Config.out, help="JSON report")
    p.add_argument("--base-src", help="source tree of the tandem-base router (before/after)")
    p.add_argument("--rate-worker", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or not routers:
        raise SystemExit(f"--routers: unknown {unknown}; choose from {', '.join(ROUTERS)}")
    if "tandem-base" in routers and not args.base_src:
        raise SystemExit("--routers tandem-base needs --base-src (the base router's source tree)")
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu = cpus[0] if args.router_cpu is None else args.router_cpu
    if args.load_cpus:
        load = [int(x) for x in args.load_cpus.split(",") if x.strip()]
    else:
        load = [c for c in cpus if c != router_cpu] or [router_cpu]
    if load == [router_cpu]:
        print("warning: one usable CPU; router, backend and client share it", file=sys.stderr)
    for name, value in (
        ("--requests", args.requests),
        ("--concurrency", args.concurrency),
        ("--rate-concurrency", args.rate_concurrency),
        ("--tokens", args.tokens),
        ("--client-procs", args.client_procs),
    ):
        if value < 1:
            raise SystemExit(f"{name} must be at least 1")
    if args.arrival_rate < 0:
        raise SystemExit("--arrival-rate must not be negative")
    if args.duration <= 0 or args.warmup < 0:
        raise SystemExit("--duration must be positive and --warmup not negative")
    return Config(
        routers=routers,
        requests=args.requests,
        concurrency=args.concurrency,
        arrival_rate=args.arrival_rate,
        rate_concurrency=args.rate_concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        tokens=args.tokens,
        first_token_ms=args.first_token_ms,
        token_delay_ms=args.token_delay_ms,
        engine_steps=args.engine_steps,
        router_cpu=router_cpu,
        load_cpus=load,
        client_procs=args.client_procs,
        startup_timeout_s=args.startup_timeout,
        out=args.out,
        base_src=args.base_src,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rate_worker:
        return _rate_worker(args.rate_worker)
    config = config_from_args(args)
    bench = Bench(config)
    own_cpus = os.sched_getaffinity(0)
    try:
        with sigterm_as_interrupt():
            # The client (this process) shares the load CPUs with the backends.
            os.sched_setaffinity(0, set(config.load_cpus))
            report = bench.run()
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        return 130
    except ProcessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.procs.stop_all()
        os.sched_setaffinity(0, own_cpus)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))
    print(f"\nJSON: {config.out}; logs: {bench.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
