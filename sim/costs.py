"""Cost models of the simulated cluster, pure functions of their parameters,
and their fits from engine profiles (``operators/planner/profiles.py``: what
``tandem profile`` measures, or figures written from published numbers).

* ``StepModel``: the time of one vLLM scheduler step that computes prompt
  chunks and decodes a batch. A prompt token costs ``token_s`` plus
  ``token_ctx_s`` per token of context before it (attention reads the
  prefix: chunked prefill of a long prompt costs more per token than a short
  one); a decoding sequence costs ``seq_s`` plus ``seq_ctx_s`` per token of
  its context; each step pays ``step_s``.
* ``StoreTier``: a KV store tier (capacity in blocks, bandwidth, latency),
  and ``Link`` for the P→D transfer (NIXL) of a prompt's blocks.

Fits: the prompt side from a prefill (or aggregated) profile's saturated
point (uncached prompt tokens per second at its mean prompt), the decode side
from a decode (or aggregated) profile's points (inter-token latency against
requests in flight). ``ctx_share`` says which share of a token's cost at the
profile's mean context is the context-dependent part: a profile of one
prompt length cannot separate the two, so it is a parameter, not a fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from operators.planner.profiles import EngineProfile, ProfilePoint

# A context-dependent share of a token's cost at the profile's mean context
# when nothing else is known (attention against MLP for a small model at a few
# thousand tokens of context).
DEFAULT_CTX_SHARE = 0.25
# The fixed share of a decode step at a one-level profile's batch (scheduling,
# sampling and the launch of every layer, paid once per step whatever the
# batch): see sim/README.md, "Validation", for the runs that set it.
DEFAULT_STEP_SHARE = 0.7


@dataclass(frozen=True)
class StepModel:
    step_s: float = 0.0  # fixed cost of a step (scheduling, sampling, launch)
    token_s: float = 1e-3  # per prompt token computed
    token_ctx_s: float = 0.0  # per prompt token, per token of context before it
    seq_s: float = 1e-2  # per decoding sequence in the step
    seq_ctx_s: float = 0.0  # per decoding sequence, per token of its context

    def prefill_s(self, tokens: int, start: int) -> float:
        """Computing ``tokens`` prompt tokens that follow ``start`` tokens of context."""
        if tokens <= 0:
            return 0.0
        mid = start + tokens / 2.0
        return tokens * (self.token_s + self.token_ctx_s * mid)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode token for each of ``batch`` sequences holding ``context_tokens`` in all."""
        return batch * self.seq_s + self.seq_ctx_s * context_tokens

    def step(self, chunks: list[tuple[int, int]], batch: int, context_tokens: int) -> float:
        """One step: prompt ``chunks`` as (tokens, start) and a decode batch."""
        if not chunks and batch == 0:
            return 0.0
        return (
            self.step_s
            + sum(self.prefill_s(n, s) for n, s in chunks)
            + self.decode_s(batch, context_tokens)
        )

    def scaled(self, speed: float) -> StepModel:
        """The same engine ``speed`` times faster (more cores, a faster chip)."""
        if speed <= 0:
            raise ValueError(f"speed {speed}: must be positive")
        return StepModel(*(getattr(self, f) / speed for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class StoreTier:
    """One tier of the shared KV store (RAM or disk)."""

    capacity_blocks: int
    bandwidth_bytes_s: float
    latency_s: float

    def load_s(self, blocks: int, block_bytes: int) -> float:
        if blocks <= 0:
            return 0.0
        return self.latency_s + blocks * block_bytes / self.bandwidth_bytes_s


@dataclass(frozen=True)
class Link:
    """The P→D transfer of a prompt's blocks (NIXL)."""

    bandwidth_bytes_s: float
    latency_s: float

    def transfer_s(self, blocks: int, block_bytes: int) -> float:
        if blocks <= 0:
            return 0.0
        return self.latency_s + blocks * block_bytes / self.bandwidth_bytes_s


# ------------------------------------------------------------------- fits


def saturated(profile: EngineProfile) -> ProfilePoint:
    """The point with the highest request rate: the replica's saturation."""
    if not profile.points:
        raise ValueError(f"profile {profile.config.name}: no points")
    return max(profile.points, key=lambda p: p.request_rate)


def fit_prefill(
    profile: EngineProfile, base: StepModel | None = None, ctx_share: float = DEFAULT_CTX_SHARE
) -> StepModel:
    """The prompt side of ``base`` from the profile's saturated point: at its
    mean uncached prompt, following its mean cached prefix, the model computes
    exactly the profile's uncached tokens per second."""
    if not 0.0 <= ctx_share < 1.0:
        raise ValueError(f"ctx_share {ctx_share}: must be in [0, 1)")
    p = saturated(profile)
    if p.uncached_tokens_per_s <= 0:
        raise ValueError(f"profile {profile.config.name}: no uncached prompt tokens measured")
    per_token = 1.0 / p.uncached_tokens_per_s
    uncached = p.mean_uncached_tokens
    mid = (p.mean_input_tokens - uncached) + uncached / 2.0
    token_ctx_s = ctx_share * per_token / mid if mid > 0 else 0.0
    return replace(
        base or StepModel(), token_s=(1.0 - ctx_share) * per_token, token_ctx_s=token_ctx_s
    )


def fit_decode(
    profile: EngineProfile,
    base: StepModel | None = None,
    ctx_share: float = DEFAULT_CTX_SHARE,
    step_share: float = DEFAULT_STEP_SHARE,
) -> StepModel:
    """The decode side of ``base``: a decode step of B sequences takes
    ``step_s + B × seq_s`` (context folded in at the profile's mean context),
    least squares over the points that give inter-token latency and requests
    in flight (one point: ``step_share`` of its step is the fixed cost)."""
    if not 0.0 <= ctx_share < 1.0:
        raise ValueError(f"ctx_share {ctx_share}: must be in [0, 1)")
    if not 0.0 <= step_share < 1.0:
        raise ValueError(f"step_share {step_share}: must be in [0, 1)")
    pts = [p for p in profile.points if p.itl_s and (p.in_flight or p.concurrency)]
    if not pts:
        raise ValueError(f"profile {profile.config.name}: no point gives itl_s")
    xs = [float(p.in_flight or p.concurrency) for p in pts]
    ys = [float(p.itl_s or 0.0) for p in pts]
    if len(pts) >= 2 and max(xs) > min(xs):
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 1e-9)
        step_s = max(0.0, my - slope * mx)
    else:
        # One load level cannot separate the step's fixed cost from its
        # per-sequence cost: ``step_share`` says which share of the measured
        # step is fixed.
        step_s = step_share * ys[0]
        slope = (ys[0] - step_s) / xs[0]
    p = saturated(profile)
    context = p.mean_input_tokens + p.mean_output_tokens / 2.0
    return replace(
        base or StepModel(),
        step_s=step_s,
        seq_s=(1.0 - ctx_share) * slope,
        seq_ctx_s=ctx_share * slope / context if context > 0 else 0.0,
    )


def fit_engine(
    prefill: EngineProfile,
    decode: EngineProfile,
    ctx_share: float = DEFAULT_CTX_SHARE,
    step_share: float = DEFAULT_STEP_SHARE,
) -> StepModel:
    """One engine's step model: decode side from ``decode``, prompt side from ``prefill``."""
    decode_side = fit_decode(decode, ctx_share=ctx_share, step_share=step_share)
    return fit_prefill(prefill, decode_side, ctx_share)


def rank_speedup(profile: EngineProfile, gpus: int) -> float:
    """How much faster one rank of a replica on ``gpus`` GPUs runs than a rank
    of the profile's replica. A data-parallel profile (``dp`` > 1) keeps its
    rank size: more GPUs are more ranks, each as fast as the profile's, each
    paying a step's fixed cost in parallel (fewer GPUs than a rank: a smaller,
    slower rank). Without data parallelism the one rank spans all the GPUs."""
    c = profile.config
    rank_gpus = c.gpus_per_replica / c.parallelism.dp
    new_rank = gpus if c.parallelism.dp == 1 else min(gpus, rank_gpus)
    return new_rank / rank_gpus


def per_gpu(model: StepModel, profile: EngineProfile, gpus: int) -> StepModel:
    """A replica on ``gpus`` GPUs (or cores) of the profile's hardware: work per
    token and per sequence scales linearly with the GPUs, a step's fixed cost
    with the size of a rank (``rank_speedup``)."""
    k = gpus / profile.config.gpus_per_replica
    return replace(model.scaled(k), step_s=model.step_s / rank_speedup(profile, gpus))


def kv_block_bytes(
    layers: int, kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes of one KV block (keys and values of every layer)."""
    return 2 * layers * kv_heads * head_dim * block_size * dtype_bytes


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0
