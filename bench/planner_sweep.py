"""The rate-matching controller on this machine, end to end: Phase 1
profiles of a prefill, a decode and an aggregated pool on the embedded stack,
the solver's plan for the agentic trace from them, and a Phase 2 sweep of the
deployments two cores can run, measured best against predicted.

    python -m bench.planner_sweep [--levels 1,2,4,8,16] [--level-s 60] \\
        [--sweep 2,4,8] [--deployments 1P1D,2agg] [--slo-ttft-p90 5] [--out DIR]
    make bench-planner

Steps, one stack at a time (this machine holds two engines, one per core):

1. ``1P1D`` stack, its router sending every prompt to the prefill pool
   (``operators.planner.profiling.PD_PROFILE_ROUTER_ARGS``): ``profile --role prefill``
   (outputs capped at a few tokens), then ``--role decode`` (the trace with
   longer outputs, so decode is the bottleneck); each engine's KV capacity is
   read from its metrics. ``--retake`` with ``--skip-profiles`` profiles only
   the roles it names and keeps the others from the file.
2. ``1agg`` stack: ``profile --role aggregated`` (the trace as it is).
3. The solver on the three profiles for the trace's shape (its own hit rates):
   the plan for a budget of 2 cores, and the P/D ratio at scale.
4. Phase 2: each deployment replays the trace at the sweep's concurrencies;
   its goodput is the highest request rate whose TTFT p90 meets the SLO. The
   solver's prediction for the same deployment (``fixed_plan``) sits beside
   it, with each pool's measured efficiency (measured ÷ profiled throughput at
   the load it ran, from the router's counters). The deployments run the
   router's defaults, local prefill of short uncached prompts included.

Writes ``profiles.yaml``, ``planner.json`` and ``report.md`` to the output
directory (default ``bench/results/<time>-planner``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from bench.harness import RESULTS, log
from operators.planner.demand import measurements_of
from operators.planner.efficiency import measure_efficiency
from operators.planner.profiles import (
    EngineProfile,
    Parallelism,
    PoolRole,
    manifests_yaml,
    profile_configmap,
)
from operators.planner.profiling import PD_PROFILE_ROUTER_ARGS, engine_config
from operators.planner.scrape import RouterScrapeSource
from operators.planner.solver import Demand, Plan, Problem, Slo, fixed_plan, solve
from tandem.profile import measure_level, profile_pool
from tandem.workload import generate
from tandem.workload.replay import ReplayConfig

MODEL = "SmolLM2-135M-Instruct"
HARDWARE = "cpu-core"  # one engine pinned to one core: the unit of the budget here
DEPLOYMENTS = {
    "1P1D": {"prefill": 1, "decode": 1},
    "2agg": {"aggregated": 2},
    "1agg": {"aggregated": 1},
    "2P1D": {"prefill": 2, "decode": 1},
    "1P2D": {"prefill": 1, "decode": 2},
    "1P1D-remote": {"prefill": 1, "decode": 1},
}
# Deployments whose router sends every prompt through the prefill pool, as the
# P/D profiles were taken (the others run the router's defaults).
ROUTER_ARGS = {"1P1D-remote": PD_PROFILE_ROUTER_ARGS}
STACK_ROLES = {"prefill": "prefill", "decode": "decode", "aggregated": "aggregated"}


def kv_capacity_tokens(metrics_url: str) -> int | None:
    """num_gpu_blocks × block_size from vLLM's cache_config_info."""
    text = httpx.get(metrics_url, timeout=10).text
    m = re.search(r"vllm:cache_config_info\{([^}]*)\}", text)
    if not m:
        return None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


def start_stack(
    replicas: dict[str, int],
    kv_cache_gib: int,
    log_dir: Path,
    kv_store: bool,
    router_args: tuple[str, ...] = (),
):
    from common.ports import free_port
    from services.stack import Stack, StackConfig

    cfg = StackConfig(
        prefill=replicas.get("prefill", 0),
        decode=replicas.get("decode", 0),
        aggregated=replicas.get("aggregated", 0),
        router_port=free_port(),
        kv_cache_gib=kv_cache_gib,
        max_model_len=4096,
        kv_store=kv_store,
        router_args=list(router_args),
        state_dir=Path(tempfile.mkdtemp(prefix="tandem-planner-", dir=log_dir)),
    )
    stack = Stack(cfg)
    t0 = time.time()
    stack.start()
    log(f"stack {replicas} up in {time.time() - t0:.0f} s at {stack.router_url}")
    return stack


