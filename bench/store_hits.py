"""Store hits against local hits: TTFT when a prompt's prefix comes from the
shared KV store instead of the engine's own prefix cache, side by side.

Two aggregated engines share one store. For each prefix length and round, a
prefix is computed once on one engine (the *writer*, which puts its blocks
into the store), then the same prefix with a new short suffix is sent

* to the writer again: its prefix is in the writer's own prefix cache
  (a **local** hit);
* to the other engine, which has never seen it: its prefix is loaded from
  the store (a **store** hit);

in alternating order, and with the writer alternating between the engines.
Each request is classified by the serving engine's own counters (the change
of ``vllm:external_prefix_cache_hits_total`` and
``vllm:prefix_cache_hits_total`` across it), not by assumption; requests
that hit neither way are counted as misses and left out of the figures.
TTFT is the first token of a greedy one-token Generate over gRPC (no
router). One store and its two engines per ``--transfers`` entry, one after
the other (at most two engines alive), so ``auto`` (the KV cache in the pool
owner's shared memory, one copy per block) and ``tcp`` are compared in one
run.

``--replay`` plays an agentic replay instead: sessions pinned to an engine
(as the router keeps them), each turn two tool calls in a row, every request
adding ``--turn-tokens`` new tokens to its session's context, with each
engine's KV cache (``--kv-blocks``) a fraction of the sessions it serves. A
turn's first request finds its context evicted by the engine's other
sessions and loads it from the store; the second finds it in the engine's
own cache. Same new tokens, same engine, classified by the counters as
above. Usage:

    python -m bench.store_hits [--transfers auto,tcp] [--lengths 1024,2048,3072] [--rounds 3]
    python -m bench.store_hits --replay [--sessions 8] [--turns 4] [--kv-blocks 34]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine_client import EngineClient, long_prompt
from bench.kvstore_bench import MAX_MODEL_LEN, STOP_GRACE_S, start_engine, start_store
from common.mooncake import KvStoreSettings
from common.procs import Processes
from tandem.workload.metrics import percentile

EXTERNAL = "vllm:external_prefix_cache_hits_total"
LOCAL = "vllm:prefix_cache_hits_total"
BLOCK_TOKENS = 128  # the engines' KV block size on CPU
# vLLM's own timing of its store connector's calls, by operation.
STORE_OP_SECONDS = "vllm:mooncake_store_operation_time_seconds_sum{{operation={}}}"
STORE_OPS = ("lookup_exists", "load_get")


def store_objects(launch) -> float:
    import httpx

    for line in httpx.get(launch.metrics_url, timeout=10).text.splitlines():
        if line.startswith("tandem_kvstore_objects "):
            return float(line.split()[1])
    raise RuntimeError("the store exports no tandem_kvstore_objects")


def wait_objects(launch, at_least: float, timeout: float = 120, settle_s: float = 1.0) -> None:
    """Until the store holds ``at_least`` objects and their count has not
    changed for ``settle_s`` (puts are asynchronous, and the count also moves
    with other requests' puts: reaching it alone does not say a prefix is in)."""
    deadline = time.monotonic() + timeout
    count, since = store_objects(launch), time.monotonic()
    while count < at_least or time.monotonic() - since < settle_s:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store never settled at {at_least:.0f} objects or more")
        time.sleep(0.2)
        now = store_objects(launch)
        if now != count:
            count, since = now, time.monotonic()


def timed(client: EngineClient, ids: list[int]) -> dict:
    """A one-token request and where its prefix came from, by the engine's counters."""
    before = client.metrics()
    r = client.generate(ids, max_tokens=1)
    after = client.metrics()
    external = after.get(EXTERNAL, 0.0) - before.get(EXTERNAL, 0.0)
    local = after.get(LOCAL, 0.0) - before.get(LOCAL, 0.0)
    kind = "store" if external > 0 else "local" if local > 0 else "miss"
    row = {"kind": kind, "ttft_s": r.seconds, "external": external, "local": local}
    for op in STORE_OPS:
        key = STORE_OP_SECONDS.format(op)
        row[f"{op}_s"] = after.get(key, 0.0) - before.get(key, 0.0)
    return row


def measure(
    launch, clients: list[EngineClient], tokenizer, lengths: list[int], rounds: int, suffix: int
) -> list[dict]:
    rows = []
    seed = int(time.time()) % 100_000 * 100  # fresh prompts: nothing cached from earlier runs
    for r in range(rounds):
        for i, length in enumerate(lengths):
            seed += 1
            writer, other = (clients[(r + i) % 2], clients[(r + i + 1) % 2])
            prefix = long_prompt(tokenizer, length, seed=seed)
            objects = store_objects(launch)
            writer.generate(prefix + long_prompt(tokenizer, suffix, seed=seed + 7_000_000), 1)
            wait_objects(launch, objects + len(prefix) // BLOCK_TOKENS)
            local_ids = prefix + long_prompt(tokenizer, suffix, seed=seed + 8_000_000)
            store_ids = prefix + long_prompt(tokenizer, suffix, seed=seed + 9_000_000)
            pair = [(writer, local_ids), (other, store_ids)]
            for client, ids in pair if (r + i) % 2 == 0 else reversed(pair):
                row = timed(client, ids)
                row.update(length=length, round=r)
                rows.append(row)
    return rows


def replay(
    clients: list[EngineClient],
    tokenizer,
    sessions: int,
    turns: int,
    first_tokens: int,
    turn_tokens: int,
) -> list[dict]:
    """Every request of an agentic replay, timed and classified; sessions
    alternate between the engines and stay on theirs."""
    rows = []
    seed = int(time.time()) % 100_000 * 100
    contexts = {s: long_prompt(tokenizer, first_tokens, seed=seed + s) for s in range(sessions)}
    for turn in range(turns):
        for session in range(sessions):
            for call in range(2):  # two tool calls in a row
                tool_output = long_prompt(
                    tokenizer, turn_tokens, seed=seed + 1_000_000 + session * 1000 + turn * 2 + call
                )
                ids = contexts[session] + tool_output
                row = timed(clients[session % len(clients)], ids)
                row.update(session=session, turn=turn, call=call, prompt_tokens=len(ids))
                rows.append(row)
                contexts[session] = ids + [tokenizer.eos_token_id]
    return rows


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for kind in ("local", "store"):
        ttfts = [row["ttft_s"] for row in rows if row["kind"] == kind]
        out[kind] = {
            "n": len(ttfts),
            "p50_s": percentile(ttfts, 50),
            "p90_s": percentile(ttfts, 90),
            **{
                f"{op}_p50_s": percentile(
                    [row.get(f"{op}_s") for row in rows if row["kind"] == kind], 50
                )
                for op in STORE_OPS
            },
        }
    out["misses"] = sum(1 for row in rows if row["kind"] == "miss")
    local, store = out["local"], out["store"]
    for q in ("p50_s", "p90_s"):
        out[f"store_over_local_{q[:3]}"] = (
            store[q] / local[q] if store[q] is not None and local[q] else None
        )
    return out


def run_transfer(args, procs: Processes, tmp: Path, transfer: str, tokenizer) -> dict:
    from services.stack import engine_cores

    # The store's own lease on reads (a bench default of 500 ms expires
    # before a busy TCP transfer thread gets to the read it was granted for).
    launch, store_proc = start_store(
        procs,
        tmp / f"store-{transfer}",
        pool_size=args.pool_size,
        transfer=transfer,
        lease_ttl_ms=KvStoreSettings().lease_ttl_ms,
    )
    flags = list(launch.engine_flags)
    if args.kv_blocks:
        flags += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    engines = []
    try:
        with ThreadPoolExecutor(2) as pool:  # start side by side
            futures = [
                pool.submit(start_engine, procs, "both", core, f"{transfer}-{i}", flags)
                for i, core in enumerate(engine_cores(2))
            ]
            engines = [f.result() for f in futures]
        clients = [c for _, c in engines]
        if args.replay:
            rows = replay(
                clients, tokenizer, args.sessions, args.turns, args.first_tokens, args.turn_tokens
            )
        else:
            rows = measure(launch, clients, tokenizer, args.lengths, args.rounds, args.suffix)
        return {"transfer": transfer, "summary": summarize(rows), "requests": rows}
    finally:
        for proc, client in engines:
            client.close()
            procs.stop(proc, STOP_GRACE_S)
        procs.stop(store_proc, STOP_GRACE_S)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", default="auto,tcp", help="store --transfer values to run")
    parser.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1024, 2048, 3072],
        help="prefix lengths in tokens",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--suffix", type=int, default=32, help="new tokens after the prefix")
    parser.add_argument("--pool-size", default="2GB")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        help="KV blocks per engine (--num-gpu-blocks-override; default: vLLM's; "
        "with --replay 34, one 4,096-token request and a block)",
    )
    replayed = parser.add_argument_group("agentic replay (--replay)")
    replayed.add_argument("--replay", action="store_true", help="play the replay instead")
    replayed.add_argument("--sessions", type=int, default=8)
    replayed.add_argument("--turns", type=int, default=4)
    replayed.add_argument("--first-tokens", type=int, default=1024)
    replayed.add_argument("--turn-tokens", type=int, default=256, help="new tokens a request")
    parser.add_argument("--json", type=Path, help="also write every request here")
    parser.add_argument(
        "--state", type=Path, help="keep the store's and engines' logs here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if args.replay and args.kv_blocks is None:
        # One request of max-model-len (vLLM keeps one block back): a
        # quarter of the contexts of the four sessions an engine serves.
        args.kv_blocks = MAX_MODEL_LEN // BLOCK_TOKENS + 2
    if args.replay and args.first_tokens + 2 * args.turns * (args.turn_tokens + 1) > MAX_MODEL_LEN:
        parser.error(f"the sessions' last requests would be over {MAX_MODEL_LEN} tokens")
    from transformers import AutoTokenizer

    from common.model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    results: list[dict] = []
    failed: list[str] = []
    with contextlib.ExitStack() as stack:
        if args.state:
            args.state.mkdir(parents=True, exist_ok=True)
            d = str(args.state)
        else:
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-storehits-"))
        procs = Processes(Path(d))
        try:
            for transfer in args.transfers.split(","):
                try:
                    results.append(run_transfer(args, procs, Path(d), transfer, tokenizer))
                except Exception as exc:  # report it, and still run the other transfers
                    print(f"{transfer}: failed: {exc!r}", file=sys.stderr)
                    failed.append(transfer)
        finally:
            procs.stop_all()
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    print("transfer | local n / p50 / p90 (s) | store n / p50 / p90 (s) | store/local p50, p90")
    for res in results:
        s = res["summary"]
        lo, st = s["local"], s["store"]
        print(
            f"{res['transfer']:8s} | {lo['n']} / {_s(lo['p50_s'])} / {_s(lo['p90_s'])} | "
            f"{st['n']} / {_s(st['p50_s'])} / {_s(st['p90_s'])} | "
            f"{_s(s['store_over_local_p50'])}, {_s(s['store_over_local_p90'])}"
            + (f"  ({s['misses']} misses left out)" if s["misses"] else "")
        )
        for kind in ("local", "store"):
            print(
                f"  {kind} hits, vLLM's store calls p50: "
                + ", ".join(f"{op} {_s(s[kind][f'{op}_p50_s'])} s" for op in STORE_OPS)
            )
        for length in [] if args.replay else args.lengths:
            by = summarize([row for row in res["requests"] if row["length"] == length])
            print(
                f"  {length:5d}-token prefix: local p50 {_s(by['local']['p50_s'])} s, "
                f"store p50 {_s(by['store']['p50_s'])} s, ratio {_s(by['store_over_local_p50'])}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if failed:
        print(f"failed: {', '.join(failed)} (see the errors above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
