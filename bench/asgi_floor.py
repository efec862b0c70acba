"""What an HTTP server costs before any routing: the CPU per request of a bare
ASGI app that streams a short chat completion's server-sent events (16
chunks 5 ms apart after 20 ms, as `bench.router_overhead`'s fake engine),
under uvicorn (uvloop, httptools: the router's server) and granian (Rust; on
uvloop and on asyncio's loop), side by side in one run.

Each server runs pinned to one CPU; a closed loop of streaming requests runs
from this process on the others; CPU per request = the server's process
group's CPU seconds over the measured window ÷ the requests finished in it.
Rounds alternate the servers, so a busy machine weighs on each alike.

    python -m bench.asgi_floor --rounds 4

granian is in the `routers` extra (`make bench-routers` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import orjson

from common.ports import free_port
from common.procs import Processes, group_cpu_seconds, raise_if_exited, wait_http_ok

HOST = "127.0.0.1"
CHUNKS = 16
FIRST_CHUNK_S = 0.020
CHUNK_DELAY_S = 0.005
_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope, receive, send) -> None:
    """The streamed response a router sends, and nothing else: a chunk of
    OpenAI's shape per token, then ``[DONE]``; GET answers 200 (readiness)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    if scope["method"] == "GET":
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await asyncio.sleep(FIRST_CHUNK_S)
    for i in range(CHUNKS):
        chunk = {
            "id": "floor",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
        }
        body = b"data: " + orjson.dumps(chunk) + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.sleep(CHUNK_DELAY_S)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _granian(loop: str):
    def argv(port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "granian", "--interface", "asgi", "--host", HOST),
            *("--port", str(port), "--workers", "1", "--runtime-threads", "1"),
            *("--loop", loop, "--no-ws", "--log-level", "warning", "bench.asgi_floor:app"),
        ]

    return argv


SERVERS = {
    "uvicorn": lambda port: [
        *(sys.executable, "-m", "uvicorn", "bench.asgi_floor:app", "--host", HOST),
        *("--port", str(port), "--loop", "uvloop", "--http", "httptools"),
        *("--log-level", "warning"),
    ],
    "granian": _granian("uvloop"),
    "granian-asyncio": _granian("asyncio"),
}


async def closed_loop(url: str, concurrency: int, warmup_s: float, duration_s: float, pgid: int):
    """Requests finished and the server's CPU seconds over the window after
    the warm-up."""
    import aiohttp

    start = time.perf_counter() + warmup_s
    end = start + duration_s
    finished = 0
    cpu: list[float] = []
    loop = asyncio.get_running_loop()
    loop.call_at(loop.time() + warmup_s, lambda: cpu.append(group_cpu_seconds(pgid)))
    loop.call_at(loop.time() + warmup_s + duration_s, lambda: cpu.append(group_cpu_seconds(pgid)))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal finished
            while time.perf_counter() < end:
                async with session.post(url, data=b"{}") as response:
                    lines = [line async for line in response.content if line.strip()]
                if lines[-1].strip() != b"data: [DONE]":
                    raise RuntimeError(f"stream ended without [DONE]: {lines[-1]!r}")
                if start <= time.perf_counter() < end:
                    finished += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return finished, cpu[1] - cpu[0]


def measure(server: str, args: argparse.Namespace, procs: Processes) -> dict:
    port = free_port()
    proc, _ = procs.launch(server, SERVERS[server](port), {args.server_cpu})
    try:
        wait_http_ok(f"http://{HOST}:{port}/", proc, time.monotonic() + 60)
        requests, cpu_s = asyncio.run(
            closed_loop(
                f"http://{HOST}:{port}/", args.concurrency, args.warmup, args.duration, proc.pid
            )
        )
        raise_if_exited(proc)
    finally:
        procs.stop(proc, grace_s=2)
    return {
        "server": server,
        "req_per_s": requests / args.duration,
        "server_cpu_pct": 100 * cpu_s / args.duration,
        "cpu_ms_per_request": 1000 * cpu_s / max(requests, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.asgi_floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per server")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--server-cpu", type=int, default=0, help="CPU the server is pinned to")
    p.add_argument("--out", type=Path, default=Path("bench/results/asgi_floor.json"))
    args = p.parse_args(argv)
    servers = args.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    load_cpus = os.sched_getaffinity(0) - {args.server_cpu}
    if not load_cpus:
        p.error("needs a CPU besides --server-cpu for the client")
    os.sched_setaffinity(0, load_cpus)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    procs = Processes(args.out.parent)
    runs: list[dict] = []
    load_before = os.getloadavg()
    try:
        for round_ in range(args.rounds):
            for server in servers:
                run = {"round": round_, **measure(server, args, procs)}
                runs.append(run)
                print(
                    f"round {round_} {server}: {run['req_per_s']:.0f} req/s, server CPU "
                    f"{run['server_cpu_pct']:.0f}%, {run['cpu_ms_per_request']:.3f} ms CPU "
                    "a request",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        procs.stop_all()
    medians = {
        s: statistics.median(r["cpu_ms_per_request"] for r in runs if r["server"] == s)
        for s in servers
    }
    print(f"## ASGI server floor: {CHUNKS} SSE chunks a request, {args.rounds} rounds\n")
    print("| server | CPU ms a request (median) | req/s per core | ÷ uvicorn |")
    print("|---|---:|---:|---:|")
    base = medians.get("uvicorn")
    for s, ms in medians.items():
        ratio = f"×{ms / base:.2f}" if base else "n/a"
        print(f"| {s} | {ms:.3f} | {1000 / ms:.0f} | {ratio} |")
    load_after = os.getloadavg()
    print(f"\nload average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end")
    args.out.write_text(json.dumps({"runs": runs, "medians_ms": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
