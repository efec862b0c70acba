"""Kernel benchmark on one GPU: each Triton kernel (and the torch path beside
it) against the device's own copy bandwidth, measured in the same run.

For a GPU machine (CUDA and Triton's CUDA backend); sized to finish in well
under 5 minutes on one GPU, most of it Triton compiling. Every kernel is first
checked against the torch path on the device (bit-exact moves, merge within
float32 tolerance); a mismatch stops the run. Bandwidth counts bytes read
plus bytes written, for the copy too (``dst.copy_(src)``), so the ratio is the
kernel's share of the device's copy bandwidth.

    python -m bench.kernels_gpu [--json] [--scale 1.0]

Shapes: a Llama-3-70B-like cache (80 layers, 8 KV heads of 128, bf16,
16-token blocks, vLLM's default LBNHC layout: 64 KiB pages) for packing, a
128K-token context over 8 DCP ranks for shard/reassemble, and 8 ranks x 16K
tokens x 64 heads x 128 for the merge; ``--scale`` shrinks or grows them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from kernels import (
    merge_partial_attention,
    pack_blocks,
    reassemble_shards,
    shard_lengths,
    shard_tokens,
    unpack_blocks,
)

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 80, 8, 128, 16
DTYPE = torch.bfloat16


def gpu_time_ms(fn: Callable[[], Any], rounds: int) -> float:
    """Median of ``rounds`` CUDA-event-timed calls, after two warm-up calls
    (the first compiles the Triton kernel)."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(nbytes: int, rounds: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    ms = gpu_time_ms(lambda: dst.copy_(src), rounds)
    return 2 * nbytes / ms / 1e6


def nhd_cache(blocks: int) -> list[torch.Tensor]:
    """Per-layer [B, H, N, 2*head] views, token-major inside a page (LBNHC)."""
    page = BLOCK_SIZE * KV_HEADS * 2 * HEAD_SIZE
    raw = torch.empty(LAYERS * blocks * page, dtype=DTYPE, device="cuda").normal_()
    return [
        raw[i * blocks * page : (i + 1) * blocks * page]
        .view(blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE)
        .permute(0, 2, 1, 3)
        for i in range(LAYERS)
    ]


def token_view(blocks: int, block_size: int) -> torch.Tensor:
    """Token-major [B, N, H, 2*head] (FlashAttention's cell: K then V)."""
    return torch.zeros(blocks, block_size, KV_HEADS, 2 * HEAD_SIZE, dtype=DTYPE, device="cuda")


def case_packing(scale: float, rounds: int) -> list[dict]:
    cache_blocks = max(8, int(2048 * scale))
    batch = max(1, int(256 * scale))
    layers = nhd_cache(cache_blocks)
    ids = torch.randperm(cache_blocks, device="cuda")[:batch]
    rows = pack_blocks(layers, ids, backend="torch")
    check = pack_blocks(layers, ids, backend="triton")
    if not torch.equal(rows, check):
        raise RuntimeError("pack_blocks: triton differs from torch on the GPU")
    restored = [torch.zeros_like(c) for c in layers]
    unpack_blocks(rows, restored, ids, backend="triton")
    if not all(torch.equal(r[ids], c[ids]) for r, c in zip(restored, layers)):
        raise RuntimeError("unpack_blocks: the round trip is not exact on the GPU")
    traffic = 2 * rows.numel()
    shape = f"{batch} blocks x {LAYERS} layers, {rows.numel() >> 20} MiB"
    out = []
    for backend in ("triton", "torch"):
        ms = gpu_time_ms(lambda b=backend: pack_blocks(layers, ids, out=rows, backend=b), rounds)
        out.append(
            {
                "kernel": "pack_blocks",
                "backend": backend,
                "shape": shape,
                "ms": ms,
                "gbps": traffic / ms / 1e6,
            }
        )
        ms = gpu_time_ms(lambda b=backend: unpack_blocks(rows, restored, ids, backend=b), rounds)
        out.append(
            {
                "kernel": "unpack_blocks",
                "backend": backend,
                "shape": shape,
                "ms": ms,
                "gbps": traffic / ms / 1e6,
            }
        )
    return out


