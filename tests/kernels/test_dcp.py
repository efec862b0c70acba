"""shard_tokens / reassemble_shards against their reference, bit for bit, and
what reassembly must keep: every token's KV in its slot, and the complete
blocks hashing as the unsharded prompt's (vLLM prefix-cache hashes, from the
router's standalone implementation). No mocks; the Triton path runs in
Triton's interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    cpu_backend_token_view,
    reassemble_shards,
    reassemble_shards_reference,
    shard_lengths,
    shard_tokens,
    shard_tokens_reference,
)
from services.router.routing.hashing import BlockHasher

HEADS, HEAD_SIZE = 2, 4


def cpu_cache(
    blocks: int, block_size: int, dtype: torch.dtype = torch.float32, seed: int | None = None
) -> torch.Tensor:
    """A token view of vLLM's CPU backend cache, zeros or random bits."""
    shape = (blocks, HEADS, block_size, 2 * HEAD_SIZE)
    if seed is None:
        raw = torch.zeros(shape, dtype=dtype)
    else:
        gen = torch.Generator().manual_seed(seed)
        numel = blocks * HEADS * block_size * 2 * HEAD_SIZE * dtype.itemsize
        raw = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen)
        raw = raw.view(dtype).view(shape)
    return cpu_backend_token_view(raw)


def permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def tokens_of(cache: torch.Tensor, table: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` tokens of a paged cache, in token order."""
    return torch.cat([cache[b] for b in table.tolist()])[:count]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def vllm_slot(t: int, ranks: int, rank: int, block_size: int, interleave: int):
    """vLLM's DCP slot mapping (vllm/v1/worker/block_table.py), by virtual block:
    (virtual block index, local offset) if token t is on ``rank``, else None."""
    virtual = block_size * ranks
    index, offset = divmod(t, virtual)
    if (offset // interleave) % ranks != rank:
        return None
    return index, offset // (ranks * interleave) * interleave + offset % interleave


@pytest.mark.parametrize("ranks,interleave", [(1, 1), (2, 1), (3, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 77])
def test_placement_is_vllms_dcp_slot_mapping(ranks, interleave, num_tokens):
    """Round-robin placement with a shared block table = vLLM's virtual-block
    slot mapping: each rank's local stream j sits at block j // bs, offset j % bs."""
    block_size = 16
    lengths = shard_lengths(num_tokens, ranks, interleave)
    assert sum(lengths) == num_tokens
    seen = [0] * ranks
    for t in range(num_tokens):
        owners = [
            (r, slot)
            for r in range(ranks)
            if (slot := vllm_slot(t, ranks, r, block_size, interleave)) is not None
        ]
        assert len(owners) == 1
        rank, (block, offset) = owners[0]
        j = seen[rank]
        assert (block, offset) == divmod(j, block_size), (t, rank)
        seen[rank] += 1
    assert seen == lengths


CASES = [  # ranks, interleave, tokens, full block size, shard block size, shared table
    (1, 1, 1, 16, 16, True),
    (2, 1, 31, 16, 16, True),
    (3, 1, 77, 32, 16, True),
    (4, 1, 64, 16, 32, False),
    (3, 2, 50, 16, 8, False),
    (2, 1, 33, 32, 32, True),
    (5, 1, 3, 16, 16, True),  # more ranks than tokens: two ranks hold nothing
]


def layout(ranks, tokens, full_bs, shard_bs, shared, seed):
    full_blocks = -(-tokens // full_bs)
    shard_blocks = -(-max(shard_lengths(tokens, ranks)) // shard_bs) + 1
    full_table = permutation(full_blocks + 2, seed)[:full_blocks]
    if shared:
        shard_table = permutation(shard_blocks + 1, seed + 1)[:shard_blocks]
    else:
        shard_table = torch.stack(
            [permutation(shard_blocks + 1, seed + r)[:shard_blocks] for r in range(ranks)]
        )
    return full_blocks + 2, full_table, shard_blocks + 1, shard_table


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
    ids=lambda d: str(d).split(".")[-1],
)
@pytest.mark.parametrize("ranks,interleave,tokens,full_bs,shard_bs,shared", CASES)
def test_shard_and_reassemble_match_reference_and_round_trip(
    ranks, interleave, tokens, full_bs, shard_bs, shared, dtype, backend
):
    full_blocks, table, shard_blocks, shard_table = layout(
        ranks, tokens, full_bs, shard_bs, shared, seed=tokens
    )
    original = cpu_cache(full_blocks, full_bs, dtype, seed=7)

    shards = [cpu_cache(shard_blocks, shard_bs, dtype) for _ in range(ranks)]
    expected = [cpu_cache(shard_blocks, shard_bs, dtype) for _ in range(ranks)]
    shard_tokens(
        original, table, tokens, shards, shard_table, interleave=interleave, backend=backend
    )
    shard_tokens_reference(original, table, tokens, expected, shard_table, interleave)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(shards, expected))

    # Into a decode layout with another block table: every token back, bit-exact.
    decode_table = permutation(full_blocks, seed=99)[: table.numel()]
    rebuilt = cpu_cache(full_blocks, full_bs, dtype)
    reference = cpu_cache(full_blocks, full_bs, dtype)
    reassemble_shards(
        shards, shard_table, tokens, rebuilt, decode_table, interleave=interleave, backend=backend
    )
    reassemble_shards_reference(shards, shard_table, tokens, reference, decode_table, interleave)
    assert torch.equal(bits(rebuilt), bits(reference))
    assert torch.equal(
        bits(tokens_of(rebuilt, decode_table, tokens)), bits(tokens_of(original, table, tokens))
    )
    # Slots past the last token and blocks outside the table stay untouched.
    untouched = torch.ones(full_blocks, full_bs, dtype=torch.bool)
    for t in range(tokens):
        untouched[decode_table[t // full_bs], t % full_bs] = False
    assert not bits(rebuilt[untouched]).any()


def test_plain_token_major_cache_and_token_ids(backend):
    """Any token view works: here [blocks, block_size] of token ids (int64)."""
    ids = torch.arange(1000, 1045)
    full = torch.zeros(4, 16, dtype=torch.int64)
    table = torch.tensor([2, 0, 3])
    for t, token in enumerate(ids.tolist()):
        full[table[t // 16], t % 16] = token
    shards = [torch.full((3, 8), -1, dtype=torch.int64) for _ in range(3)]
    shard_tokens(full, table, 45, shards, torch.tensor([1, 2]), backend=backend)
    assert shards[1][1].tolist() == list(range(1001, 1045, 3))[:8]
    back = torch.zeros(4, 16, dtype=torch.int64)
    reassemble_shards(shards, torch.tensor([1, 2]), 45, back, table, backend=backend)
    assert tokens_of(back, table, 45).tolist() == ids.tolist()


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [127, 128, 300, 517])
def test_reassembled_blocks_hash_like_the_unsharded_prompt(ranks, length, backend):
    """Prefill ranks hold a prompt token-sharded (DCP); the decode engine
    reassembles it into its own blocks. Every complete block then holds the
    same tokens as the unsharded prompt's block, so vLLM's prefix-cache hashes
    (hash chain over block tokens) agree and the prefix is reused; each token's
    KV sits beside its token id."""
    block_size = 128
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, 49152, (length,), generator=gen)
    blocks = -(-length // block_size)
    # Each token's KV row is derived from its token id, so a row can be
    # checked against the token that owns the slot.
    kv_rows = prompt.float()[:, None, None] + torch.arange(2 * HEADS * HEAD_SIZE).view(
        1, 2 * HEADS, HEAD_SIZE
    )

    prefill_table = permutation(blocks + 3, seed=1)[:blocks]
    prefill_ids = torch.zeros(blocks + 3, block_size, dtype=torch.int64)
    prefill_kv = cpu_cache(blocks + 3, block_size)
    for t in range(length):
        slot = (prefill_table[t // block_size], t % block_size)
        prefill_ids[slot] = prompt[t]
        prefill_kv[slot] = kv_rows[t]
    per_rank = -(-max(shard_lengths(length, ranks)) // block_size)
    shard_table = permutation(per_rank + 2, seed=2)[:per_rank]  # vLLM: shared by all ranks
    id_shards = [torch.zeros(per_rank + 2, block_size, dtype=torch.int64) for _ in range(ranks)]
    kv_shards = [cpu_cache(per_rank + 2, block_size) for _ in range(ranks)]
    shard_tokens(prefill_ids, prefill_table, length, id_shards, shard_table, backend=backend)
    shard_tokens(prefill_kv, prefill_table, length, kv_shards, shard_table, backend=backend)

    decode_table = permutation(blocks + 5, seed=3)[:blocks]
    decode_ids = torch.zeros(blocks + 5, block_size, dtype=torch.int64)
    decode_kv = cpu_cache(blocks + 5, block_size)
    reassemble_shards(id_shards, shard_table, length, decode_ids, decode_table, backend=backend)
    reassemble_shards(kv_shards, shard_table, length, decode_kv, decode_table, backend=backend)

    hasher = BlockHasher(block_size)
    rebuilt = tokens_of(decode_ids, decode_table, length).tolist()
    assert rebuilt == prompt.tolist()
    assert hasher.block_hashes(rebuilt) == hasher.block_hashes(prompt.tolist())
    assert len(hasher.block_hashes(rebuilt)) == length // block_size
    for b in range(blocks):
        filled = min(block_size, length - b * block_size)
        block = decode_table[b]
        assert torch.equal(
            decode_kv[block, :filled], kv_rows[b * block_size : b * block_size + filled]
        )
        assert torch.equal(decode_kv[block, :filled, 0, 0], decode_ids[block, :filled].float())


def test_bad_input_is_refused_with_the_reason():
    full = cpu_cache(4, 16)
    shards = [cpu_cache(4, 16) for _ in range(2)]
    table, shard_table = torch.tensor([0, 1]), torch.tensor([0])
    with pytest.raises(ValueError, match="at least 2 entries"):
        reassemble_shards(shards, shard_table, 20, full, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        reassemble_shards(shards, shard_table, 20, full, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="rank 1"):
        reassemble_shards(shards, torch.tensor([[0], [9]]), 20, full, table)
    with pytest.raises(ValueError, match="features must match"):
        reassemble_shards(
            [shards[0], cpu_cache(4, 16, torch.float16)], shard_table, 20, full, table
        )
    with pytest.raises(ValueError, match="at least one shard"):
        reassemble_shards([], shard_table, 20, full, table)
    with pytest.raises(ValueError, match="interleave"):
        shard_lengths(5, 2, interleave=0)
    with pytest.raises(ValueError, match="runs of contiguous"):
        reassemble_shards(shards, shard_table, 20, full.transpose(2, 3), table, backend="triton")
