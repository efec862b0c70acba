"""pack_blocks / unpack_blocks against their reference, bit for bit, on the
layouts vLLM 0.32 allocates (no mocks; the Triton path runs in Triton's
interpreter, see conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import (
    block_pages,
    pack_blocks,
    pack_blocks_reference,
    packed_block_bytes,
    unpack_blocks,
    unpack_blocks_reference,
)
from kernels.backend import interpreted
from kernels.packing import _page_copy_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
LAYOUTS = ["layer_outer", "block_outer", "token_major", "separate"]


def random_bytes(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen)


def make_layers(
    layout: str,
    dtype: torch.dtype,
    layers: int = 3,
    blocks: int = 6,
    heads: int = 2,
    block_size: int = 16,
    head_size: int = 8,
    seed: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer caches ``[blocks, heads, block_size, 2 * head_size]`` (vLLM's
    logical [B, H, N, C]) as vLLM lays them out, over random bytes (any bit
    pattern, NaNs included). Returns the layers and the raw buffer under them."""
    width = dtype.itemsize
    page = heads * block_size * 2 * head_size
    shape = (blocks, heads, block_size, 2 * head_size)
    if layout == "separate":  # own allocation per layer, page sizes differ
        caches = [
            random_bytes(blocks * (page + i * 2 * head_size * block_size) * width, seed + i)
            .view(dtype)
            .view(blocks, heads + i, block_size, -1)
            for i in range(layers)
        ]
        return caches, torch.empty(0)
    raw = random_bytes(layers * blocks * page * width, seed)
    flat = raw.view(dtype)
    if layout == "layer_outer":  # LBHNC: the CPU backend's layout
        caches = [
            flat[i * blocks * page : (i + 1) * blocks * page].view(shape) for i in range(layers)
        ]
    elif layout == "block_outer":  # BLHNC: a block's pages of every layer adjacent
        caches = [
            torch.as_strided(
                flat, shape, (layers * page, block_size * 2 * head_size, 2 * head_size, 1), i * page
            )
            for i in range(layers)
        ]
    else:  # LBNHC: tokens outer inside a page, logical view permuted
        caches = [
            flat[i * blocks * page : (i + 1) * blocks * page]
            .view(blocks, block_size, heads, 2 * head_size)
            .permute(0, 2, 1, 3)
            for i in range(layers)
        ]
    return caches, raw


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_triton_kernels_run_in_the_interpreter_and_the_flag_does_not_leak():
    assert interpreted(_page_copy_kernel)
    assert "TRITON_INTERPRET" not in os.environ


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_matches_reference_and_round_trips(layout, dtype, backend):
    layers, _ = make_layers(layout, dtype)
    block_ids = [4, 0, 5, 2]
    packed = pack_blocks(layers, block_ids, backend=backend)
    assert packed.dtype == torch.uint8
    assert packed.shape == (4, packed_block_bytes(layers))
    assert torch.equal(packed, pack_blocks_reference(layers, block_ids))

    restored = [torch.zeros_like(c) for c in layers]
    unpack_blocks(packed, restored, block_ids, backend=backend)
    for original, back in zip(layers, restored):
        for b in range(original.shape[0]):
            expected = original[b] if b in block_ids else torch.zeros_like(original[b])
            assert torch.equal(as_bytes(back[b]), as_bytes(expected)), (layout, b)


def test_unpack_matches_reference(backend):
    layers, _ = make_layers("layer_outer", torch.bfloat16, seed=3)
    rows = random_bytes(2 * packed_block_bytes(layers), 9).view(2, -1)
    ours = [c.clone() for c in layers]
    theirs = [c.clone() for c in layers]
    unpack_blocks(rows, ours, [5, 1], backend=backend)
    unpack_blocks_reference(rows, theirs, [5, 1])
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(ours, theirs))


def test_packed_row_is_the_store_connectors_multi_buffer_object():
    """vLLM's MooncakeStoreConnector puts a block as one object from one
    buffer per layer, (layer base + block * page, page) in layer order; the
    object is those bytes concatenated (checked against the real store in
    tests/kvstore/test_packing_store.py). The packed row is exactly that."""
    layers, raw = make_layers("layer_outer", torch.float32, layers=4, blocks=5)
    page = block_pages(layers[0]).shape[1]
    for b in range(5):
        expected = torch.cat([raw[(i * 5 + b) * page : (i * 5 + b + 1) * page] for i in range(4)])
        assert torch.equal(pack_blocks(layers, [b])[0], expected)


@pytest.mark.parametrize("block_ids", [[3], [5, 4, 3, 2, 1, 0], []], ids=["one", "all", "none"])
def test_one_all_and_no_blocks(block_ids, backend):
    layers, _ = make_layers("block_outer", torch.float16, seed=5)
    packed = pack_blocks(layers, torch.tensor(block_ids, dtype=torch.int64), backend=backend)
    assert torch.equal(packed, pack_blocks_reference(layers, block_ids))


@pytest.mark.parametrize("block_size,head_size", [(1, 3), (3, 5), (128, 4)])
def test_any_block_size_and_odd_page_bytes(block_size, head_size, backend):
    """Pages of 6, 30, ... bytes move as 2- or 1-byte words."""
    layers, _ = make_layers(
        "layer_outer",
        torch.float8_e4m3fn,
        layers=2,
        blocks=4,
        heads=1,
        block_size=block_size,
        head_size=head_size,
        seed=block_size,
    )
    packed = pack_blocks(layers, [2, 0], backend=backend)
    assert torch.equal(packed, pack_blocks_reference(layers, [2, 0]))
    restored = [torch.zeros_like(c) for c in layers]
    unpack_blocks(packed, restored, [2, 0], backend=backend)
    assert all(torch.equal(as_bytes(r[2]), as_bytes(c[2])) for r, c in zip(restored, layers))


def test_into_a_misaligned_staging_buffer(backend):
    """A row buffer at an odd address still works (bytes instead of words)."""
    layers, _ = make_layers("layer_outer", torch.float32, seed=11)
    row_bytes = packed_block_bytes(layers)
    staging = torch.zeros(2 * row_bytes + 1, dtype=torch.uint8)
    out = staging[1:].view(2, row_bytes)
    assert out.data_ptr() % 2 == 1
    pack_blocks(layers, [1, 3], out=out, backend=backend)
    assert torch.equal(out, pack_blocks_reference(layers, [1, 3]))
    assert staging[0] == 0


def test_bad_input_is_refused_with_the_reason():
    layers, _ = make_layers("layer_outer", torch.float32)
    with pytest.raises(ValueError, match=r"lie in \[0, 6\)"):
        pack_blocks(layers, [6])
    with pytest.raises(ValueError, match="same block twice"):
        unpack_blocks(pack_blocks(layers, [1, 1]), layers, [1, 1])
    with pytest.raises(ValueError, match="contiguous uint8"):
        pack_blocks(layers, [1], out=torch.empty(1, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="num_blocks"):
        pack_blocks([layers[0], layers[1][:3]], [0])
    overlapping = torch.as_strided(torch.zeros(64), (4, 2, 8), (4, 8, 1))
    with pytest.raises(ValueError, match="overlap"):
        pack_blocks([overlapping], [0])
    gappy = torch.zeros(4, 2, 16)[:, :, :8]
    with pytest.raises(ValueError, match="dense run"):
        pack_blocks([gappy], [0])
    with pytest.raises(ValueError, match="backend"):
        pack_blocks(layers, [0], backend="cuda")
