"""`tandem sim`: the serving cluster simulated, with the router's routing core
and cost models fitted from engine profiles (sim/README.md).

    tandem sim run     one configuration: prefix hit rate, TTFT, interactivity, tok/s per GPU
    tandem sim sweep   a grid of configurations as Ray tasks: one CSV, a table, a plot
    tandem sim validate  the measured runs of sim/measured.json simulated: off by how much
    tandem sim solve   the planner's solver on the same profiles and trace: its P:D within a budget

Pods are N (aggregated) or xPyD (prefill and decode). Speeds come from
engine profiles (`--profiles`, ConfigMaps as `tandem profile` writes them or
operators/planner/published; default: the CPU profiles of SmolLM2-135M shipped
in sim/profiles), scaled to `--gpus-per-pod`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from operators.planner.solver import Demand, Problem, solve
from services.router.routing.strategies import POLICIES
from sim import validation
from sim.cluster import Traffic
from sim.defaults import (
    CPU_BLOCK_BYTES_PER_TOKEN,
    CPU_MEASURED_PROFILES,
    CPU_PROFILES,
    CPU_STEP_MODEL,
    engine_model,
    load_profiles,
    scaled_profile,
)
from sim.sweep import grid, model_fields, parse_pods, plot, run_on_ray, run_point, table, write_csv
from tandem.workload.generate import trace_stats


def _csv(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


def _pods(text: str) -> str:
    try:
        parse_pods(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _pods_list(text: str) -> list[str]:
    return [_pods(v) for v in text.split(",") if v.strip()]


def _policies(text: str) -> list[str]:
    names = [v for v in text.split(",") if v.strip()]
    for n in names:
        if n not in POLICIES:
            raise argparse.ArgumentTypeError(f"policy {n!r}: choose from {', '.join(POLICIES)}")
    return names


def add_step_model(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--step-model",
        type=Path,
        default=None,
        help="a step model measured term by term (python -m bench.step_costs --out) "
        "instead of the one fitted from --profiles",
    )


def add_shared_core(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--shared-core-s",
        type=float,
        default=0.0,
        help="core time other processes take from an engine's step per prompt it computes, "
        "where they share its cores (the validation runs' router, client and vLLM's "
        'scheduler processes; sim/README.md, "Validation")',
    )


def add_common(p: argparse.ArgumentParser, sweep: bool = False, step_model: bool = True) -> None:
    g = p.add_argument_group("engines")
    g.add_argument("--profiles", type=Path, default=CPU_PROFILES, help="engine profiles (YAML)")
    if step_model:
        add_step_model(g)
    g.add_argument("--gpus-per-pod", type=int, default=1, help="GPUs (cores on CPU) per pod")
    g.add_argument("--block-size", type=int, default=128, help="KV block size, tokens")
    g.add_argument(
        "--block-bytes",
        type=int,
        default=None,
        help="bytes of one KV block (store loads, P->D transfers); default: "
        "SmolLM2-135M in float32",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="step token budget")
    g.add_argument(
        "--max-num-seqs", type=int, default=256, help="requests a pod runs at once (per step)"
    )
    g.add_argument(
        "--long-prefill-threshold", type=int, default=0, help="per-request chunk cap (0: off)"
    )
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="engines without vLLM's asynchronous scheduling (its default): then a request "
        "that arrives during a step joins the next one, not the one after",
    )
    add_shared_core(g)
    g.add_argument(
        "--step-by-step",
        action="store_true",
        help="plan every engine step over its whole batch instead of stepping batches of "
        "only decodes as runs (the same figures, slower: a check of the runs)",
    )
    g.add_argument("--link-gbps", type=float, default=5.0, help="P->D transfer, GB/s")
    g.add_argument("--link-latency-ms", type=float, default=1.0, help="P->D transfer latency")
    g.add_argument("--store-gbps", type=float, default=1.0, help="KV store load, GB/s")
    g.add_argument("--store-latency-ms", type=float, default=2.0, help="KV store load latency")
    g.add_argument(
        "--store-disk-blocks", type=int, default=0, help="the store's disk tier (0: none)"
    )
    g.add_argument("--store-disk-gbps", type=float, default=0.5, help="disk tier load, GB/s")
    g.add_argument(
        "--store-disk-latency-ms", type=float, default=10.0, help="disk tier load latency"
    )
    g.add_argument(
        "--store-pin-ttl-s",
        type=float,
        default=0.0,
        help="soft-pin the blocks sessions write this long (the router's --kv-retention-ttl-s; "
        "0: no pins)",
    )
    r = p.add_argument_group("router")
    r.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=256,
        help="P/D: below this many uncached tokens the decode pod prefills",
    )
    r.add_argument(
        "--store-load-weight",
        type=float,
        default=1.0,
        help="cost policy: a token another pod holds costs this share of computing it on a "
        "pod that lacks it (the router's --store-load-weight; 1: the router's default)",
    )
    r.add_argument(
        "--routing-index-capacity",
        type=int,
        default=None,
        help="most block hashes the router's prefix index keeps (the router's flag; "
        "default: the router's)",
    )
    r.add_argument(
        "--live-max-blocks",
        type=int,
        default=None,
        help="most block hashes the router's live sessions hold in all (default: the router's)",
    )
    # A sweep takes comma lists of both: grid axes.
    r.add_argument(
        "--router-replicas",
        type=_csv(int) if sweep else int,
        default=[1] if sweep else 1,
        help="router replicas (routing cores), requests spread over them in turn"
        + (" (comma list)" if sweep else ""),
    )
    r.add_argument(
        "--state-lag-ms",
        type=_csv(float) if sweep else float,
        default=[0.0] if sweep else 0.0,
        help="until one replica's shared-state writes (bindings, load) reach the others"
        + (" (comma list)" if sweep else ""),
    )
    t = p.add_argument_group("traffic (tandem.workload's generator, played as the replay client)")
    t.add_argument(
        "--trace",
        default=None,
        help="AgentX-format trace file or folder to replay (instead of generating one)",
    )
    t.add_argument("--trace-profile", default="small", help="generator profile: small or agentx")
    t.add_argument("--turns-median", type=float, default=4.0, help="median turns per session")
    t.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    t.add_argument(
        "--concurrency", type=int, default=4, help="session lanes (0: every session at once)"
    )


def base_point(a: argparse.Namespace) -> dict[str, Any]:
    bs = a.block_size
    return {
        "model": model_fields(engine_model(a.profiles, a.step_model, a.gpus_per_pod)),
        "gpus_per_pod": a.gpus_per_pod,
        "block_size": bs,
        "block_bytes": a.block_bytes or bs * CPU_BLOCK_BYTES_PER_TOKEN,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_num_seqs": a.max_num_seqs,
        "long_prefill_threshold": a.long_prefill_threshold,
        "decode_runs": not a.step_by_step,
        "async_scheduling": not a.no_async_scheduling,
        "shared_core_s": a.shared_core_s,
        "link_gbps": a.link_gbps,
        "link_latency_ms": a.link_latency_ms,
        "store_gbps": a.store_gbps,
        "store_latency_ms": a.store_latency_ms,
        "store_disk_blocks": a.store_disk_blocks,
        "store_disk_gbps": a.store_disk_gbps,
        "store_disk_latency_ms": a.store_disk_latency_ms,
        "store_pin_ttl_s": a.store_pin_ttl_s,
        "remote_prefill_threshold": a.remote_prefill_threshold,
        "store_load_weight": a.store_load_weight,
        "index_capacity": a.routing_index_capacity,
        "live_max_blocks": a.live_max_blocks,
        "router_replicas": a.router_replicas,
        "state_lag_ms": a.state_lag_ms,
        "trace_file": a.trace,
        "trace_profile": a.trace_profile,
        "turns_median": a.turns_median,
        "think_scale": a.think_scale,
        "concurrency": a.concurrency,
    }


def cmd_run(a: argparse.Namespace) -> int:
    point = dict(
        base_point(a),
        policy=a.policy,
        pods=a.pods,
        kv_blocks=a.kv_blocks,
        store_blocks=a.store_blocks,
        sessions=a.sessions,
        seed=a.seed,
        miss_reasons=a.miss_reasons,
    )
    row = run_point(point)
    print(json.dumps(row, indent=1) if a.json else table([row]))
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    points = grid(
        base_point(a),
        policy=a.policies,
        pods=a.pods,
        kv_blocks=a.kv_blocks,
        store_blocks=a.store_blocks,
        sessions=a.sessions,
        seed=a.seeds,
        router_replicas=a.router_replicas,
        state_lag_ms=a.state_lag_ms,
    )
    print(f"{len(points)} simulations on Ray ({a.address or 'local'})", file=sys.stderr)
    t0 = time.perf_counter()
    rows = run_on_ray(points, a.address, a.num_cpus)
    wall = time.perf_counter() - t0
    print(table(rows))
    out = a.out or Path("sim-results") / time.strftime("%Y%m%d-%H%M%S")
    csv_path = write_csv(rows, out / "sweep.csv")
    print(f"\n{len(rows)} rows in {wall:.1f} s wall: {csv_path}", file=sys.stderr)
    if not a.no_plot:
        print(f"plot: {plot(rows, out / 'sweep.png')}", file=sys.stderr)
    return 0


def cmd_validate(a: argparse.Namespace) -> int:
    measured = validation.load_measured(a.measured)
    if a.profiles or a.step_model:
        model = engine_model(a.profiles or CPU_PROFILES, a.step_model)
    else:
        model = validation.engines_model()
    if a.calibrate_on:
        sessions, blocks = a.calibrate_on
        on = [m for m in measured if (m.sessions, m.kv_blocks) == (sessions, blocks)]
        if not on:
            raise ValueError(f"no measured run of {sessions} sessions and {blocks} blocks")
        prefill, decode = validation.calibrate(
            on, model, a.store_blocks, shared_core_s=a.shared_core_s
        )
        print(f"calibrated on {on[0].regime}: prefill {prefill:.2f}x, decode {decode:.2f}x slower")
        model = validation.slowed(model, prefill, decode)
    rows = validation.compare(measured, model, a.store_blocks, a.shared_core_s)
    print(json.dumps(validation.to_json(rows), indent=1) if a.json else validation.table(rows))
    return 0


def cmd_solve(a: argparse.Namespace) -> int:
    """The solver's most capacity within ``--budget`` GPUs for the trace's mean
    prompt and output tokens at ``--hit-rate`` (to set beside the simulated splits)."""
    traffic = Traffic(a.trace_profile, a.sessions, a.turns_median, a.seed, trace_file=a.trace)
    stats = trace_stats(traffic.generate())
    profiles = tuple(scaled_profile(p, a.gpus_per_pod) for p in load_profiles(a.profiles).values())
    demand = Demand(
        None,  # sized for the budget alone
        stats["total_in_tokens"] / stats["requests"],
        stats["total_out_tokens"] / stats["requests"],
        a.hit_rate,
    )
    decision = solve(Problem(profiles, demand, budget_gpus=a.budget, headroom=1.0))
    print(
        f"trace: {stats['requests']} requests, mean prompt {demand.mean_input_tokens:.0f}, "
        f"output {demand.mean_output_tokens:.0f} tokens, hit rate {a.hit_rate:.3f}"
    )
    for kind, plan in (
        ("disaggregated", decision.best_disaggregated),
        ("aggregated", decision.best_aggregated),
    ):
        if plan is not None:
            pools = " + ".join(f"{p.replicas} {p.role}" for p in plan.pools)
            print(f"{kind}: {pools} = {plan.gpus} GPUs, {plan.capacity_rps:.3g} req/s")
    print(decision.reasons[0])
    return 0


def _regime(text: str) -> tuple[int, int]:
    try:
        sessions, blocks = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write SESSIONS,BLOCKS, e.g. 10,64") from None
    return sessions, blocks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="simulate one configuration",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--policy", choices=POLICIES, default="cost", help="routing policy")
    run.add_argument("--pods", type=_pods, default="2", help="N aggregated, or xPyD")
    run.add_argument("--kv-blocks", type=int, default=8192, help="KV blocks per pod")
    run.add_argument("--store-blocks", type=int, default=0, help="KV store capacity (0: no store)")
    run.add_argument("--sessions", type=int, default=4, help="sessions")
    run.add_argument("--seed", type=int, default=0, help="trace seed")
    run.add_argument("--json", action="store_true", help="print the row as JSON")
    run.add_argument(
        "--miss-reasons",
        action="store_true",
        help="count the computed prompt tokens by reason (new, evicted, elsewhere, tail; "
        "a record of every block computed: more memory)",
    )
    add_common(run)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser(
        "sweep",
        help="simulate a grid of configurations as Ray tasks",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sweep.add_argument(
        "--policies",
        type=_policies,
        default=["cost", "round-robin", "least-load"],
        help=f"comma list of routing policies ({', '.join(POLICIES)})",
    )
    sweep.add_argument("--pods", type=_pods_list, default=["2"], help="comma list: N or xPyD")
    sweep.add_argument("--kv-blocks", type=_csv(int), default=[24, 8192], help="comma list")
    sweep.add_argument("--store-blocks", type=_csv(int), default=[0], help="comma list (0: none)")
    sweep.add_argument("--sessions", type=_csv(int), default=[4], help="comma list")
    sweep.add_argument("--seeds", type=_csv(int), default=[0], help="comma list")
    sweep.add_argument(
        "--address", default=None, help="a Ray cluster's address (None: a local Ray)"
    )
    sweep.add_argument("--num-cpus", type=int, default=None, help="local Ray's CPUs (None: all)")
    sweep.add_argument("--out", type=Path, default=None, help="results folder")
    sweep.add_argument("--no-plot", action="store_true", help="write no plot")
    add_common(sweep, sweep=True)
    sweep.set_defaults(func=cmd_sweep)

    solver = sub.add_parser(
        "solve",
        help="the solver's P:D within a GPU budget for a trace, beside the simulated splits",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    solver.add_argument("--budget", type=int, required=True, help="GPUs")
    solver.add_argument(
        "--hit-rate", type=float, default=0.0, help="prefix hit rate (a simulated one)"
    )
    solver.add_argument("--sessions", type=int, default=4, help="sessions")
    solver.add_argument("--seed", type=int, default=0, help="trace seed")
    add_common(solver, step_model=False)
    solver.set_defaults(func=cmd_solve)

    val = sub.add_parser(
        "validate",
        help="simulate the measured runs and say how far off the simulation is",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    val.add_argument(
        "--measured", type=Path, default=validation.MEASURED, help="measured runs (JSON)"
    )
    val.add_argument(
        "--profiles",
        type=Path,
        default=None,
        help="engine profiles (YAML) to fit the engines' step model from (default: the "
        f"prompt side from `tandem profile` of the runs' engines, sim/profiles/"
        f"{CPU_MEASURED_PROFILES.name}, the decode side measured term by term, "
        f"{CPU_STEP_MODEL.name})",
    )
    add_step_model(val)
    add_shared_core(val)
    val.add_argument(
        "--store-blocks",
        type=int,
        default=validation.STORE_BLOCKS,
        help="the store's capacity in blocks, for runs with the store",
    )
    val.add_argument(
        "--calibrate-on",
        type=_regime,
        default=None,
        help="SESSIONS,BLOCKS: first slow the engines down to the speed those runs "
        "measured (a loaded machine), then simulate them all",
    )
    val.add_argument("--json", action="store_true", help="print the rows as JSON")
    val.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"tandem sim: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
