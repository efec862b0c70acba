"""Exact attention from partial attentions over disjoint key sets, by log-sum-exp.

Each of ``R`` ranks (DCP shards of a context, or chunks of it) attends the
same queries over its own keys and returns its output ``o_r`` (softmax over
its keys only) and ``lse_r``, the natural log of the sum of ``exp(score)`` over
those keys. The attention over all keys is

    lse = log(sum_r exp(lse_r))
    o   = sum_r exp(lse_r - lse) * o_r

A rank that holds no key for a query reports ``lse_r = -inf`` and weighs
nothing; a query no rank has keys for gets ``o = 0`` and ``lse = -inf``.
Arithmetic is float32 whatever the outputs' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import backend as backends


def merge_partial_attention(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``outputs`` ``[R, tokens, heads, head_size]``, ``lses`` ``[R, tokens, heads]``
    → (output ``[tokens, heads, head_size]`` in the outputs' dtype, float32 lse
    ``[tokens, heads]``)."""
    outputs, lses = _stacked(outputs, lses)
    chosen = backends.resolve(backend, outputs.device, _merge_kernel)
    if chosen == "reference":
        return merge_partial_attention_reference(outputs, lses)
    if chosen == "torch":
        return _merge_torch(outputs, lses)
    return _merge_triton(outputs, lses)


def merge_partial_attention_reference(
    outputs: torch.Tensor,
    lses: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula as written, token by token and head by head, in float64."""
    ranks, tokens, heads, size = outputs.shape
    out = torch.zeros((tokens, heads, size), dtype=torch.float64)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            parts = [
                (float(lses[r, t, h]), outputs[r, t, h].double().cpu())
                for r in range(ranks)
                if float(lses[r, t, h]) != float("-inf")
            ]
            if not parts:
                continue
            top = max(value for value, _ in parts)
            merged_lse = top + math.log(sum(math.exp(value - top) for value, _ in parts))
            lse[t, h] = merged_lse
            for value, o in parts:
                out[t, h] += math.exp(value - merged_lse) * o
    return (
        out.to(device=outputs.device, dtype=outputs.dtype),
        lse.to(device=outputs.device, dtype=torch.float32),
    )


def _merge_torch(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lses = lses.float()
    top = lses.amax(dim=0)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    scale = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    out = torch.einsum("rth,rthd->thd", weights * scale, outputs.float())
    return out.to(outputs.dtype), top + torch.log(total)


@triton.jit
def _merge_kernel(
    outputs,
    lses,
    out,
    lse_out,
    num_ranks,
    heads,
    head_size,
    o_rank_stride,
    o_token_stride,
    o_head_stride,
    l_rank_stride,
    l_token_stride,
    l_head_stride,
    out_token_stride,
    out_head_stride,
    lse_token_stride,
    BLOCK_D: tl.constexpr,
):
    # One program merges one (token, head): two passes over the ranks, first
    # for the largest lse (so no exp overflows), then the weighted sum.
    pid = tl.program_id(0).to(tl.int64)
    t = pid // heads
    h = pid % heads
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    lse_at = lses + t * l_token_stride + h * l_head_stride
    top = tl.full((), float("-inf"), tl.float32)
    for r in range(num_ranks):
        top = tl.maximum(top, tl.load(lse_at + r * l_rank_stride).to(tl.float32))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.full((BLOCK_D,), 0.0, tl.float32)
    o_at = outputs + t * o_token_stride + h * o_head_stride
    for r in range(num_ranks):
        weight = tl.exp(tl.load(lse_at + r * l_rank_stride).to(tl.float32) - top)
        total += weight
        o = tl.load(o_at + r * o_rank_stride + d, mask=dmask, other=0.0).to(tl.float32)
        acc += weight * o
    # No weight at all: acc is 0, the output 0 and the lse -inf.
    divisor = tl.where(total > 0, total, 1.0)
    tl.store(
        out + t * out_token_stride + h * out_head_stride + d,
        (acc / divisor).to(out.dtype.element_ty),
        mask=dmask,
    )
    tl.store(
        lse_out + t * lse_token_stride + h,
        tl.where(total > 0, top + tl.log(divisor), float("-inf")),
    )


def _merge_triton(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ranks, tokens, heads, size = outputs.shape
    if outputs.stride(3) != 1:
        outputs = outputs.contiguous()
    out = torch.empty((tokens, heads, size), dtype=outputs.dtype, device=outputs.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=outputs.device)
    if tokens * heads:
        _merge_kernel[(tokens * heads,)](
            outputs,
            lses,
            out,
            lse,
            ranks,
            heads,
            size,
            outputs.stride(0),
            outputs.stride(1),
            outputs.stride(2),
            lses.stride(0),
            lses.stride(1),
            lses.stride(2),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            BLOCK_D=triton.next_power_of_2(size),
        )
    return out, lse


def _stacked(
    outputs: torch.Tensor | Sequence[torch.Tensor], lses: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(outputs, torch.Tensor):
        outputs = torch.stack(list(outputs))
    if not isinstance(lses, torch.Tensor):
        lses = torch.stack(list(lses))
    if (
        outputs.dim() != 4
        or lses.dim() != 3
        or outputs.shape[:3] != lses.shape
        or outputs.shape[0] == 0
    ):
        raise ValueError(
            f"need outputs [R, tokens, heads, head_size] and lses [R, tokens, "
            f"heads] with R >= 1, got {tuple(outputs.shape)} and "
            f"{tuple(lses.shape)}"
        )
    if not outputs.is_floating_point() or lses.device != outputs.device:
        raise ValueError("outputs must be floating point and on the lses' device")
    return outputs, lses
