"""Phase 1 of the rate-matching controller: profile one pool to saturation.

The agentic replay runs against a router URL at rising concurrency (1, 2, 4,
…) for a fixed time per level, a fresh content salt each level, until the
pool's throughput stops growing (or its TTFT p90 passes a ceiling). Each level
becomes one point of an ``EngineProfile`` (operators/planner/profiles.py):
request and token rates per replica, TTFT p50/p90, ITL, P90 interactivity,
prefix hit rate, and the mean requests inside the pool.

Where the URL is a Tandem router, the pool's own figures come from its
counters (``tandem_router_pool_*``, scraped before and after each level):
what that pool computed, its hit rate and its busy time. Elsewhere they come
from the client's records (busy time = the sum of TTFT for prefill, of E2E −
TTFT for decode, of E2E for an aggregated pool).

What is measured per role:

* ``prefill`` — requests capped at a few output tokens: the prefill pool is
  the bottleneck; throughput is its uncached prompt tokens per second.
* ``decode`` — give the trace long enough outputs (``--out-median``) that the
  decode pool is the bottleneck; throughput is output tokens per second.
* ``aggregated`` — the trace as it is; throughput is requests per second.

A P/D router lets the decode pod prefill a prompt itself when the part it
lacks is short (``--remote-prefill-threshold``, 256 tokens). Profiled that
way, the prefill pool sees only the least-cached prompts (on the agentic
trace 2 prompts in 21, hit rate 18% against the trace's 85%), never
saturates, and the decode pool's figures include prompt work: the profile
describes the routing, not the pool. So a prefill or decode profile needs the
router to send every prompt to the prefill pool
(``--remote-prefill-threshold 0``, ``PD_PROFILE_ROUTER_ARGS``), and a level
in which the decode pool computed prompts is refused (``foreign_prompts``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bench.agentx import report
from bench.agentx.content import PromptBuilder
from bench.agentx.replay import ReplayConfig, Replayer, build_prompts, new_salt
from bench.agentx.trace import Session
from operators.planner.demand import Window
from operators.planner.profiles import (
    EngineConfig,
    EngineProfile,
    Parallelism,
    PoolRole,
    ProfilePoint,
    validate,
)
from operators.planner.scrape import RouterScrapeSource

# Throughput counts as still growing while each level adds this much.
MIN_GAIN = 0.05
# A prefill profile's requests stop after a few tokens: one token can be a
# fragment of a character whose text comes out empty, and the replay times the
# first token by its text.
PREFILL_OUTPUT_TOKENS = 4
# Router flags under which each P/D pool does only its own work (see above).
PD_PROFILE_ROUTER_ARGS = ("--remote-prefill-threshold", "0")


@dataclass(frozen=True)
class Level:
    concurrency: int
    run: dict[str, Any]  # report.make_run of the replay
    window: Window | None  # the router's counters over the level, when it has them
    point: ProfilePoint


def _pool_work(role: PoolRole, p: ProfilePoint) -> float:
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
    return (f"the decode pool computed {decode.prompts:.0f} of the {prompts:.0f} prompts itself "
            f"(the router's --remote-prefill-threshold), so the prefill pool saw only the "
            f"least-cached ones and the decode pool did prompt work: profile P/D pools behind "
            f"a router run with {' '.join(PD_PROFILE_ROUTER_ARGS)}")


def point_from_level(role: PoolRole, replicas: int, concurrency: int, run: dict[str, Any],
                     w: Window | None) -> ProfilePoint:
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
        hit = (pool.cached_tokens / pool.prompt_tokens if own and pool.prompt_tokens
               else cached_tokens / prompt_tokens if prompt_tokens else 0.0)
        output = s["output_tokens"] if role == "prefill" else pool.output_tokens
        rate, in_flight = finished / seconds, pool.busy_seconds / seconds
        input_rate, output_rate = input_tokens / seconds, output / seconds
    else:
        seconds = s["duration_s"] * replicas
        busy = sum(r["ttft"] if role == "prefill" else
                   r["e2e"] - r["ttft"] if role == "decode" else r["e2e"] for r in ok)
        rate, in_flight = len(ok) / seconds, busy / seconds
        input_rate = s["prompt_tokens"] / seconds
        output_rate = s["output_tokens"] / seconds
        hit = s["hit_rate"] or 0.0
    return ProfilePoint(concurrency=float(concurrency), request_rate=rate,
                        input_tokens_per_s=input_rate, output_tokens_per_s=output_rate,
                        ttft_p50_s=s["ttft_p50"], ttft_p90_s=s["ttft_p90"],
                        hit_rate=min(hit, 0.999), in_flight=in_flight, itl_s=s["itl_p50"],
                        interactivity_p90=s["interactivity_p90"])


async def measure_level(source: RouterScrapeSource, label: str, sessions: list[Session],
                        trace_info: dict[str, Any], tokenizer: Any, cfg: ReplayConfig,
                        ) -> tuple[dict[str, Any], Window | None]:
    """One replay (fresh content salt, so the cache starts cold) with the
    router's counters read just before and after it."""
    builder = PromptBuilder(tokenizer, salt=new_salt())
    prompts = build_prompts(sessions, builder)
    await source.window(time.monotonic())
    result = await Replayer(cfg, sessions, prompts, salt=builder.salt).run()
    w = await source.window(time.monotonic())
    if result.interrupted:
        raise KeyboardInterrupt
    return report.make_run(label, result.to_json(), trace_info), w


