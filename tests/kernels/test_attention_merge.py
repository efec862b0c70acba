"""merge_partial_attention: against its float64 reference, and — what it is
for — partial attentions over DCP token shards merge into full attention to
float32 tolerance. The Triton path runs in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import merge_partial_attention, merge_partial_attention_reference, shard_lengths

NEG_INF = float("-inf")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [T, H, D] over k, v [S, H, D] where ``visible``
    [T, S] allows; returns output [T, H, D] and lse [T, H] (natural log).
    A query that sees no key gets output 0 and lse -inf."""
    scores = torch.einsum("thd,shd->ths", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("ths,shd->thd", weights, v), lse


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("keys", [1, 37, 64])
@pytest.mark.parametrize("interleave", [1, 4])
def test_merging_dcp_shards_equals_full_attention(ranks, keys, interleave, backend):
    """Keys spread round-robin over ranks as vLLM's DCP does; causal queries
    over the last positions, so early queries find no key on some ranks."""
    gen = torch.Generator().manual_seed(ranks * 100 + keys)
    heads, size, queries = 3, 32, 5
    q = torch.randn(queries, heads, size, generator=gen)
    k = torch.randn(keys, heads, size, generator=gen)
    v = torch.randn(keys, heads, size, generator=gen)
    positions = torch.arange(keys - queries, keys).clamp(min=0)
    visible = torch.arange(keys)[None, :] <= positions[:, None]
    full_out, full_lse = attention(q, k, v, visible)

    owner = torch.arange(keys) // interleave % ranks
    outs, lses = [], []
    for r in range(ranks):
        mine = owner == r
        out, lse = attention(q, k[mine], v[mine], visible[:, mine])
        outs.append(out)
        lses.append(lse)
    assert [int((owner == r).sum()) for r in range(ranks)] == shard_lengths(keys, ranks, interleave)
    merged, merged_lse = merge_partial_attention(outs, lses, backend=backend)
    torch.testing.assert_close(merged, full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1]
)
def test_matches_reference_with_empty_ranks(dtype, backend):
    gen = torch.Generator().manual_seed(5)
    outputs = torch.randn(4, 6, 2, 24, generator=gen).to(dtype)
    lses = torch.randn(4, 6, 2, generator=gen) * 20
    lses[1, 0, 0] = NEG_INF  # one rank without keys for this query
    lses[:, 2, 1] = NEG_INF  # no rank has keys: output 0, lse -inf
    lses[0, 3, :] = 80.0  # far larger than the rest: no overflow
    out, lse = merge_partial_attention(outputs, lses, backend=backend)
    ref_out, ref_lse = merge_partial_attention_reference(outputs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2, 1], torch.zeros(24, dtype=dtype))
    assert lse[2, 1] == NEG_INF
    torch.testing.assert_close(out[3].float(), outputs[0, 3].float(), rtol=1e-3, atol=1e-3)


def test_one_rank_is_the_identity(backend):
    outputs = torch.randn(1, 3, 2, 8)
    lses = torch.randn(1, 3, 2)
    out, lse = merge_partial_attention(outputs, lses, backend=backend)
    torch.testing.assert_close(out, outputs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lses[0])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"outputs \[R, tokens"):
        merge_partial_attention(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="R >= 1"):
        merge_partial_attention(torch.zeros(0, 3, 4, 8), torch.zeros(0, 3, 4))
    with pytest.raises(ValueError, match="floating point"):
        merge_partial_attention(torch.zeros(2, 3, 4, 8, dtype=torch.int32), torch.zeros(2, 3, 4))
