"""What a router costs as conversations grow: Tandem's router and SGLang's
gateway ``smg`` side by side, by conversation length and turns per session.

Each router sits in front of a fake backend that accepts any prompt length
and answers at once (bench/router_fakes.py, first token after 0 ms): Tandem's
in front of the fake gRPC engine, with its shared state in a Redis of its own
(as replicas run it), ``smg`` (HTTP mode, ``cache_aware``) in front of the
fake OpenAI server. For every length L (tokens the conversation reaches) and
turns per session T, ``--sessions`` agent sessions are played one request at
a time: a system prompt, then T turns, each adding a tool output and the
previous answer, so turn T's prompt is about L tokens; then ``--forks``
sub-agents fork the final context (their own session ids: new sessions that
share the parent's prefix); one-turn cells play at least 8 sessions. All
routers run at once and play each cell in turn, so they see the same machine
at about the same time. Each request through a router is followed by the
same request sent straight to its backend (Tandem: gRPC Generate with as
many token ids; smg: the same HTTP body); added TTFT = through the router
minus direct.

Per cell: added TTFT p50/p99 (all turns, and the session's last turn alone),
the router process's CPU seconds per request (/proc), and for Tandem the
breakdown of its own work from its ``tandem_router_stage_seconds{stage}``
histogram (template, tokenize, hash, index, state = Redis, grpc = call out to
first message), mean per request over the cell.

    python -m bench.router_length                                 # Tandem and smg
    python -m bench.router_length --lengths 1000,8000 --turns 1,10 --sessions 1
    python -m bench.router_length --routers tandem,tandem-base --base-src /tmp/base
        # before/after: a second Tandem router run from another source tree

smg runs from ``--smg`` (default: ``.tandem/venv-smg/bin/smg``; install with
``python -m venv .tandem/venv-smg && .tandem/venv-smg/bin/pip install smg==1.13.0``).
Results: a Markdown table and ratios on stdout, JSON in
bench/results/router_length.json, process logs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import router_fakes
from bench.harness import RedisServer, sigterm_as_interrupt
from bench.router_fakes import MODEL_NAME
from bench.router_overhead import parse_sse_line
from bench.routers import HOST, in_dir
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
from tandem.workload.metrics import percentile

STAGES = ("template", "tokenize", "hash", "index", "state", "grpc")
# Words the model's tokenizer encodes as one token each (with their leading
# space), so a message of N words is about N tokens.
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could "
    "people my than first water been call who its now find long down day did get come made "
    "may part file test line code run error value function return class import"
)
WORDS = _WORD_TEXT.split()
ANSWER_WORDS = 32  # the assistant's answer each turn, as the history carries it
FORK_WORDS = 48  # a sub-agent's task


@dataclass
class Config:
    routers: list[str] = field(default_factory=lambda: ["tandem", "smg"])
    lengths: list[int] = field(default_factory=lambda: [1000, 8000, 32000, 128000])
    turns: list[int] = field(default_factory=lambda: [1, 10, 40])
    sessions: int = 2
    forks: int = 4
    tokens: int = 4  # output tokens per response
    seed: int = 0
    redis: bool = True
    smg: str = ".tandem/venv-smg/bin/smg"
    base_src: str | None = None  # source tree of the "tandem-base" router
    startup_timeout_s: float = 180.0
    out: Path = Path("bench/results/router_length.json")


# -- the workload -------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


@dataclass
class Session:
    """One agent's requests in order: T turns, then the forks of its last context."""

    key: str
    turns: list[list[dict]]
    forks: list[tuple[str, list[dict]]]