async def profile_pool(role: PoolRole, url: str, sessions: list[Session],
                       trace_info: dict[str, Any], tokenizer: Any, base: ReplayConfig,
                       config: EngineConfig, replicas: int, concurrencies: list[int],
                       level_s: float, ttft_ceiling_s: float, workload: str,
                       log: Callable[[str], None] = print) -> tuple[EngineProfile, list[Level]]:
    """Replay at each concurrency in turn until the pool's throughput grows
    by less than MIN_GAIN, its TTFT p90 passes ``ttft_ceiling_s``, or a level
    fails requests (that level is left out of the profile). A level of a
    prefill or decode pool in which the decode pool computed prompts raises
    RuntimeError (``foreign_prompts``)."""
    source = RouterScrapeSource([url])
    levels: list[Level] = []
    best = 0.0
    try:
        for c in concurrencies:
            cfg = replace(base, url=url, concurrency=c, duration_s=level_s,
                          max_tokens_cap=PREFILL_OUTPUT_TOKENS if role == "prefill"
                          else base.max_tokens_cap)
            run, w = await measure_level(source, f"{role}-c{c}", sessions, trace_info,
                                         tokenizer, cfg)
            s = run["summary"]
            if s["failures"] or not s["ok"]:
                log(f"profile {role}: {s['failures']} of {s['requests']} requests failed at "
                    f"c={c} ({s['failure_kinds']}); stopping, this level left out")
                break
            if why := foreign_prompts(role, w):
                raise RuntimeError(f"profile {role} c={c}: {why}")
            point = point_from_level(role, replicas, c, run, w)
            levels.append(Level(c, run, w, point))
            work = _pool_work(role, point)
            log(f"profile {role} c={c}: {point.request_rate:.3f} req/s per replica, "
                f"{work:.1f} work/s, TTFT p90 {point.ttft_p90_s or 0:.2f} s, "
                f"in flight {point.in_flight or 0:.2f}, hit {point.hit_rate:.1%}")
            if work < best * (1 + MIN_GAIN):
                log(f"profile {role}: throughput stopped growing at c={c}")
                break
            best = max(best, work)
            if (point.ttft_p90_s or 0) > ttft_ceiling_s:
                log(f"profile {role}: TTFT p90 past {ttft_ceiling_s:g} s at c={c}; stopping")
                break
    finally:
        await source.aclose()
    if not levels:
        raise RuntimeError(f"profile {role}: no level measured")
    profile = EngineProfile(config=config, points=tuple(lv.point for lv in levels),
                            source="measured", workload=workload,
                            taken_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            replicas_measured=replicas,
                            note=f"tandem profile --role {role}: {len(levels)} levels of "
                                 f"{level_s:g} s against {url}")
    return validate(profile), levels


def engine_config(role: PoolRole, name: str, model: str, gpus_per_replica: int, hardware: str,
                  parallelism: Parallelism, scheduler_flags: list[str],
                  kv_capacity_tokens: int | None) -> EngineConfig:
    return EngineConfig(name=name, role=role, model=model, gpus_per_replica=gpus_per_replica,
                        hardware=hardware, parallelism=parallelism,
                        scheduler_flags=tuple(scheduler_flags),
                        kv_capacity_tokens=kv_capacity_tokens)
