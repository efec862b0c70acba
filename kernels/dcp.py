"""DCP token shards ↔ one complete paged KV layout.

With decode context parallelism over ``R`` ranks, vLLM spreads a request's
tokens round-robin: token ``t`` lives on rank ``(t // I) % R`` (``I`` is
``cp_kv_cache_interleave_size``, 1 by default) at that rank's local position
``j = (t // (I * R)) * I + t % I``, i.e. in its block ``j // block_size`` of
the rank's block table at offset ``j % block_size``. vLLM gives every rank the
same block table (a "virtual block" of ``block_size * R`` tokens spans the
same block id on every rank), which a 1-D ``shard_block_table`` expresses; a
2-D one gives each rank its own.

:func:`reassemble_shards` turns such shards (prefill ranks' KV) into a rank's
complete paged layout: token ``t`` at block ``block_table[t // block_size]``,
offset ``t % block_size`` — the layout a decode engine without DCP reads, and
whose full blocks hash exactly as the unsharded prompt's (prefix reuse
survives). :func:`shard_tokens` is the inverse. Lengths need not be a
multiple of ``R``, of ``I`` or of either block size.

A cache here is a token view ``[num_blocks, block_size, *features]`` (any
strides); :func:`cpu_backend_token_view` makes one from vLLM's CPU backend
page. Shards and the full layout share dtype and feature shape; their block
sizes and strides may differ. One call moves one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import backend as backends

# Elements one Triton program moves (tokens x features).
_TILE = 4096


def shard_lengths(num_tokens: int, num_shards: int, interleave: int = 1) -> list[int]:
    """How many of ``num_tokens`` tokens each rank holds."""
    _check_split(num_tokens, num_shards, interleave)
    stride = interleave * num_shards
    base = num_tokens // stride * interleave
    rest = num_tokens - base * num_shards
    return [base + min(max(rest - r * interleave, 0), interleave) for r in range(num_shards)]


def cpu_backend_token_view(cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU attention cache ``[num_blocks, heads, block_size, 2 * head_size]``
    as a token view ``[num_blocks, block_size, 2 * heads, head_size]`` (no copy).

    The backend reads each head's page as ``[2 * block_size, head_size]``: the
    K rows of the block's tokens, then their V rows. Feature row ``2h`` of a
    token is its K for head ``h``, row ``2h + 1`` its V."""
    blocks, heads, block_size, width = cache.shape
    return cache.view(blocks, heads, 2, block_size, width // 2).permute(0, 3, 1, 2, 4).flatten(2, 3)


def reassemble_shards(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    *,
    interleave: int = 1,
    backend: str = "auto",
) -> None:
    """Write the first ``num_tokens`` tokens held by ``shards`` (rank ``r``'s
    cache is ``shards[r]``) into ``full`` at the slots ``block_table`` gives."""
    _move(
        shards, shard_block_table, num_tokens, full, block_table, interleave, backend, to_full=True
    )


def shard_tokens(
    full: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    *,
    interleave: int = 1,
    backend: str = "auto",
) -> None:
    """Spread the first ``num_tokens`` tokens of ``full`` over ``shards``
    round-robin (the inverse of :func:`reassemble_shards`)."""
    _move(
        shards, shard_block_table, num_tokens, full, block_table, interleave, backend, to_full=False
    )


# -- reference: what is correct ------------------------------------------------


def reassemble_shards_reference(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    interleave: int = 1,
) -> None:
    for t, (r, j) in enumerate(_placements(num_tokens, len(shards), interleave)):
        src = shards[r][
            _table_row(shard_block_table, r)[j // shards[r].shape[1]], j % shards[r].shape[1]
        ]
        full[block_table[t // full.shape[1]], t % full.shape[1]] = src


def shard_tokens_reference(
    full: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    interleave: int = 1,
) -> None:
    for t, (r, j) in enumerate(_placements(num_tokens, len(shards), interleave)):
        src = full[block_table[t // full.shape[1]], t % full.shape[1]]
        shards[r][
            _table_row(shard_block_table, r)[j // shards[r].shape[1]], j % shards[r].shape[1]
        ] = src


def _placements(num_tokens: int, num_shards: int, interleave: int) -> list[tuple[int, int]]:
    """(rank, local position) of every token, in token order."""
    return [
        (
            (t // interleave) % num_shards,
            t // (interleave * num_shards) * interleave + t % interleave,
        )
        for t in range(num_tokens)
    ]


def _table_row(table: torch.Tensor, rank: int) -> torch.Tensor:
    return table if table.dim() == 1 else table[rank]


# -- vectorized torch and Triton ------------------------------------------------


def _move(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    interleave: int,
    backend: str,
    to_full: bool,
) -> None:
    _check(shards, shard_block_table, num_tokens, full, block_table, interleave)
    chosen = backends.resolve(backend, full.device, _token_copy_kernel)
    if chosen == "reference":
        if to_full:
            reassemble_shards_reference(
                shards, shard_block_table, num_tokens, full, block_table, interleave
            )
        else:
            shard_tokens_reference(
                full, block_table, num_tokens, shards, shard_block_table, interleave
            )
    elif chosen == "torch":
        _move_torch(shards, shard_block_table, num_tokens, full, block_table, interleave, to_full)
    elif num_tokens:
        _move_triton(shards, shard_block_table, num_tokens, full, block_table, interleave, to_full)


def _move_torch(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    interleave: int,
    to_full: bool,
) -> None:
    device = full.device
    num_shards = len(shards)
    table = block_table.to(device=device, dtype=torch.int64)
    shard_table = shard_block_table.to(device=device, dtype=torch.int64)
    for r, count in enumerate(shard_lengths(num_tokens, num_shards, interleave)):
        if not count:
            continue
        j = torch.arange(count, device=device)
        t = j // interleave * (interleave * num_shards) + r * interleave + j % interleave
        shard = shards[r]
        shard_slots = (_table_row(shard_table, r)[j // shard.shape[1]], j % shard.shape[1])
        full_slots = (table[t // full.shape[1]], t % full.shape[1])
        if to_full:
            full[full_slots] = shard[shard_slots]
        else:
            shard[shard_slots] = full[full_slots]


@triton.jit
def _token_copy_kernel(
    full,
    full_block_stride,
    full_token_stride,
    full_run_stride,
    shard_bases,
    shard_block_stride,
    shard_token_stride,
    shard_run_stride,
    block_table,
    shard_block_table,
    shard_table_stride,
    num_tokens,
    num_shards,
    interleave,
    run_len,
    features,
    FULL_BLOCK: tl.constexpr,
    SHARD_BLOCK: tl.constexpr,
    TO_FULL: tl.constexpr,
    TOKENS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program moves a tile: TOKENS tokens x CHUNK of their features.
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    f = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    token_mask = t < num_tokens
    rank = (t // interleave) % num_shards
    j = t // (interleave * num_shards) * interleave + t % interleave
    shard_block = tl.load(
        shard_block_table + rank * shard_table_stride + j // SHARD_BLOCK, mask=token_mask, other=0
    ).to(tl.int64)
    full_block = tl.load(block_table + t // FULL_BLOCK, mask=token_mask, other=0).to(tl.int64)
    shard_base = tl.load(shard_bases + rank, mask=token_mask, other=0).to(full.dtype)
    shard_slot = (
        shard_base + shard_block * shard_block_stride + (j % SHARD_BLOCK) * shard_token_stride
    )
    full_slot = full + full_block * full_block_stride + (t % FULL_BLOCK) * full_token_stride
    feature_offset = (f // run_len)[None, :]
    shard_ptrs = shard_slot[:, None] + feature_offset * shard_run_stride + (f % run_len)[None, :]
    full_ptrs = full_slot[:, None] + feature_offset * full_run_stride + (f % run_len)[None, :]
    mask = token_mask[:, None] & (f < features)[None, :]
    if TO_FULL:
        tl.store(full_ptrs, tl.load(shard_ptrs, mask=mask), mask=mask)
    else:
        tl.store(shard_ptrs, tl.load(full_ptrs, mask=mask), mask=mask)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _runs(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as ``[num_blocks, block_size, runs, run_len]`` with contiguous
    runs, reinterpreted as integers of the same width (bits move unchanged)."""
    blocks, block_size = cache.shape[:2]
    try:
        if cache.dim() == 2:
            runs = cache.view(blocks, block_size, 1, 1)
        elif cache.dim() == 3:
            runs = cache.unsqueeze(2)
        else:
            runs = cache.view(blocks, block_size, -1, cache.shape[-1])
    except RuntimeError:
        runs = None
    if runs is None or (runs.shape[3] > 1 and runs.stride(3) != 1):
        raise ValueError(
            f"the Triton path needs each token's features as runs of contiguous "
            f"elements; shape {tuple(cache.shape)} with strides {cache.stride()} "
            "is not (use backend='torch')"
        )
    return runs.view(_INT_OF_SIZE[cache.element_size()])


def _move_triton(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    interleave: int,
    to_full: bool,
) -> None:
    full_runs = _runs(full)
    shard_runs = [_runs(s) for s in shards]
    strides = {s.stride() for s in shard_runs}
    if len(strides) != 1:
        raise ValueError(
            f"the Triton path needs every shard laid out alike, got strides {sorted(strides)}"
        )
    first = shard_runs[0]
    device = full.device
    bases = torch.tensor([s.data_ptr() for s in shard_runs], dtype=torch.int64, device=device)
    table = block_table.to(device=device, dtype=torch.int64).contiguous()
    shard_table = shard_block_table.to(device=device, dtype=torch.int64).contiguous()
    table_stride = 0 if shard_table.dim() == 1 else shard_table.stride(0)
    features = full_runs.shape[2] * full_runs.shape[3]
    chunk = min(_TILE, triton.next_power_of_2(features))
    tokens = min(_TILE // chunk, triton.next_power_of_2(num_tokens))
    grid = (triton.cdiv(num_tokens, tokens), triton.cdiv(features, chunk))
    _token_copy_kernel[grid](
        full_runs,
        full_runs.stride(0),
        full_runs.stride(1),
        full_runs.stride(2),
        bases,
        first.stride(0),
        first.stride(1),
        first.stride(2),
        table,
        shard_table,
        table_stride,
        num_tokens,
        len(shards),
        interleave,
        full_runs.shape[3],
        features,
        FULL_BLOCK=full.shape[1],
        SHARD_BLOCK=first.shape[1],
        TO_FULL=to_full,
        TOKENS=tokens,
        CHUNK=chunk,
    )


# -- checks -------------------------------------------------------------------------


def _check_split(num_tokens: int, num_shards: int, interleave: int) -> None:
    if num_shards < 1:
        raise ValueError(f"need at least one shard, got {num_shards}")
    if interleave < 1:
        raise ValueError(f"interleave must be at least 1, got {interleave}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must not be negative, got {num_tokens}")


def _check(
    shards: Sequence[torch.Tensor],
    shard_block_table: torch.Tensor,
    num_tokens: int,
    full: torch.Tensor,
    block_table: torch.Tensor,
    interleave: int,
) -> None:
    lengths = shard_lengths(num_tokens, len(shards), interleave)
    if full.dim() < 2:
        raise ValueError(f"full must be [num_blocks, block_size, ...], got {tuple(full.shape)}")
    _check_table("block_table", block_table, -(-num_tokens // full.shape[1]), full.shape[0])
    if shard_block_table.dim() == 2 and shard_block_table.shape[0] != len(shards):
        raise ValueError(
            f"shard_block_table has {shard_block_table.shape[0]} rows for {len(shards)} shards"
        )
    if shard_block_table.dim() not in (1, 2):
        raise ValueError(
            "shard_block_table must be 1-D (shared by every rank) or 2-D (a row per rank)"
        )
    for r, (shard, count) in enumerate(zip(shards, lengths)):
        if (
            shard.dtype != full.dtype
            or shard.device != full.device
            or shard.shape[2:] != full.shape[2:]
            or shard.dim() < 2
        ):
            raise ValueError(
                f"shards[{r}] is {shard.dtype} {tuple(shard.shape)} on "
                f"{shard.device}; full is {full.dtype} {tuple(full.shape)} on "
                f"{full.device}: dtype, device and features must match"
            )
        _check_table(
            f"shard_block_table (rank {r})",
            _table_row(shard_block_table, r),
            -(-count // shard.shape[1]),
            shard.shape[0],
        )


def _check_table(name: str, table: torch.Tensor, needed: int, num_blocks: int) -> None:
    if table.dim() != 1 or table.numel() < needed:
        raise ValueError(f"{name}: needs at least {needed} entries, has shape {tuple(table.shape)}")
    used = table[:needed]
    if needed and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(
            f"{name}: block ids must lie in [0, {num_blocks}), got "
            f"{int(used.min())}..{int(used.max())}"
        )