def engine_kv(stack, role_prefix: str) -> int | None:
    procs = [p for p in stack.procs if p.name.startswith(role_prefix) and p.url]
    return kv_capacity_tokens(procs[0].url) if procs else None


async def _profile(
    role: PoolRole,
    stack,
    sessions,
    info,
    tok,
    base: ReplayConfig,
    levels: list[int],
    level_s: float,
    ceiling: float,
    kv: int | None,
    workload: str,
    out: Path,
) -> EngineProfile:
    """Profile one role; its ConfigMap is written at once (a run cut short
    keeps the profiles it finished)."""
    name = f"smollm2-cpu-{role}"
    config = engine_config(role, name, MODEL, 1, HARDWARE, Parallelism(), [], kv)
    profile, _ = await profile_pool(
        role,
        stack.router_url,
        sessions,
        info,
        tok,
        replace(base, model=MODEL),
        config,
        1,
        levels,
        level_s,
        ceiling,
        workload,
        log=log,
    )
    (out / f"profile-{role}.yaml").write_text(manifests_yaml([profile_configmap(profile, name)]))
    return profile


async def _sweep_levels(
    stack,
    name: str,
    sessions,
    info,
    tok,
    base: ReplayConfig,
    concurrencies: list[int],
    level_s: float,
) -> list[dict[str, Any]]:
    source = RouterScrapeSource([stack.router_url])
    out = []
    try:
        for c in concurrencies:
            cfg = replace(
                base, url=stack.router_url, model=MODEL, concurrency=c, duration_s=level_s
            )
            run, w = await measure_level(source, f"{name}-c{c}", sessions, info, tok, cfg)
            s = run["summary"]
            log(
                f"sweep {name} c={c}: {s['requests_per_s'] or 0:.3f} req/s, TTFT p90 "
                f"{s['ttft_p90'] or 0:.2f} s, hit {s['hit_rate'] or 0:.1%}, "
                f"failures {s['failures']}"
            )
            out.append(
                {
                    "concurrency": c,
                    "summary": s,
                    "window": None
                    if w is None
                    else {
                        "seconds": w.seconds,
                        "pools": {r: asdict(p) for r, p in w.pools.items()},
                    },
                    "_window": w,
                }
            )
    finally:
        await source.aclose()
    return out


NO_GOODPUT = "none (no deployment met the SLO)"


def best_per_core(rows: list[dict[str, Any]], rate: str) -> str | None:
    """The deployment with the highest ``rate`` per core; None when every rate
    is zero (a tie at zero names no winner)."""
    best = max(rows, key=lambda r: r[rate] / r["cores"], default=None)
    return best["deployment"] if best is not None and best[rate] > 0 else None


