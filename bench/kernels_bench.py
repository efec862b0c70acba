"""Kernel benchmark on this machine's CPU, every figure beside its baseline in one run.

1. **Kernels vs memcpy**: each kernel's CPU path (``kernels``, backend
   ``torch``) against ``torch`` copying the same bytes, interleaved round by
   round. Bandwidth counts bytes read plus bytes written, for the copy too,
   so the ratio is the kernel's share of this machine's copy bandwidth.
2. **Store put/get per block, packed vs per layer**: a real KV store (Mooncake
   master and pool owner), a requester holding a SmolLM2-sized CPU KV cache
   (30 layers, 128-token blocks, float32: 5.6 MiB per block) registered as
   vLLM registers it; blocks put and got with vLLM's descriptors (one buffer
   per layer, ``batch_*_multi_buffers``) and through
   ``services.kvstore.packing.PackingStore`` (one packed buffer per block),
   interleaved, fresh keys every round.

    python -m bench.kernels_bench [--rounds 7] [--skip-store] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels import (
    cpu_backend_token_view,
    merge_partial_attention,
    pack_blocks,
    packed_block_bytes,
    reassemble_shards,
    shard_lengths,
    shard_tokens,
    unpack_blocks,
)

# SmolLM2-135M on vLLM's CPU backend: 30 layers, 3 KV heads of 64, float32.
LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 64, 128


@dataclass
class Case:
    name: str
    shape: str
    run: Callable[[], object]
    bytes_read: int
    bytes_written: int


def cpu_cache(blocks: int, layers: int = LAYERS) -> list[torch.Tensor]:
    """Per-layer views over one allocation, as vLLM 0.32 lays out the CPU cache."""
    page = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE
    raw = torch.rand(layers * blocks * page)
    return [
        raw[i * blocks * page : (i + 1) * blocks * page].view(
            blocks, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE
        )
        for i in range(layers)
    ]


def kernel_cases(blocks: int, tokens: int, ranks: int, queries: int) -> list[Case]:
    layers = cpu_cache(blocks * 2)
    ids = torch.randperm(blocks * 2)[:blocks]
    rows = pack_blocks(layers, ids)
    payload = rows.numel()

    token_blocks = -(-tokens // BLOCK_SIZE)
    full = cpu_backend_token_view(torch.rand(token_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE))
    table = torch.randperm(token_blocks)
    per_rank = -(-max(shard_lengths(tokens, ranks)) // BLOCK_SIZE)
    shards = [
        cpu_backend_token_view(torch.zeros(per_rank, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE))
        for _ in range(ranks)
    ]
    shard_table = torch.randperm(per_rank)
    token_bytes = tokens * 2 * HEADS * HEAD_SIZE * 4

    query_heads = 9
    outputs = torch.rand(ranks, queries, query_heads, HEAD_SIZE)
    lses = torch.rand(ranks, queries, query_heads) * 10
    merge_read = outputs.numel() * 4 + lses.numel() * 4
    merge_written = queries * query_heads * (HEAD_SIZE + 1) * 4

    return [
        Case(
            "pack_blocks",
            f"{blocks} blocks x {LAYERS} layers, {payload >> 20} MiB",
            lambda: pack_blocks(layers, ids, out=rows, backend="torch"),
            payload,
            payload,
        ),
        Case(
            "unpack_blocks",
            f"{blocks} blocks x {LAYERS} layers, {payload >> 20} MiB",
            lambda: unpack_blocks(rows, layers, ids, backend="torch"),
            payload,
            payload,
        ),
        Case(
            "shard_tokens",
            f"{tokens} tokens -> {ranks} ranks, {token_bytes >> 20} MiB",
            lambda: shard_tokens(full, table, tokens, shards, shard_table, backend="torch"),
            token_bytes,
            token_bytes,
        ),
        Case(
            "reassemble_shards",
            f"{ranks} ranks -> {tokens} tokens, {token_bytes >> 20} MiB",
            lambda: reassemble_shards(shards, shard_table, tokens, full, table, backend="torch"),
            token_bytes,
            token_bytes,
        ),
        Case(
            "merge_partial_attention",
            f"{ranks} x {queries} tokens x {query_heads} heads, {merge_read >> 20} MiB in",
            lambda: merge_partial_attention(outputs, lses, backend="torch"),
            merge_read,
            merge_written,
        ),
    ]


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def bench_kernels(rounds: int, blocks: int, tokens: int, ranks: int, queries: int) -> list[dict]:
    results = []
    for case in kernel_cases(blocks, tokens, ranks, queries):
        # memcpy of the bytes the kernel writes (it reads as many or more).
        src = torch.rand(case.bytes_written // 4 + 1)
        dst = torch.empty_like(src)
        copy_traffic = 2 * src.numel() * 4
        case.run()
        dst.copy_(src)  # warm: pages faulted in, allocator primed
        kernel_s, copy_s = [], []
        for _ in range(rounds):
            copy_s.append(timed(dst.copy_, src)[0])
            kernel_s.append(timed(case.run)[0])
        kernel_gbps = (case.bytes_read + case.bytes_written) / statistics.median(kernel_s) / 1e9
        copy_gbps = copy_traffic / statistics.median(copy_s) / 1e9
        results.append(
            {
                "kernel": case.name,
                "shape": case.shape,
                "ms": statistics.median(kernel_s) * 1e3,
                "gbps": kernel_gbps,
                "memcpy_gbps": copy_gbps,
                "ratio": kernel_gbps / copy_gbps,
            }
        )
    return results


# -- 2. store put/get per block ------------------------------------------------


def start_store(tmp: Path, pool_size: str):
    from common.ports import free_ports
    from services.kvstore.api import store_launch, wait_ready

    launch = store_launch(
        tmp / "kvstore", ports=free_ports(6), pool_size=pool_size, enable_disk=False
    )
    with open(tmp / "kvstore.log", "wb") as log:
        proc = subprocess.Popen(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(launch.health_url, 180, alive=lambda: proc.poll() is None)
    return launch, proc


def bench_store(rounds: int, batches: list[int], staging: int) -> dict:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata,
        RankLocalStoreLayout,
    )

    from services.kvstore.packing import BlockPacker, PackingStore

    blocks = 2 * max(batches)
    layers = cpu_cache(blocks)
    targets = cpu_cache(blocks)
    row_bytes = packed_block_bytes(layers)
    pool = 3 * max(batches) * row_bytes * 2
    with tempfile.TemporaryDirectory(prefix="tandem-kernels-bench-") as d:
        launch, proc = start_store(Path(d), f"{pool >> 20}MB")
        store = MooncakeDistributedStore()
        try:
            s = launch.settings
            if (
                store.setup("127.0.0.1", s.metadata_url, 0, 64 << 20, "tcp", "", s.master_address)
                != 0
            ):
                raise RuntimeError("Mooncake requester setup failed")
            for cache in (layers, targets):  # vLLM registers the cache's storage
                storage = cache[0].untyped_storage()
                if store.register_buffer(storage.data_ptr(), storage.nbytes()) != 0:
                    raise RuntimeError("register_buffer failed for the KV cache")
            layouts = []
            for cache in (layers, targets):
                layout = RankLocalStoreLayout(
                    KeyMetadata("bench", 0, 0, 0, 0), BLOCK_SIZE, BLOCK_SIZE
                )
                layout.register_kv_caches(cache, blocks)
                layouts.append(layout)
            packers = [
                BlockPacker.for_regions(c, lay.kv_caches_base_addr, lay.block_len)
                for c, lay in zip((layers, targets), layouts)
            ]
            writer = PackingStore(store, packers[0], staging)
            reader = PackingStore(store, packers[1], staging)
            config = ReplicateConfig()
            rows = []
            for batch in batches:
                src_ids = torch.randperm(blocks)[:batch].tolist()
                dst_ids = torch.randperm(blocks)[:batch].tolist()
                src = [layouts[0].prepare_value_for_block(b) for b in src_ids]
                dst = [layouts[1].prepare_value_for_block(b) for b in dst_ids]
                addrs, sizes = [a for a, _ in src], [z for _, z in src]
                taddrs, tsizes = [a for a, _ in dst], [z for _, z in dst]
                times: dict[str, list[float]] = {
                    k: [] for k in ("put_layers", "put_packed", "get_layers", "get_packed")
                }
                for r in range(rounds + 1):  # round 0 warms up
                    for mode, client in (("layers", store), ("packed", writer)):
                        keys = [f"{mode}-{batch}-{r}-{i}" for i in range(batch)]
                        t, put = timed(
                            client.batch_put_from_multi_buffers, keys, addrs, sizes, config
                        )
                        getter = store if mode == "layers" else reader
                        g, got = timed(getter.batch_get_into_multi_buffers, keys, taddrs, tsizes)
                        _ok(put, 0)
                        _ok(got, row_bytes)
                        if r == 0:
                            _check_loaded(layers, src_ids, targets, dst_ids)
                        else:
                            times[f"put_{mode}"].append(t)
                            times[f"get_{mode}"].append(g)
                        store.batch_remove(keys, True)  # free the pool (reads lease them)
                per_block = {k: statistics.median(v) / batch * 1e3 for k, v in times.items()}
                rows.append(
                    {
                        "blocks_per_call": batch,
                        **{f"{k}_ms": v for k, v in per_block.items()},
                        "put_ratio": per_block["put_layers"] / per_block["put_packed"],
                        "get_ratio": per_block["get_layers"] / per_block["get_packed"],
                    }
                )
            return {
                "block_bytes": row_bytes,
                "descriptors_per_block_layers": len(layers),
                "descriptors_per_block_packed": 1,
                "rows": rows,
                "rows_per_store_call": writer.rows_per_call,
            }
        finally:
            store.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _ok(results: list[int], expected: int) -> None:
    if any(r != expected for r in results):
        raise RuntimeError(f"store call failed: {sorted(set(results))}")


def _check_loaded(
    src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]
) -> None:
    for a, b in zip(src, dst):
        if not torch.equal(a[src_ids], b[dst_ids]):
            raise RuntimeError("a block read back differs from the block written")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per figure")
    parser.add_argument(
        "--blocks",
        type=int,
        default=12,
        help="blocks per pack/unpack call (12 = a 1.5K-token prompt)",
    )
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per DCP call")
    parser.add_argument("--ranks", type=int, default=4, help="DCP ranks")
    parser.add_argument("--queries", type=int, default=8192, help="tokens per merge call")
    parser.add_argument(
        "--store-batches", default="1,4,12", help="blocks per store call, comma-separated"
    )
    parser.add_argument(
        "--staging-size",
        default="128MB",
        help="packing staging buffer (the store's --pack-staging-size)",
    )
    parser.add_argument("--skip-store", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from services.kvstore.settings import parse_size

    report: dict = {
        "threads": torch.get_num_threads(),
        "kernels": bench_kernels(args.rounds, args.blocks, args.tokens, args.ranks, args.queries),
    }
    if not args.skip_store:
        report["store"] = bench_store(
            args.rounds,
            [int(b) for b in args.store_batches.split(",")],
            parse_size(args.staging_size),
        )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"Kernels, CPU path, {report['threads']} torch threads "
        "(GB/s = bytes read + written per second; memcpy the same way):"
    )
    print(f"  {'kernel':<24} {'ms':>8} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}  shape")
    for k in report["kernels"]:
        print(
            f"  {k['kernel']:<24} {k['ms']:8.2f} {k['gbps']:7.2f} {k['memcpy_gbps']:7.2f} "
            f"{k['ratio']:6.2f}  {k['shape']}"
        )
    if "store" in report:
        st = report["store"]
        print(
            f"\nKV store put/get per block ({st['block_bytes'] / (1 << 20):.2f} MiB blocks; "
            f"descriptors per block: {st['descriptors_per_block_layers']} per layer, "
            f"{st['descriptors_per_block_packed']} packed):"
        )
        print(
            f"  {'blocks/call':>11} {'put layers':>11} {'put packed':>11} {'ratio':>6} "
            f"{'get layers':>11} {'get packed':>11} {'ratio':>6}   (ms per block)"
        )
        for row in st["rows"]:
            print(
                f"  {row['blocks_per_call']:>11} {row['put_layers_ms']:11.2f} "
                f"{row['put_packed_ms']:11.2f} {row['put_ratio']:6.2f} "
                f"{row['get_layers_ms']:11.2f} {row['get_packed_ms']:11.2f} "
                f"{row['get_ratio']:6.2f}"
            )
        print("  ratio = per-layer time / packed time (above 1: packing is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
