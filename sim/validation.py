"""The simulator against the real stack: measured runs of
`python -m bench.router_policies` (two aggregated vLLM CPU engines, the
`small` trace, one policy at a time), each replayed in simulation with the
same trace, KV blocks, store and policy, and compared.

The measurements live in ``sim/measured.json`` (one entry per run: what
the benchmark printed, its command, date and load; a run left out says why
in ``excluded``); ``pooled`` averages the runs of each regime and policy
(their spread is the measurement's own noise), ``compare`` simulates each
and gives the differences, ``table`` prints them.
The issue's bounds: prefix hit rate within 3 points, TTFT p50 and p90 within
25%, and the policies' TTFT order preserved in every regime.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from sim.costs import StepModel
from sim.defaults import (
    CPU_BLOCK_BYTES_PER_TOKEN,
    CPU_MEASURED_PROFILES,
    CPU_STEP_MODEL,
    fitted_model,
    load_step_model,
    with_decode_of,
)
from sim.sweep import model_fields, run_point

MEASURED = Path(__file__).parent / "measured.json"
# The stack's store: a 2 GB RAM pool (StackConfig.kv_store_pool) of 128-token
# blocks of SmolLM2-135M in float32.
STORE_BLOCKS = 2_000_000_000 // (128 * CPU_BLOCK_BYTES_PER_TOKEN)
HIT_POINTS = 3.0  # the bounds
TTFT_RATIO = 0.25


@dataclass(frozen=True)
class Measured:
    """One real run: the regime, the policy, and what the benchmark measured."""

    sessions: int
    concurrency: int
    kv_blocks: int  # per engine, as --num-gpu-blocks-override (vLLM keeps one null block)
    store: bool
    policy: str
    requests: int
    hit_rate: float
    ttft_p50_s: float | None  # None: the record gives the hit rate alone
    ttft_p90_s: float | None
    source: str  # where the figure is recorded: command, date, load average
    # The router's --store-load-weight in the run (1: its default).
    store_load_weight: float = 1.0
    # Why the run is left out of the comparison (empty: it is in).
    excluded: str = ""
    # The run's content salt (its run.json's ``replay.salt``) and, found from
    # it by ``bench.first_visible``, per session the index of each request's
    # first output token with text: the token the run's TTFT timed (None: not
    # found; the simulation times the first token).
    salt: str = ""
    first_visible: dict[str, list[int]] | None = None
    # Pooled runs (``pooled``): how many, and the lowest and highest of each figure.
    runs: int = 1
    hit_range: tuple[float, float] | None = None
    p50_range: tuple[float, float] | None = None
    p90_range: tuple[float, float] | None = None
    members: tuple[Measured, ...] = ()  # a pool's runs

    @property
    def label(self) -> str:
        """The policy, and the router setting it ran with when not the default
        (as ``bench.router_policies`` names a variant)."""
        if self.store_load_weight == 1.0:
            return self.policy
        return f"{self.policy}+store-load-weight={self.store_load_weight:g}"

    @property
    def regime(self) -> str:
        return f"{self.sessions} sessions, {self.kv_blocks} blocks" + (
            ", store" if self.store else ""
        )


def engines_model() -> StepModel:
    """The runs' engines as simulated: the prompt side fitted from `tandem
    profile` of the same engines, the decode side measured term by term
    (`bench.step_costs`). The profile's decode side, a line through 3.8-8.4
    requests in flight, puts a lone sequence's step at 44 ms; the runs'
    lone decodes took 74 ms a token (median of 53), the term-by-term model
    70 ms (sim/README.md, "Validation")."""
    return with_decode_of(fitted_model(CPU_MEASURED_PROFILES), load_step_model(CPU_STEP_MODEL))


def load_measured(path: Path = MEASURED) -> list[Measured]:
    """The runs recorded, but those excluded."""
    runs = [Measured(**row) for row in json.loads(path.read_text())]
    return [m for m in runs if not m.excluded]


def pooled(runs: Sequence[Measured]) -> list[Measured]:
    """One entry per regime and policy (in first-seen order): the runs' mean
    figures, their range, and every run's source."""
    groups: dict[tuple[Any, ...], list[Measured]] = {}
    for m in runs:
        key = (m.sessions, m.concurrency, m.kv_blocks, m.store, m.policy, m.store_load_weight)
        groups.setdefault(key, []).append(m)
    out = []
    for ms in groups.values():
        if len({m.requests for m in ms}) > 1:
            raise ValueError(f"{ms[0].regime}, {ms[0].label}: runs of different traces")

        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        def spread(values: list[float]) -> tuple[float, float] | None:
            return (min(values), max(values)) if values else None

        hits = [m.hit_rate for m in ms]
        p50 = [m.ttft_p50_s for m in ms if m.ttft_p50_s is not None]
        p90 = [m.ttft_p90_s for m in ms if m.ttft_p90_s is not None]
        out.append(
            replace(
                ms[0],
                hit_rate=sum(hits) / len(hits),
                ttft_p50_s=mean(p50),
                ttft_p90_s=mean(p90),
                source=" | ".join(m.source for m in ms),
                runs=len(ms),
                hit_range=spread(hits),
                p50_range=spread(p50),
                p90_range=spread(p90),
                members=tuple(ms),
            )
        )
    return out


def point_for(
    m: Measured,
    model: StepModel,
    store_blocks: int,
    think_scale: float = 0.2,
    turns_median: float = 4.0,
    seed: int = 0,
    shared_core_s: float = 0.0,
) -> dict[str, Any]:
    """The simulation point of a measured run: two aggregated pods of the
    engines' usable blocks (vLLM's null block is not usable), the benchmark's
    trace and lanes, and the run's first visible tokens where found."""
    return {
        "model": model_fields(model),
        "gpus_per_pod": 1,
        "block_size": 128,
        "block_bytes": 128 * CPU_BLOCK_BYTES_PER_TOKEN,
        "max_num_batched_tokens": 2048,
        "long_prefill_threshold": 0,
        "link_gbps": 5.0,
        "link_latency_ms": 1.0,
        "store_gbps": 1.0,
        "store_latency_ms": 2.0,
        "remote_prefill_threshold": 256,
        "store_load_weight": m.store_load_weight,
        "trace_profile": "small",
        "turns_median": turns_median,
        "think_scale": think_scale,
        "concurrency": m.concurrency,
        "policy": m.policy,
        "pods": "2",
        "kv_blocks": m.kv_blocks - 1,
        "store_blocks": store_blocks if m.store else 0,
        "sessions": m.sessions,
        "seed": seed,
        "first_visible": m.first_visible,
        "shared_core_s": shared_core_s,
    }


@dataclass(frozen=True)
class Compared:
    measured: Measured
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float

    @property
    def hit_off_points(self) -> float:
        return 100.0 * (self.hit_rate - self.measured.hit_rate)

    @property
    def p50_ratio(self) -> float | None:
        m = self.measured.ttft_p50_s
        return None if m is None else self.ttft_p50_s / m

    @property
    def p90_ratio(self) -> float | None:
        m = self.measured.ttft_p90_s
        return None if m is None else self.ttft_p90_s / m

    def within(self, hit_points: float = HIT_POINTS, ttft_ratio: float = TTFT_RATIO) -> bool:
        return abs(self.hit_off_points) <= hit_points and all(
            abs(r - 1.0) <= ttft_ratio for r in (self.p50_ratio, self.p90_ratio) if r is not None
        )


def compare(
    measured: Sequence[Measured], model: StepModel, store_blocks: int, shared_core_s: float = 0.0
) -> list[Compared]:
    """Each regime and policy measured, simulated (runs pooled): each run with
    its own first visible tokens (its content differs), the figures averaged
    as the runs' are; runs without them are one simulation. ``shared_core_s``:
    the core time the processes around the engines take per prompt in a step."""
    out = []
    for m in pooled(measured):
        distinct = {json.dumps(r.first_visible, sort_keys=True): r for r in m.members or (m,)}
        rows = [
            run_point(point_for(r, model, store_blocks, shared_core_s=shared_core_s))
            for r in distinct.values()
        ]
        if rows[0]["requests"] != m.requests:
            raise ValueError(
                f"{m.regime}, {m.label}: the simulation's trace has {rows[0]['requests']} "
                f"requests, the measured run {m.requests}"
            )
        hit, p50, p90 = (
            sum(row[key] for row in rows) / len(rows)
            for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s")
        )
        out.append(Compared(m, hit, p50, p90))
    return out


@dataclass(frozen=True)
class Ranking:
    """A regime's policies by TTFT p90, best first, measured and simulated,
    and the pairs the simulation puts the other way round although the runs
    tell them apart (their p90 ranges do not overlap)."""

    measured: list[str]
    simulated: list[str]
    misordered: list[tuple[str, str]]


def _apart(a: Measured, b: Measured) -> bool:
    """The runs put ``a``'s TTFT p90 below ``b``'s: every run of ``a`` below every one of ``b``."""
    ra = a.p90_range or (a.ttft_p90_s, a.ttft_p90_s)
    rb = b.p90_range or (b.ttft_p90_s, b.ttft_p90_s)
    return ra[1] is not None and rb[0] is not None and ra[1] < rb[0]


def rankings(rows: Sequence[Compared]) -> dict[str, Ranking]:
    """Per regime with two or more measured TTFTs, the policies by TTFT p90."""
    by_regime: dict[str, list[Compared]] = {}
    for c in rows:
        if c.measured.ttft_p90_s is not None:
            by_regime.setdefault(c.measured.regime, []).append(c)
    return {
        regime: Ranking(
            [c.measured.label for c in sorted(cs, key=lambda c: c.measured.ttft_p90_s or 0.0)],
            [c.measured.label for c in sorted(cs, key=lambda c: c.ttft_p90_s)],
            [
                (a.measured.label, b.measured.label)
                for a, b in itertools.permutations(cs, 2)
                if _apart(a.measured, b.measured) and a.ttft_p90_s > b.ttft_p90_s
            ],
        )
        for regime, cs in by_regime.items()
        if len(cs) > 1
    }


def table(rows: Sequence[Compared]) -> str:
    lines = [
        "| regime | policy | runs | measured hit / TTFT p50 / p90 (range) | simulated | off by |",
        "|---|---|---:|---:|---:|---|",
    ]

    def secs(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    def ratio(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}×"

    def spread(r: tuple[float, float] | None, percent: bool = False) -> str:
        if r is None or r[0] == r[1]:
            return ""
        if percent:
            return f" ({100 * r[0]:.1f}–{100 * r[1]:.1f}%)"
        return f" ({r[0]:.2f}–{r[1]:.2f})"

    for c in rows:
        m = c.measured
        lines.append(
            f"| {m.regime} | {m.label} | {m.runs} "
            f"| {100 * m.hit_rate:.1f}%{spread(m.hit_range, percent=True)} / "
            f"{secs(m.ttft_p50_s)}{spread(m.p50_range)} / "
            f"{secs(m.ttft_p90_s)}{spread(m.p90_range)} s "
            f"| {100 * c.hit_rate:.1f}% / {c.ttft_p50_s:.2f} / {c.ttft_p90_s:.2f} s "
            f"| {c.hit_off_points:+.1f} pt, {ratio(c.p50_ratio)}, {ratio(c.p90_ratio)}"
            f"{'' if c.within() else ' (outside)'} |"
        )
    for regime, r in rankings(rows).items():
        if r.misordered:
            same = "DIFFERENT: " + ", ".join(f"{a} < {b} in every run" for a, b in r.misordered)
        elif r.measured != r.simulated:
            same = "different only where the runs' p90 ranges overlap"
        else:
            same = "same"
        lines.append(
            f"\n{regime}: TTFT p90 order measured {' < '.join(r.measured)}, "
            f"simulated {' < '.join(r.simulated)} ({same})"
        )
    return "\n".join(lines)


def to_json(rows: Sequence[Compared]) -> list[dict[str, Any]]:
    return [
        {
            **{
                f.name: getattr(c.measured, f.name)
                for f in fields(Measured)
                if f.name not in ("first_visible", "members")
            },
            "sim_hit_rate": c.hit_rate,
            "sim_ttft_p50_s": c.ttft_p50_s,
            "sim_ttft_p90_s": c.ttft_p90_s,
        }
        for c in rows
    ]


# Slow-downs tried by ``calibrate``: from twice the profile's speed to 16× slower
# (an engine sharing its core with other work), in steps of √2.
FACTORS = tuple(2 ** (i / 2) for i in range(-2, 9))


def slowed(model: StepModel, prefill: float, decode: float) -> StepModel:
    """``model`` with its prompt side ``prefill`` times and its decode side
    ``decode`` times slower."""
    return replace(
        model,
        token_s=model.token_s * prefill,
        token_ctx_s=model.token_ctx_s * prefill,
        step_s=model.step_s * decode,
        seq_s=model.seq_s * decode,
        seq_ctx_s=model.seq_ctx_s * decode,
    )


def calibrate(
    measured: Sequence[Measured],
    model: StepModel,
    store_blocks: int,
    factors: Sequence[float] = FACTORS,
    shared_core_s: float = 0.0,
) -> tuple[float, float]:
    """The (prefill, decode) slow-downs of ``model`` that best reproduce the
    measured runs' TTFT p50 and p90 (least squares of the log ratios): the
    engines' speed on the machine as it was loaded when they ran."""

    def error(pair: tuple[float, float]) -> float:
        rows = compare(measured, slowed(model, *pair), store_blocks, shared_core_s)
        ratios = [r for c in rows for r in (c.p50_ratio, c.p90_ratio) if r is not None]
        return sum(math.log(r) ** 2 for r in ratios)

    return min(itertools.product(factors, factors), key=error)
