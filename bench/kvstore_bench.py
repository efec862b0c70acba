"""KV store benchmark: what the shared store buys, measured side by side in one run.

1. **Store bandwidth**: put/get of KV-block-sized objects through the real
   store (a requester with registered buffers, zero-copy ``put_from`` /
   ``get_into``, as vLLM's connector does), next to this machine's memcpy
   bandwidth measured in the same run.
2. **Multi-turn replay across two engines**: sessions whose every turn is the
   previous context plus a new tool result, each turn sent to the *other*
   engine (what happens when a router rebalances or an engine restarts).
   Run once with engines that use the store and once with engines that do
   not; prefix hit rate and TTFT p50/p90 are reported as ratios.

At most two engines are alive at a time. Usage:

    python -m bench.kvstore_bench [--sessions 3 --turns 4] [--skip-replay]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_client import EngineClient, long_prompt
from common.ports import free_ports
from common.procs import Processes
from tandem.workload.metrics import percentile

STOP_GRACE_S = 60.0
MAX_MODEL_LEN = 4096  # of the engines start_engine starts


def start_store(procs: Processes, state: Path, pool_size: str, **settings):
    """``settings``: other store settings (``transfer="auto"``, ...); the
    lease on reads is 500 ms unless given (the benches here remove what they
    read)."""
    from services.kvstore.api import store_launch, wait_ready

    settings.setdefault("lease_ttl_ms", 500)
    launch = store_launch(state, ports=free_ports(6), pool_size=pool_size, **settings)
    proc, popen = procs.launch(state.name, launch.argv, env=launch.env)
    wait_ready(launch.health_url, 180, alive=lambda: popen.poll() is None)
    return launch, proc


# -- 1. bandwidth -------------------------------------------------------------


def memcpy_gbps(size: int, repeat: int) -> float:
    import numpy as np

    src = np.random.randint(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault pages in
    start = time.perf_counter()
    for _ in range(repeat):
        np.copyto(dst, src)
    return size * repeat / (time.perf_counter() - start) / 1e9


def store_gbps(launch, object_size: int, count: int) -> tuple[float, float]:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    s = launch.settings
    store = MooncakeDistributedStore()
    total = object_size * count
    rc = store.setup(s.host, s.metadata_url, 0, total + (16 << 20), "tcp", "", s.master_address)
    if rc != 0:
        raise RuntimeError(f"store setup failed: {rc}")
    src = np.random.randint(0, 255, total, dtype=np.uint8)
    dst = np.zeros_like(src)
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
    keys = [f"bench-{os.getpid()}-{i}" for i in range(count)]
    ptrs = [src.ctypes.data + i * object_size for i in range(count)]
    start = time.perf_counter()
    res = store.batch_put_from(keys, ptrs, [object_size] * count)
    put_s = time.perf_counter() - start
    if any(r != 0 for r in res):
        raise RuntimeError(f"puts failed: {sorted(set(res))}")
    dptrs = [dst.ctypes.data + i * object_size for i in range(count)]
    start = time.perf_counter()
    got = store.batch_get_into(keys, dptrs, [object_size] * count)
    get_s = time.perf_counter() - start
    if any(g != object_size for g in got):
        raise RuntimeError(f"gets failed: {sorted(set(got))}")
    if not np.array_equal(src, dst):
        raise RuntimeError("data read back differs from data written")
    time.sleep(0.6)  # past the read lease
    store.batch_remove(keys) if hasattr(store, "batch_remove") else None
    store.close()
    return total / put_s / 1e9, total / get_s / 1e9


# -- 2. multi-turn replay -------------------------------------------------------


def start_engine(procs: Processes, role: str, cpu: int | None, name: str, store_flags: list[str]):
    grpc_port, metrics_port, nixl_port = free_ports(3)
    from services.stack import engine_env

    env = engine_env(1, cpu)
    proc, popen = procs.launch(
        name,
        [
            sys.executable,
            "-m",
            "services.engine",
            "--role",
            role,
            "--grpc-port",
            str(grpc_port),
            "--metrics-port",
            str(metrics_port),
            "--nixl-port",
            str(nixl_port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *store_flags,
        ],
        env=env,
    )
    client = EngineClient(grpc_port, metrics_port)
    deadline = time.monotonic() + 900
    while True:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode} (see {proc.log})")
        try:
            client.wait_ready(5)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
    return proc, client


def replay(
    clients, tokenizer, sessions: int, turns: int, first_tokens: int, turn_tokens: int
) -> dict:
    ttfts, prompt_total, cached_total = [], 0, 0
    contexts = {s: long_prompt(tokenizer, first_tokens, seed=1000 + s) for s in range(sessions)}
    for t in range(turns):
        for s in range(sessions):
            engine = clients[(s + t) % len(clients)]  # every turn on the other engine
            ids = contexts[s]
            r = engine.generate(ids, max_tokens=8)
            ttfts.append(r.seconds)
            if t > 0:  # the first turn has nothing to reuse
                prompt_total += r.prompt_tokens
                cached_total += r.cached_tokens
            tool_result = long_prompt(tokenizer, turn_tokens, seed=5000 + s * 100 + t)
            contexts[s] = ids + r.token_ids + tool_result
    return {
        "hit_rate": cached_total / max(prompt_total, 1),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "requests": len(ttfts),
    }


def run_replay(args, procs: Processes, store_flags: list[str], label: str) -> dict:
    from transformers import AutoTokenizer

    from common.model import resolve_model
    from services.stack import engine_cores

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    engines = []
    try:
        for i, core in enumerate(engine_cores(2)):
            engines.append(start_engine(procs, "both", core, f"{label}-{i}", store_flags))
        return replay(
            [c for _, c in engines],
            tokenizer,
            args.sessions,
            args.turns,
            args.first_tokens,
            args.turn_tokens,
        )
    finally:
        for proc, client in engines:
            client.close()
            procs.stop(proc, STOP_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=1000)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--object-size", default="4MB", help="bandwidth test object size")
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from common.mooncake import parse_size

    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="tandem-kvbench-") as d:
        tmp = Path(d)
        procs = Processes(tmp)
        try:
            launch, _ = start_store(procs, tmp / "store", pool_size="1GB")
            size = parse_size(args.object_size)
            put, get = store_gbps(launch, size, args.objects)
            mem = memcpy_gbps(size * args.objects, 5)
            report["bandwidth"] = {
                "object_bytes": size,
                "objects": args.objects,
                "store_put_gbps": round(put, 2),
                "store_get_gbps": round(get, 2),
                "memcpy_gbps": round(mem, 2),
                "put_over_memcpy": round(put / mem, 3),
                "get_over_memcpy": round(get / mem, 3),
            }
            if not args.skip_replay:
                without = run_replay(args, procs, [], "nostore")
                with_store = run_replay(args, procs, launch.engine_flags, "store")
                report["replay"] = {
                    "sessions": args.sessions,
                    "turns": args.turns,
                    "without_store": without,
                    "with_store": with_store,
                    "hit_rate_gain": round(with_store["hit_rate"] - without["hit_rate"], 3),
                    "ttft_p50_ratio": round(without["ttft_p50"] / with_store["ttft_p50"], 2),
                    "ttft_p90_ratio": round(without["ttft_p90"] / with_store["ttft_p90"], 2),
                }
        finally:
            procs.stop_all()
    if args.json:
        print(json.dumps(report))
    else:
        b = report["bandwidth"]
        print(
            f"store put {b['store_put_gbps']} GB/s, get {b['store_get_gbps']} GB/s, "
            f"memcpy {b['memcpy_gbps']} GB/s (put {b['put_over_memcpy']}x, get "
            f"{b['get_over_memcpy']}x of memcpy), {b['objects']} x {b['object_bytes']} B"
        )
        if "replay" in report:
            r = report["replay"]
            for k in ("without_store", "with_store"):
                v = r[k]
                print(
                    f"{k:14s} hit rate {v['hit_rate']:.1%}  TTFT p50 {v['ttft_p50']:.2f}s "
                    f"p90 {v['ttft_p90']:.2f}s  ({v['requests']} requests)"
                )
            print(
                f"TTFT ratio (without/with store): p50 {r['ttft_p50_ratio']}x, "
                f"p90 {r['ttft_p90_ratio']}x; hit rate +{r['hit_rate_gain']:.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