def case_dcp(scale: float, rounds: int) -> list[dict]:
    ranks, tokens = 8, max(1024, int(131072 * scale))
    full_blocks = -(-tokens // BLOCK_SIZE)
    full = token_view(full_blocks, BLOCK_SIZE).normal_()
    table = torch.randperm(full_blocks, device="cuda")
    per_rank = -(-max(shard_lengths(tokens, ranks)) // BLOCK_SIZE)
    shards = [token_view(per_rank, BLOCK_SIZE) for _ in range(ranks)]
    shard_table = torch.randperm(per_rank, device="cuda")  # shared by every rank, as vLLM
    shard_tokens(full, table, tokens, shards, shard_table, backend="triton")
    expected = [token_view(per_rank, BLOCK_SIZE) for _ in range(ranks)]
    shard_tokens(full, table, tokens, expected, shard_table, backend="torch")
    if not all(torch.equal(a, b) for a, b in zip(shards, expected)):
        raise RuntimeError("shard_tokens: triton differs from torch on the GPU")
    rebuilt = torch.zeros_like(full)
    reassemble_shards(shards, shard_table, tokens, rebuilt, table, backend="triton")
    if not torch.equal(rebuilt[table].flatten(0, 1)[:tokens], full[table].flatten(0, 1)[:tokens]):
        raise RuntimeError("reassemble_shards: the round trip is not exact on the GPU")
    nbytes = tokens * KV_HEADS * 2 * HEAD_SIZE * DTYPE.itemsize
    shape = f"{tokens} tokens, {ranks} ranks, {nbytes >> 20} MiB"
    out = []
    for backend in ("triton", "torch"):
        ms = gpu_time_ms(
            lambda b=backend: shard_tokens(full, table, tokens, shards, shard_table, backend=b),
            rounds,
        )
        out.append(
            {
                "kernel": "shard_tokens",
                "backend": backend,
                "shape": shape,
                "ms": ms,
                "gbps": 2 * nbytes / ms / 1e6,
            }
        )
        ms = gpu_time_ms(
            lambda b=backend: reassemble_shards(
                shards, shard_table, tokens, rebuilt, table, backend=b
            ),
            rounds,
        )
        out.append(
            {
                "kernel": "reassemble_shards",
                "backend": backend,
                "shape": shape,
                "ms": ms,
                "gbps": 2 * nbytes / ms / 1e6,
            }
        )
    return out


def case_merge(scale: float, rounds: int) -> list[dict]:
    ranks, tokens, heads = 8, max(256, int(16384 * scale)), 64
    outputs = torch.randn(ranks, tokens, heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
    lses = torch.randn(ranks, tokens, heads, device="cuda") * 10
    lses[0, :16] = float("-inf")
    ours, our_lse = merge_partial_attention(outputs, lses, backend="triton")
    theirs, their_lse = merge_partial_attention(outputs, lses, backend="torch")
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(our_lse, their_lse, rtol=1e-5, atol=1e-5)
    traffic = (
        outputs.numel() * outputs.element_size()
        + lses.numel() * 4
        + ours.numel() * ours.element_size()
        + our_lse.numel() * 4
    )
    shape = f"{ranks} ranks x {tokens} tokens x {heads} heads x {HEAD_SIZE}"
    out = []
    for backend in ("triton", "torch"):
        ms = gpu_time_ms(
            lambda b=backend: merge_partial_attention(outputs, lses, backend=b), rounds
        )
        out.append(
            {
                "kernel": "merge_partial_attention",
                "backend": backend,
                "shape": shape,
                "ms": ms,
                "gbps": traffic / ms / 1e6,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scale", type=float, default=1.0, help="grow or shrink every shape")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error(
            "no CUDA device: this benchmark needs a GPU (bench/kernels_bench.py is the CPU one)"
        )
    memcpy = copy_gbps(1 << 30, args.rounds)
    results = [
        *case_packing(args.scale, args.rounds),
        *case_dcp(args.scale, args.rounds),
        *case_merge(args.scale, args.rounds),
    ]
    for row in results:
        row["ratio"] = row["gbps"] / memcpy
    report = {"device": torch.cuda.get_device_name(), "memcpy_gbps": memcpy, "kernels": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['device']}: device copy {memcpy:.0f} GB/s (1 GiB, read + written)")
    print(f"  {'kernel':<24} {'backend':<7} {'ms':>8} {'GB/s':>8} {'ratio':>6}  shape")
    for row in results:
        print(
            f"  {row['kernel']:<24} {row['backend']:<7} {row['ms']:8.3f} {row['gbps']:8.0f} "
            f"{row['ratio']:6.2f}  {row['shape']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
