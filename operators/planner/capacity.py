"""The capacity check: can a replica hold the SLO's longest context at all?

For long contexts memory decides feasibility before speed. Per GPU of one
replica, for ``sequences`` requests of ``context_tokens`` each:

* **persistent KV** — tokens × KV bytes per token per layer × layers per
  pipeline stage, divided by how the replica shards it: tensor parallelism
  splits GQA's key/value heads (never more ways than there are heads; MLA's
  compressed latent is one "head" shared by all query heads, so TP replicates
  it on every rank), decode context parallelism (DCP) splits tokens across
  ranks of the TP group, prefill context parallelism (PCP) across ranks of its
  own. Data parallelism does not split one sequence.
* **temporary gather** — one layer's KV for ``gather_tokens`` (the whole
  context by default) materialised at compute precision while attention runs
  (context-parallel all-gathers, MLA's up-projected chunks), per TP shard.
* **transfer buffers** — staging the P→D hand-off uses on the GPU.

And per node, the **host pools** (decode's host KV tier, transfer staging)
against the host memory left for them.

The check refuses a configuration that overflows and names the term that
does, with the parallelism that would make it fit when one does. Pure
arithmetic: dataclasses in, a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .profiles import EngineProfile, Parallelism

GIB = 1024**3
KvKind = Literal["mla", "gqa"]


@dataclass(frozen=True)
class KvShape:
    """One token's KV per layer. GQA: 2 × kv_heads × head_dim values; MLA:
    ``latent_dim`` values (compressed latent + decoupled RoPE key), shared by
    every query head."""

    layers: int
    kind: KvKind
    kv_bytes: float  # per value as stored: FP8 1, BF16 2
    kv_heads: int = 1
    head_dim: int = 0
    latent_dim: int = 0
    compute_bytes: float = 2.0  # per value when gathered for attention

    def values_per_token_layer(self) -> int:
        return self.latent_dim if self.kind == "mla" else 2 * self.kv_heads * self.head_dim

    def head_shards(self, tp: int) -> int:
        """How many ways TP splits the KV (heads beyond that are replicated)."""
        return 1 if self.kind == "mla" else min(tp, self.kv_heads)


@dataclass(frozen=True)
class MemoryBudget:
    """What one GPU (and one node's host RAM) has left for KV and buffers once
    weights, activations and graphs are placed."""

    gpu_free_gib: float
    host_free_gib: float | None = None  # per node; None: host pools not checked

    @staticmethod
    def from_gpu(
        hbm_gib: float,
        utilization: float,
        weights_gib_per_gpu: float,
        reserved_gib: float,
        host_free_gib: float | None = None,
    ) -> MemoryBudget:
        """vLLM's view: ``gpu_memory_utilization`` × HBM, less this GPU's share
        of the weights and the activation/graph reserve."""
        return MemoryBudget(
            hbm_gib * utilization - weights_gib_per_gpu - reserved_gib, host_free_gib
        )


@dataclass(frozen=True)
class ContextDemand:
    context_tokens: int
    sequences: int = 1  # concurrent sequences of that length per replica
    gather_tokens: int | None = None  # None: the whole context is gathered
    transfer_buffer_gib: float = 0.0  # per GPU
    host_pool_gib: float = 0.0  # per node: host KV tier + transfer staging


@dataclass(frozen=True)
class Term:
    name: str
    gib: float
    where: Literal["gpu", "host"]


@dataclass(frozen=True)
class CapacityVerdict:
    fits: bool
    terms: tuple[Term, ...]
    gpu_used_gib: float
    gpu_free_gib: float
    host_used_gib: float
    host_free_gib: float | None
    overflowing: str | None  # the term that overflows (the largest on the full side)
    reason: str
    suggestion: str | None  # the parallelism that would fit, when one does

    def term(self, name: str) -> float:
        return next(t.gib for t in self.terms if t.name == name)


def persistent_kv_gib(shape: KvShape, par: Parallelism, tokens: int) -> float:
    per_token = shape.values_per_token_layer() * shape.kv_bytes * shape.layers / par.pp
    return tokens * per_token / (shape.head_shards(par.tp) * par.dcp * par.pcp) / GIB


def _terms(shape: KvShape, par: Parallelism, ctx: ContextDemand) -> tuple[Term, ...]:
    gather_tokens = ctx.context_tokens if ctx.gather_tokens is None else ctx.gather_tokens
    gather = (
        gather_tokens
        * shape.values_per_token_layer()
        * shape.compute_bytes
        / shape.head_shards(par.tp)
        / GIB
    )
    return (
        Term(
            "persistent KV",
            persistent_kv_gib(shape, par, ctx.context_tokens * ctx.sequences),
            "gpu",
        ),
        Term("temporary gather", gather, "gpu"),
        Term("transfer buffers", ctx.transfer_buffer_gib, "gpu"),
        Term("host pools", ctx.host_pool_gib, "host"),
    )


def _fits(shape: KvShape, par: Parallelism, ctx: ContextDemand, memory: MemoryBudget) -> bool:
    terms = _terms(shape, par, ctx)
    gpu = sum(t.gib for t in terms if t.where == "gpu")
    host = sum(t.gib for t in terms if t.where == "host")
    return gpu <= memory.gpu_free_gib and (
        memory.host_free_gib is None or host <= memory.host_free_gib
    )


def check_capacity(
    shape: KvShape, par: Parallelism, memory: MemoryBudget, ctx: ContextDemand
) -> CapacityVerdict:
    terms = _terms(shape, par, ctx)
    gpu = sum(t.gib for t in terms if t.where == "gpu")
    host = sum(t.gib for t in terms if t.where == "host")
    layout = f"{par.label()}, {shape.kind.upper()} KV at {shape.kv_bytes:g} B/value"
    what = (
        f"{ctx.sequences} × {ctx.context_tokens:,}-token sequence{'s' if ctx.sequences > 1 else ''}"
    )
    if gpu > memory.gpu_free_gib:
        worst = max((t for t in terms if t.where == "gpu"), key=lambda t: t.gib)
        why = ""
        if worst.name == "persistent KV" and shape.kind == "mla" and par.tp > 1 and par.dcp == 1:
            why = " (MLA's latent KV is replicated on every TP rank)"
        reason = (
            f"{worst.name} {worst.gib:.1f} GiB per GPU{why} — {gpu:.1f} GiB in all for "
            f"{what} — exceeds the {memory.gpu_free_gib:.1f} GiB free per GPU ({layout})"
        )
        return CapacityVerdict(
            False,
            terms,
            gpu,
            memory.gpu_free_gib,
            host,
            memory.host_free_gib,
            worst.name,
            reason,
            _suggest(shape, par, memory, ctx),
        )
    if memory.host_free_gib is not None and host > memory.host_free_gib:
        reason = (
            f"host pools {host:.1f} GiB per node exceed the {memory.host_free_gib:.1f} GiB "
            f"of host memory free"
        )
        return CapacityVerdict(
            False,
            terms,
            gpu,
            memory.gpu_free_gib,
            host,
            memory.host_free_gib,
            "host pools",
            reason,
            "shrink the host KV pool or the staging",
        )
    reason = (
        f"{what} fits: {gpu:.1f} of {memory.gpu_free_gib:.1f} GiB per GPU "
        f"(persistent KV {terms[0].gib:.1f} GiB; {layout})"
    )
    return CapacityVerdict(
        True, terms, gpu, memory.gpu_free_gib, host, memory.host_free_gib, None, reason, None
    )


def _suggest(
    shape: KvShape, par: Parallelism, memory: MemoryBudget, ctx: ContextDemand
) -> str | None:
    """The least context parallelism that fits: DCP first (it reuses the TP
    group's GPUs), then PCP (which adds GPUs)."""
    max_dcp = par.tp // shape.head_shards(par.tp)
    for dcp in range(par.dcp + 1, max_dcp + 1):
        if max_dcp % dcp:
            continue
        trial = Parallelism(par.tp, par.pp, par.dp, par.pcp, dcp)
        if _fits(shape, trial, ctx, memory):
            kv = persistent_kv_gib(shape, trial, ctx.context_tokens * ctx.sequences)
            return f"DCP{dcp} brings persistent KV to {kv:.1f} GiB per GPU and fits"
    for pcp in (2, 4, 8, 16, 32):
        if pcp <= par.pcp:
            continue
        trial = Parallelism(par.tp, par.pp, par.dp, pcp, max_dcp)
        if _fits(shape, trial, ctx, memory):
            kv = persistent_kv_gib(shape, trial, ctx.context_tokens * ctx.sequences)
            return (
                f"DCP{max_dcp} with PCP{pcp} ({trial.gpus()} GPUs per replica) brings "
                f"persistent KV to {kv:.1f} GiB per GPU and fits"
            )
    return None


def capacity_refusals(
    profiles: Sequence[EngineProfile],
    shapes: Mapping[str, KvShape],
    memory: Mapping[str, MemoryBudget],
    ctx: ContextDemand,
) -> dict[str, str]:
    """Configurations that cannot hold the context, by name, with the reason
    (the solver's ``Problem.refused``). Profiles whose model or hardware has
    no shape or memory figures are not checked."""
    refused = {}
    for p in profiles:
        c = p.config
        shape, budget = shapes.get(c.model), memory.get(c.hardware)
        if shape is None or budget is None:
            continue
        verdict = check_capacity(shape, c.parallelism, budget, ctx)
        if not verdict.fits:
            tail = f"; {verdict.suggestion}" if verdict.suggestion else ""
            refused[c.name] = f"{c.name}: {verdict.reason}{tail}"
    return refused