def make_session(rng: random.Random, key: str, length: int, turns: int, forks: int) -> Session:
    """Turn k carries the system prompt and k tool outputs with the answers
    between them; turn `turns` is about `length` tokens."""
    system_words = min(512, length // 8)
    step = max(1, (length - system_words) // turns - ANSWER_WORDS)
    messages: list[dict] = [{"role": "system", "content": words(rng, system_words)}]
    requests = []
    for k in range(turns):
        if k:
            messages.append({"role": "assistant", "content": words(rng, ANSWER_WORDS)})
        messages.append({"role": "user", "content": words(rng, step)})
        requests.append(list(messages))
    final = [*messages, {"role": "assistant", "content": words(rng, ANSWER_WORDS)}]
    fork_requests = [
        (f"{key}:sub{i}", [*final, {"role": "user", "content": words(rng, FORK_WORDS)}])
        for i in range(forks)
    ]
    return Session(key, requests, fork_requests)


def chat_body(messages: list[dict], tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


# -- clients ------------------------------------------------------------------


@dataclass
class Shot:
    """One request: seconds to the first content token, prompt tokens (as the
    backend counted them), or the error."""

    ttft: float | None = None
    prompt_tokens: int = 0
    error: str | None = None


async def http_shot(session, url: str, body: bytes, headers: dict[str, str]) -> Shot:
    shot = Shot()
    start = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", **headers},
        ) as resp:
            if resp.status != 200:
                shot.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return shot
            async for line in resp.content:
                done, n = parse_sse_line(line)
                if n and shot.ttft is None:
                    shot.ttft = time.perf_counter() - start
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    shot.prompt_tokens = usage.get("prompt_tokens") or shot.prompt_tokens
                if done:
                    break
    except Exception as exc:  # a benchmark records failures, it does not stop
        shot.error = f"{type(exc).__name__}: {exc}"[:300]
    if shot.error is None and shot.ttft is None:
        shot.error = "no content token"
    return shot


async def grpc_shot(stub, num_tokens: int, tokens: int) -> Shot:
    from common.proto import engine_pb2 as pb

    shot = Shot(prompt_tokens=num_tokens)
    request = pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        token_ids=[1 + i % 40000 for i in range(num_tokens)],
        sampling_params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    try:
        async for message in stub.Generate(request, timeout=120):
            if message.text and shot.ttft is None:
                shot.ttft = time.perf_counter() - start
    except Exception as exc:
        shot.error = f"{type(exc).__name__}: {exc}"[:300]
    return shot


# -- statistics ---------------------------------------------------------------


def added(routed: list[Shot], direct: list[Shot]) -> dict[str, float | None]:
    """Added TTFT p50/p99 in ms: the router's percentile minus the direct one."""
    r = [s.ttft for s in routed if s.ttft is not None]
    d = [s.ttft for s in direct if s.ttft is not None]
    if not r or not d:
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": 1000 * (percentile(r, 50) - percentile(d, 50)),
        "p99_ms": 1000 * (percentile(r, 99) - percentile(d, 99)),
    }


def stage_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) per stage of tandem_router_stage_seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "tandem_router_stage_seconds":
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if sample.name.endswith("_sum"):
                out.setdefault(stage, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                out.setdefault(stage, [0.0, 0.0])[1] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    means = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        if count > c0:
            means[stage] = 1000 * (total - t0) / (count - c0)
    return means


# -- the run ------------------------------------------------------------------


class Bench:
    def __init__(self, config: Config) -> None:
        from common.model import resolve_model

        self.c = config
        self.log_dir = config.out.parent / "router_length_logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = Processes(self.log_dir)
        self.model_dir = str(resolve_model(None))
        self.redis: RedisServer | None = None

    def _deadline(self) -> float:
        return time.monotonic() + self.c.startup_timeout_s

    def start_backend(self, kind: str) -> str:
        port = free_port()
        argv = router_fakes.command(
            kind,
            HOST,
            str(port),
            self.model_dir,
            "--first-token-ms",
            "0",
            "--token-delay-ms",
            "0",
            "--tokens",
            str(self.c.tokens),
            "--max-model-len",
            str(4 * max(self.c.lengths) + 4096),
        )
        proc, _ = self.procs.launch(f"fake-{kind}", argv)
        if kind == "openai":
            address = f"http://{HOST}:{port}"
            wait_http_ok(f"{address}/health", proc, self._deadline())
        else:
            address = f"{HOST}:{port}"
            wait_grpc_serving(address, proc, self._deadline(), poll_s=0.2)
        return address

    def router_argv(self, name: str, port: int, backend: str) -> tuple[list[str], dict, str]:
        """(argv, extra env, working directory) of router `name`."""
        if name in ("tandem", "tandem-base"):
            argv = [
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
                self.model_dir,
                "--max-concurrent-requests",
                "0",
                "--shutdown-grace-s",
                "1",
            ]
            if self.redis is not None:
                argv += ["--redis-url", self.redis.url]
            cwd = os.getcwd()
            if name == "tandem-base":
                if not self.c.base_src:
                    raise ProcessError("tandem-base needs --base-src")
                cwd = str(Path(self.c.base_src).resolve())
            return argv, {"TANDEM_LOG_LEVEL": "WARNING", "PYTHONPATH": cwd}, cwd
        if name == "smg":
            smg = shutil.which(self.c.smg) or (self.c.smg if Path(self.c.smg).exists() else None)
            if smg is None:
                raise ProcessError(
                    f"smg not found at {self.c.smg}: python -m venv .tandem/venv-smg && "
                    ".tandem/venv-smg/bin/pip install smg==1.13.0 (or --routers tandem)"
                )
            argv = [
                str(Path(smg).resolve()),
                "launch",
                "--host",
                HOST,
                "--port",
                str(port),
                "--worker-urls",
                backend,
                "--policy",
                "cache_aware",
                "--prometheus-host",
                HOST,
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ]
            return argv, {}, os.getcwd()
        raise ProcessError(f"unknown router {name!r}: tandem, tandem-base or smg")

    def start_router(self, name: str, backends: dict[str, str]) -> _Router:
        kind = "openai" if name == "smg" else "grpc"
        port = free_port()
        argv, env, cwd = self.router_argv(name, port, backends[kind])
        proc, _ = self.procs.launch(name, in_dir(argv, cwd), env=env)
        print(f"[{name}] starting (pid {proc.pid}) ...", file=sys.stderr, flush=True)
        url = f"http://{HOST}:{port}"
        wait_http_ok(
            f"{url}/readiness" if name == "smg" else f"{url}/health", proc, self._deadline()
        )
        return _Router(name, url, kind, backends[kind], proc, argv)

    def sessions_for(self, turns: int) -> int:
        """Sessions per cell: at least 8 requests' worth (one-turn cells)."""
        return max(self.c.sessions, -(-8 // turns))

    async def play(self, routers: list[_Router]) -> dict[str, list[dict[str, Any]]]:
        """Every cell, the routers one after the other within each cell (so
        they see the same machine at about the same time)."""
        import aiohttp
        import grpc

        from common.proto import engine_pb2_grpc as pb_grpc

        c = self.c
        # Idle connections go before the routers' keep-alive (uvicorn: 5 s)
        # closes them: while other routers play a cell, this one's wait.
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=1),
            timeout=aiohttp.ClientTimeout(total=300),
        )
        stubs = {}
        channels = []
        for r in routers:
            if r.kind == "grpc" and r.backend not in stubs:
                channel = grpc.aio.insecure_channel(
                    r.backend,
                    options=[
                        ("grpc.max_send_message_length", -1),
                        ("grpc.max_receive_message_length", -1),
                    ],
                )
                channels.append(channel)
                stubs[r.backend] = pb_grpc.EngineStub(channel)
        salt = uuid.uuid4().hex[:8]
        out: dict[str, list[dict[str, Any]]] = {r.name: [] for r in routers}
        try:
            for r in routers:  # warm up: the template, the tokenizer, the connections
                warm = make_session(random.Random(-1), f"{salt}-warm-{r.name}", 1000, 2, 0)
                for messages in warm.turns:
                    shot = await http_shot(http, r.url, chat_body(messages, c.tokens), {})
                    if shot.error:
                        raise ProcessError(f"{r.name}: warm-up request failed: {shot.error}")
            for length in c.lengths:
                for turns in c.turns:
                    rng = random.Random(f"{c.seed}:{length}:{turns}")
                    n = self.sessions_for(turns)
                    sessions = [
                        make_session(rng, f"{length}-{turns}-{i}", length, turns, c.forks)
                        for i in range(n)
                    ]
                    for r in routers:
                        print(
                            f"[{r.name}] {length} tokens, {turns} turns, {n} sessions ...",
                            file=sys.stderr,
                            flush=True,
                        )
                        cell = await self._cell(
                            r, http, stubs.get(r.backend), sessions, f"{salt}-{r.name}"
                        )
                        out[r.name].append({"length": length, "turns": turns, **cell})
                        raise_if_exited(r.proc)
        finally:
            await http.close()
            for channel in channels:
                await channel.close()
        return out

    async def _cell(
        self, r: _Router, http, stub, sessions: list[Session], prefix: str
    ) -> dict[str, Any]:
        """One router through `sessions` (their keys under `prefix`): the
        turns, then the forks."""
        c = self.c

        async def direct(body: bytes, prompt_tokens: int) -> Shot:
            if r.kind == "openai":
                return await http_shot(http, r.backend, body, {})
            return await grpc_shot(stub, prompt_tokens, c.tokens)

        async def metrics() -> dict[str, tuple[float, float]]:
            if r.name == "smg":
                return {}
            async with http.get(f"{r.url}/metrics") as resp:
                return stage_totals(await resp.text())

        out: dict[str, list[Shot]] = {k: [] for k in ("turn", "last", "fork")}
        direct_out: dict[str, list[Shot]] = {k: [] for k in out}
        cpu_s: dict[str, float] = {}
        stages: dict[str, dict[str, float]] = {}
        for part in ("turn", "fork"):
            before = await metrics()
            cpu0 = group_cpu_seconds(r.proc.pid)
            for session in sessions:
                requests = (
                    [(session.key, m) for m in session.turns] if part == "turn" else session.forks
                )
                for i, (key, messages) in enumerate(requests):
                    body = chat_body(messages, c.tokens)
                    shot = await http_shot(http, r.url, body, {"x-session-id": f"{prefix}:{key}"})
                    if shot.error:
                        raise ProcessError(f"{r.name}: request failed: {shot.error}")
                    d = await direct(body, shot.prompt_tokens)
                    out[part].append(shot)
                    direct_out[part].append(d)
                    if part == "turn" and i == len(requests) - 1:
                        out["last"].append(shot)
                        direct_out["last"].append(d)
            # /proc counts in clock ticks: over the part, not per request.
            cpu_s[part] = group_cpu_seconds(r.proc.pid) - cpu0
            stages[part] = stage_means_ms(before, await metrics())
        cell: dict[str, Any] = {}
        for part, shots in out.items():
            if not shots:
                continue
            cell[part] = {
                "n": len(shots),
                "prompt_tokens_mean": sum(s.prompt_tokens for s in shots) / len(shots),
                **added(shots, direct_out[part]),
                "direct_p50_ms": 1000
                * percentile([s.ttft for s in direct_out[part] if s.ttft], 50),
            }
            if part in cpu_s:
                cell[part]["cpu_ms_per_request"] = 1000 * cpu_s[part] / len(shots)
                cell[part]["stages_ms"] = stages[part]
        return cell

    def run(self) -> dict[str, Any]:
        c = self.c
        backends = {}
        if any(r != "smg" for r in c.routers):
            backends["grpc"] = self.start_backend("grpc")
            if c.redis:
                self.redis = RedisServer(self.log_dir)
                self.redis.start(timeout_s=c.startup_timeout_s)
        if "smg" in c.routers:
            backends["openai"] = self.start_backend("openai")
        routers = [self.start_router(name, backends) for name in c.routers]
        load_before = os.getloadavg()
        cells = asyncio.run(self.play(routers))
        return {
            "config": {**asdict(c), "out": str(c.out)},
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "routers": [
                {"router": r.name, "argv": r.argv, "cells": cells[r.name]} for r in routers
            ],
        }


@dataclass
class _Router:
    name: str
    url: str
    kind: str  # its backend: "grpc" or "openai"
    backend: str
    proc: Proc
    argv: list[str]


# -- the report ---------------------------------------------------------------


def _f(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    lines = [
        "| router | tokens | turns | requests | prompt tokens | added TTFT p50 / p99 ms | "
        "last turn p50 ms | CPU ms/req | forks: added p50 / CPU ms | " + " | ".join(STAGES) + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(STAGES),
    ]
    for r in report["routers"]:
        for cell in r["cells"]:
            t, last, fork = cell["turn"], cell["last"], cell.get("fork")
            stages = t.get("stages_ms") or {}
            lines.append(
                f"| {r['router']} | {cell['length']} | {cell['turns']} | {t['n']} | "
                f"{t['prompt_tokens_mean']:.0f} | {_f(t['p50_ms'])} / {_f(t['p99_ms'])} | "
                f"{_f(last['p50_ms'])} | {_f(t['cpu_ms_per_request'])} | "
                + (f"{_f(fork['p50_ms'])} / {_f(fork['cpu_ms_per_request'])}" if fork else "—")
                + " | "
                + " | ".join(_f(stages.get(s), 2) for s in STAGES)
                + " |"
            )
    lines.append("")
    lines.append(
        "Stages: Tandem's own tandem_router_stage_seconds, mean ms per turn request "
        "(grpc: call out → first message, the fake engine answers at once)."
    )
    names = [r["router"] for r in report["routers"]]
    if len(names) > 1:
        base = report["routers"][0]
        for other in report["routers"][1:]:
            parts = []
            for a, b in zip(base["cells"], other["cells"]):
                ta, tb = a["turn"], b["turn"]
                if ta["cpu_ms_per_request"] and tb["cpu_ms_per_request"]:
                    parts.append(
                        f"{a['length']}/{a['turns']}: TTFT p50 "
                        f"{_ratio(tb['p50_ms'], ta['p50_ms'])}, CPU "
                        f"{_ratio(tb['cpu_ms_per_request'], ta['cpu_ms_per_request'])}"
                    )
            lines.append(f"- {other['router']} ÷ {base['router']}: " + "; ".join(parts))
    la, lb = report["loadavg_before"], report["loadavg_after"]
    lines.append(
        f"\nLoad average (1/5/15 min) before {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f}, "
        f"after {lb[0]:.1f} / {lb[1]:.1f} / {lb[2]:.1f}."
    )
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0 or a <= 0:
        return "—"
    return f"{a / b:.2f}×"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.router_length", description=__doc__.split("\n\n")[0]
    )
    d = Config()
    p.add_argument("--routers", default=",".join(d.routers), help="tandem, tandem-base, smg")
    p.add_argument("--lengths", default=",".join(map(str, d.lengths)), help="tokens reached")
    p.add_argument("--turns", default=",".join(map(str, d.turns)), help="turns per session")
    p.add_argument("--sessions", type=int, default=d.sessions, help="sessions per cell")
    p.add_argument("--forks", type=int, default=d.forks, help="sub-agents per session")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-redis", action="store_true", help="Tandem without Redis")
    p.add_argument("--smg", default=d.smg, help="the smg command")
    p.add_argument("--base-src", help="source tree of the tandem-base router (before/after)")
    p.add_argument(
        "--startup-timeout-s", type=float, default=d.startup_timeout_s, help="per process"
    )
    p.add_argument("--out", type=Path, default=d.out, help="JSON report")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = Config(
        routers=[r for r in args.routers.split(",") if r],
        lengths=_ints(args.lengths),
        turns=_ints(args.turns),
        sessions=args.sessions,
        forks=args.forks,
        seed=args.seed,
        redis=not args.no_redis,
        smg=args.smg,
        base_src=args.base_src,
        startup_timeout_s=args.startup_timeout_s,
        out=args.out,
    )
    bench = Bench(config)
    try:
        with sigterm_as_interrupt():
            report = bench.run()
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # ProcessError, or Redis missing or silent
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.procs.stop_all()
        if bench.redis is not None:
            bench.redis.stop()
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))
    print(f"\nJSON: {config.out}; logs: {bench.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
