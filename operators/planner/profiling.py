"""Phase 1 of the rate-matching controller, the part without I/O: what one
load level of a profile run measured, whether it measured the pool alone, and
how much work saturates a pool of each role. ``tandem profile``
(``tandem/profile.py``) drives the load and reads the router's counters; this
turns a level's replay run and counter ``Window`` into a ``ProfilePoint`` of
an ``EngineProfile`` (``profiles.py``), preferring the pool's own counters to
the client's records where the router has them.

A prefill or decode profile holds only levels in which every prompt went
through the prefill pool (``foreign_prompts``): when the decode pool prefills
short prompts itself, the figures describe the routing, not the pool
(``tandem profile --help`` tells the whole story).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from operators.planner.demand import Window
from operators.planner.profiles import (
    EngineConfig,
    Parallelism,
    PoolRole,
    ProfilePoint,
)

# Throughput counts as still growing while each level adds this much.
MIN_GAIN = 0.05
# A prefill profile's requests stop after a few tokens: one token can be a
# fragment of a character whose text comes out empty, and the replay times the
# first token by its text.
PREFILL_OUTPUT_TOKENS = 4
# Router flags under which each P/D pool does only its own work.
PD_PROFILE_ROUTER_ARGS = ("--remote-prefill-threshold", "0")


@dataclass(frozen=True)
class Level:
    concurrency: int
    run: dict[str, Any]  # tandem.workload.runs.make_run of the replay
    window: Window | None  # the router's counters over the level, when it has them
    point: ProfilePoint


def pool_work(role: PoolRole, p: ProfilePoint) -> float:
    """What saturates a pool of this role: uncached prompt tokens per second
    for prefill, output tokens per second for decode, requests per second
    for an aggregated pool."""
    if role == "prefill":
        return p.uncached_tokens_per_s
    if role == "decode":
        return p.output_tokens_per_s
    return p.request_rate


def foreign_prompts(role: PoolRole, w: Window | None) -> str | None:
    """Why a level of a prefill or decode profile does not measure that pool
    alone (the decode pool computed prompts itself), or None."""
    decode = None if w is None or role == "aggregated" else w.pools.get("decode")
    if w is None or decode is None or decode.prompts <= 0:
        return None
    prompts = sum(p.prompts for p in w.pools.values())
    return (
        f"the decode pool computed {decode.prompts:.0f} of the {prompts:.0f} prompts itself "
        f"(the router's --remote-prefill-threshold), so the prefill pool saw only the "
        f"least-cached ones and the decode pool did prompt work: profile P/D pools behind "
        f"a router run with {' '.join(PD_PROFILE_ROUTER_ARGS)}"
    )


def point_from_level(
    role: PoolRole, replicas: int, concurrency: int, run: dict[str, Any], w: Window | None
) -> ProfilePoint:
    """One profile point from a replay run and, when present, the pool's
    counters over the same time."""
    s = run["summary"]
    ok = [r for r in run["records"] if r.get("ok")]
    pool = None if w is None else w.pools.get(role)
    if pool is not None and w is not None and (pool.prompts or pool.generations):
        seconds = w.seconds * replicas
        finished = pool.prompts if role == "prefill" else pool.generations
        everything = list(w.pools.values())
        prompt_tokens = sum(p.prompt_tokens for p in everything)
        cached_tokens = sum(p.cached_tokens for p in everything)
        own = role != "decode"  # decode pods compute no prompt (foreign_prompts)
        input_tokens = pool.prompt_tokens if own else prompt_tokens
        hit = (
            pool.cached_tokens / pool.prompt_tokens
            if own and pool.prompt_tokens
            else cached_tokens / prompt_tokens
            if prompt_tokens
            else 0.0
        )
        output = s["output_tokens"] if role == "prefill" else pool.output_tokens
        rate, in_flight = finished / seconds, pool.busy_seconds / seconds
        input_rate, output_rate = input_tokens / seconds, output / seconds
    else:
        seconds = s["duration_s"] * replicas
        busy = sum(
            r["ttft"]
            if role == "prefill"
            else r["e2e"] - r["ttft"]
            if role == "decode"
            else r["e2e"]
            for r in ok
        )
        rate, in_flight = len(ok) / seconds, busy / seconds
        input_rate = s["prompt_tokens"] / seconds
        output_rate = s["output_tokens"] / seconds
        hit = s["hit_rate"] or 0.0
    return ProfilePoint(
        concurrency=float(concurrency),
        request_rate=rate,
        input_tokens_per_s=input_rate,
        output_tokens_per_s=output_rate,
        ttft_p50_s=s["ttft_p50"],
        ttft_p90_s=s["ttft_p90"],
        hit_rate=min(hit, 0.999),
        in_flight=in_flight,
        itl_s=s["itl_p50"],
        interactivity_p90=s["interactivity_p90"],
    )


def engine_config(
    role: PoolRole,
    name: str,
    model: str,
    gpus_per_replica: int,
    hardware: str,
    parallelism: Parallelism,
    scheduler_flags: list[str],
    kv_capacity_tokens: int | None,
) -> EngineConfig:
    return EngineConfig(
        name=name,
        role=role,
        model=model,
        gpus_per_replica=gpus_per_replica,
        hardware=hardware,
        parallelism=parallelism,
        scheduler_flags=tuple(scheduler_flags),
        kv_capacity_tokens=kv_capacity_tokens,
    )