def _plan_json(plan: Plan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "label": plan.label(),
        "gpus": plan.gpus,
        "capacity_rps": plan.capacity_rps,
        "ratio": plan.ratio,
        "pools": [
            {
                "role": p.role,
                "config": p.config,
                "replicas": p.replicas,
                "capacity_rps": p.capacity_rps,
                "limit": p.point.limit,
                "per_group_rps": p.point.capacity_rps,
            }
            for p in plan.pools
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.planner_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--levels",
        default="1,2,4,8,16",
        help="profile concurrencies, until throughput stops growing",
    )
    ap.add_argument("--level-s", type=float, default=60.0, help="seconds per level")
    ap.add_argument("--sweep", default="2,4,8", help="Phase 2 concurrencies")
    ap.add_argument(
        "--deployments",
        default="1P1D,2agg",
        help=f"Phase 2 deployments, from {sorted(DEPLOYMENTS)}",
    )
    ap.add_argument("--slo-ttft-p90", type=float, default=5.0, help="TTFT p90 SLO, s")
    ap.add_argument(
        "--ttft-ceiling",
        type=float,
        default=30.0,
        help="stop profiling a pool once its TTFT p90 passes this, s",
    )
    ap.add_argument("--sessions", type=int, default=32, help="sessions of the small profile")
    ap.add_argument(
        "--decode-out-median",
        type=int,
        default=96,
        help="output tokens per request (median) for the decode profile",
    )
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per engine, GiB")
    ap.add_argument(
        "--no-kv-store",
        action="store_true",
        help="stacks without the shared KV store (less memory)",
    )
    ap.add_argument("--think-scale", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-profiles", help="profiles.yaml from an earlier run: go to step 3")
    ap.add_argument(
        "--retake",
        help="with --skip-profiles: roles to profile again (e.g. "
        "prefill,decode); the others come from the file",
    )
    ap.add_argument("--out", help="output directory")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from common.model import resolve_model
    from operators.planner.profiles import profiles_from_yaml

    started = time.time()
    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-planner")
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in a.levels.split(",")]
    sweep = [int(c) for c in a.sweep.split(",")]
    deployments = [d for d in a.deployments.split(",") if d]
    unknown = [d for d in deployments if d not in DEPLOYMENTS]
    if unknown:
        log(f"unknown deployment(s) {unknown}; choose from {sorted(DEPLOYMENTS)}")
        return 2
    sessions, info = generate.generated_trace("small", sessions=a.sessions, seed=a.seed)
    long_out, long_info = generate.generated_trace(
        "small",
        sessions=a.sessions,
        seed=a.seed,
        out_median=a.decode_out_median,
        out_max=min(4 * a.decode_out_median, 1024),
    )
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    base = ReplayConfig(
        url="", model=MODEL, think_scale=a.think_scale, timeout_s=600.0, progress=False
    )
    stats = info["stats"]
    workload = (
        f"small agentic trace, {a.sessions} sessions, seed {a.seed}, think x"
        f"{a.think_scale:g}; {stats['requests']} requests"
    )
    timings: dict[str, float] = {}

    kept = profiles_from_yaml(Path(a.skip_profiles).read_text()) if a.skip_profiles else []
    retake = (
        {r for r in a.retake.split(",") if r}
        if a.retake is not None
        else set()
        if a.skip_profiles
        else set(STACK_ROLES)
    )
    if retake - set(STACK_ROLES):
        log(f"--retake {a.retake}: roles are {sorted(STACK_ROLES)}")
        return 2
    taken: dict[str, EngineProfile] = {}
    if retake & {"prefill", "decode"}:
        t0 = time.time()
        stack = start_stack(
            {"prefill": 1, "decode": 1},
            a.kv_cache_gib,
            out,
            not a.no_kv_store,
            PD_PROFILE_ROUTER_ARGS,
        )
        try:
            if "prefill" in retake:
                taken["prefill"] = asyncio.run(
                    _profile(
                        "prefill",
                        stack,
                        sessions,
                        info,
                        tok,
                        base,
                        levels,
                        a.level_s,
                        a.ttft_ceiling,
                        engine_kv(stack, "prefill"),
                        workload,
                        out,
                    )
                )
                timings["profile_prefill_s"] = time.time() - t0
            if "decode" in retake:
                t1 = time.time()
                taken["decode"] = asyncio.run(
                    _profile(
                        "decode",
                        stack,
                        long_out,
                        long_info,
                        tok,
                        base,
                        levels,
                        a.level_s,
                        a.ttft_ceiling,
                        engine_kv(stack, "decode"),
                        workload + f", outputs median {a.decode_out_median}",
                        out,
                    )
                )
                timings["profile_decode_s"] = time.time() - t1
        finally:
            stack.stop()
    if "aggregated" in retake:
        t0 = time.time()
        stack = start_stack({"aggregated": 1}, a.kv_cache_gib, out, not a.no_kv_store)
        try:
            taken["aggregated"] = asyncio.run(
                _profile(
                    "aggregated",
                    stack,
                    sessions,
                    info,
                    tok,
                    base,
                    levels,
                    a.level_s,
                    a.ttft_ceiling,
                    engine_kv(stack, "engine"),
                    workload,
                    out,
                )
            )
        finally:
            stack.stop()
        timings["profile_aggregated_s"] = time.time() - t0
    profiles = [taken.get(p.role, p) for p in kept]
    profiles += [p for role, p in taken.items() if role not in {q.role for q in kept}]
    if taken:
        (out / "profiles.yaml").write_text(
            manifests_yaml(
                [profile_configmap(p, f"smollm2-cpu-{p.role}") for p in profiles],
                header=(
                    "Profiles of SmolLM2-135M on one CPU core per engine (bench/planner_sweep.py)"
                ),
            )
        )

    # 3. The solver for the trace's shape, each configuration's own hit rate.
    shape = {
        "mean_input_tokens": stats["total_in_tokens"] / stats["requests"],
        "mean_output_tokens": stats["total_out_tokens"] / stats["requests"],
    }
    slo = Slo(ttft_p90_s=a.slo_ttft_p90)
    decisions = {}
    for label, budget, s in (
        ("budget 2, no SLO", 2, Slo()),
        ("budget 2, SLO", 2, slo),
        ("budget 16, SLO", 16, slo),
        ("budget 64, no SLO", 64, Slo()),
    ):
        d = solve(Problem(tuple(profiles), Demand(None, **shape), s, budget_gpus=budget))
        decisions[label] = {
            "plan": _plan_json(d.plan),
            "binding": d.binding,
            "reasons": list(d.reasons),
            "changes": list(d.changes),
        }
        log(f"solver, {label}: {d.plan.label() if d.plan else 'no plan'} ({d.binding})")
        for r in d.reasons:
            log(f"  {r}")

    # 4. Phase 2 sweep.
    by_role = {p.role: p for p in profiles}
    rows = []
    for name in deployments:
        replicas = DEPLOYMENTS[name]
        configs = {role: by_role[role].name for role in replicas}
        predicted = fixed_plan(
            Problem(tuple(profiles), Demand(None, **shape), slo), replicas, configs
        )
        peak = fixed_plan(Problem(tuple(profiles), Demand(None, **shape)), replicas, configs)
        t0 = time.time()
        stack = start_stack(
            replicas, a.kv_cache_gib, out, not a.no_kv_store, ROUTER_ARGS.get(name, ())
        )
        try:
            levels_out = asyncio.run(
                _sweep_levels(stack, name, sessions, info, tok, base, sweep, a.level_s)
            )
        finally:
            stack.stop()
        timings[f"sweep_{name}_s"] = time.time() - t0
        meeting = [
            lv
            for lv in levels_out
            if not lv["summary"]["failures"]
            and (lv["summary"]["ttft_p90"] or 1e9) <= a.slo_ttft_p90
        ]
        measured = max((lv["summary"]["requests_per_s"] or 0 for lv in meeting), default=0.0)
        efficiency: dict[str, list[float]] = {}
        for lv in levels_out:
            w = lv.pop("_window")
            if w is None:
                continue
            for m in measurements_of(w, replicas):
                e = measure_efficiency(by_role[m.role], m)
                if e is not None and m.requests >= 10:
                    efficiency.setdefault(m.role, []).append(e)
        rows.append(
            {
                "deployment": name,
                "cores": sum(replicas.values()),
                "predicted_rps": predicted.capacity_rps if isinstance(predicted, Plan) else 0.0,
                "predicted_why": None if isinstance(predicted, Plan) else predicted.reason,
                "measured_rps": measured,
                "levels": levels_out,
                "predicted_peak_rps": peak.capacity_rps if isinstance(peak, Plan) else 0.0,
                "measured_peak_rps": max(lv["summary"]["requests_per_s"] or 0 for lv in levels_out),
                "efficiency": {r: sum(v) / len(v) for r, v in efficiency.items()},
            }
        )
    predicted_best = best_per_core(rows, "predicted_rps")
    measured_best = best_per_core(rows, "measured_rps")
    timings["total_s"] = time.time() - started
    doc = {
        "profiles": [p.name for p in profiles],
        "shape": shape,
        "slo_ttft_p90": a.slo_ttft_p90,
        "decisions": decisions,
        "sweep": rows,
        "predicted_best": predicted_best,
        "measured_best": measured_best,
        "timings_s": timings,
        "args": vars(a),
    }
    (out / "planner.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "report.md").write_text(_markdown(doc, profiles))
    log(f"report: {out / 'report.md'} ({timings['total_s'] / 60:.1f} min)")
    return 0


def _markdown(doc: dict[str, Any], profiles: list[EngineProfile]) -> str:
    lines = [
        "# Rate matching on this machine",
        "",
        "## Phase 1 profiles (per replica)",
        "",
        (
            "| role | concurrency | req/s | in tok/s | out tok/s | TTFT p50/p90 s | ITL ms | "
            "P90 inter. tok/s | hit | in flight |"
        ),
        ("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"),
    ]
    for p in profiles:
        for pt in p.points:
            lines.append(
                f"| {p.role} | {pt.concurrency:g} | {pt.request_rate:.3f} | "
                f"{pt.input_tokens_per_s:.0f} | {pt.output_tokens_per_s:.1f} | "
                f"{pt.ttft_p50_s or 0:.2f}/{pt.ttft_p90_s or 0:.2f} | "
                f"{(pt.itl_s or 0) * 1000:.0f} | {pt.interactivity_p90 or 0:.1f} | "
                f"{pt.hit_rate:.1%} | {pt.in_flight or 0:.2f} |"
            )
    lines += ["", "## The solver for the agentic trace", ""]
    for label, d in doc["decisions"].items():
        plan = d["plan"]["label"] if d["plan"] else "no plan"
        lines += [f"**{label}** → {plan} ({d['binding']})", ""]
        lines += [f"* {r}" for r in d["reasons"]] + [f"* change: {c}" for c in d["changes"]] + [""]
    lines += [
        "## Phase 2 sweep",
        "",
        f"Goodput = the highest request rate with TTFT p90 ≤ {doc['slo_ttft_p90']:g} s.",
        "",
        (
            "| deployment | cores | predicted req/s | measured req/s | measured ÷ predicted | "
            "efficiency by pool |"
        ),
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in doc["sweep"]:
        ratio = r["measured_rps"] / r["predicted_rps"] if r["predicted_rps"] else float("nan")
        eff = ", ".join(f"{k} {v:.2f}" for k, v in r["efficiency"].items())
        lines.append(
            f"| {r['deployment']} | {r['cores']} | {r['predicted_rps']:.3f} | "
            f"{r['measured_rps']:.3f} | {ratio:.2f} | {eff} |"
        )
    lines += [
        "",
        "Throughput with no SLO: the solver's capacity for the deployment against "
        "the highest request rate any level reached.",
        "",
        "| deployment | predicted req/s | measured peak req/s | measured ÷ predicted |",
        "|---|---:|---:|---:|",
    ]
    for r in doc["sweep"]:
        peak = r["predicted_peak_rps"]
        lines.append(
            f"| {r['deployment']} | {peak:.3f} | {r['measured_peak_rps']:.3f} | "
            f"{r['measured_peak_rps'] / peak if peak else float('nan'):.2f} |"
        )
    lines += [
        "",
        (
            f"Predicted best per core: **{doc['predicted_best'] or NO_GOODPUT}**; "
            f"measured best: **{doc['measured_best'] or NO_GOODPUT}**."
        ),
        "",
        "Levels:",
        "",
        "| deployment | c | req/s | TTFT p50/p90 s | P90 inter. | hit | failures |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["sweep"]:
        for lv in r["levels"]:
            s = lv["summary"]
            lines.append(
                f"| {r['deployment']} | {lv['concurrency']} | "
                f"{s['requests_per_s'] or 0:.3f} | {s['ttft_p50'] or 0:.2f}/"
                f"{s['ttft_p90'] or 0:.2f} | {s['interactivity_p90'] or 0:.1f} | "
                f"{s['hit_rate'] or 0:.1%} | {s['failures']} |"
            )
    lines += [
        "",
        "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in doc["timings_s"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
