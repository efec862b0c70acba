"""Long-prefill threshold: vLLM's ``--long-prefill-token-threshold`` off vs
512 vs 2048 tokens, aggregated and P/D, on an agentic replay that mixes long
fresh first turns (about 2K new tokens each) with append turns and sub-agent
forks. Ratios against "off" from one run.

Every configuration is its own embedded stack (the threshold is a start-up
setting), started, replayed and stopped in turn; at most two engines are up
at a time. The order interleaves the configurations (agg-off, pd-off,
agg-512, …; reversed in every second round) so that the shared machine's
drift touches all of them alike, and the load average is recorded around
every replay. Each replay uses a fresh content salt (no run inherits another's
cache). The threshold is set on every pool of the stack; in P/D it binds only
on the prefill pool, since the decode pool computes only remainders shorter
than the router's --remote-prefill-threshold (256 tokens).

With vLLM's default step budget (--max-num-batched-tokens 2048), a threshold
of 2048 cannot bind: a step never schedules more than 2048 tokens anyway, so
"2048" runs exactly the scheduling of "off" and its ratios show this
machine's run-to-run noise (pass --max-num-batched-tokens 8192 to make it
bind, as on the GPUs of the published results).

Reported per configuration: TPGS (input tokens, cached included, plus output
tokens per second, per engine core: 1 for aggregated, 2 for P/D), P90
interactivity, TTFT p50/p90/p99, the TTFT of the long requests (those with at
least --long-tokens uncached prompt tokens), and the engines' mean phase
times (services/engine/metrics.py).

    python -m bench.long_prefill [--modes agg,pd] [--thresholds off,512,2048] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import request_phases
from bench.agentx import report
from bench.agentx.embedded import CONFIGS
from bench.harness import RESULTS, log, sigterm_as_interrupt
from common.ports import free_port
from common.scheduler import POOLS, SchedulerSettings, parse_per_pool
from services.stack import Stack, StackConfig
from tandem.workload import generate, metrics
from tandem.workload.content import PromptBuilder
from tandem.workload.endpoint import served_model
from tandem.workload.metrics import cell
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts, new_salt
from tandem.workload.runs import make_run, write_run

MODES = CONFIGS  # agg: one aggregated engine; pd: one prefill + one decode engine
PHASES = ("admission", "queue", "prefill", "kv_pull", "first_decode_step")


@dataclass(frozen=True)
class Config:
    mode: str  # "agg" or "pd"
    threshold: int  # 0 = off

    @property
    def label(self) -> str:
        return f"{self.mode}-{self.threshold or 'off'}"

    @property
    def engine_cores(self) -> int:
        return sum(MODES[self.mode].values())


def parse_thresholds(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            values.append(0 if part == "off" else int(part))
        except ValueError:
            raise ValueError(
                f"--thresholds {text!r}: {part!r} is neither 'off' nor a number of tokens"
            ) from None
    if values[0] != 0:
        raise ValueError(f"--thresholds {text!r}: the first must be 'off' (the baseline)")
    return values


def plan(modes: list[str], thresholds: list[int], rounds: int) -> list[Config]:
    """Configurations in run order: thresholds interleaved across modes,
    every second round reversed (a linear drift then weighs on all alike)."""
    one = [Config(mode, t) for t in thresholds for mode in modes]
    order: list[Config] = []
    for r in range(rounds):
        order += one if r % 2 == 0 else one[::-1]
    return order


def long_requests(records: list[dict], long_tokens: int) -> list[dict]:
    """Successful requests whose prompt had at least `long_tokens` tokens the
    serving engine did not have cached (long fresh prefills)."""
    return [
        r
        for r in records
        if r.get("ok")
        and r.get("prompt_tokens")
        and r["prompt_tokens"] - (r.get("cached_tokens") or 0) >= long_tokens
    ]


def summarize(cfg: Config, runs: list[dict], long_tokens: int) -> dict:
    """One configuration's figures over all its runs (requests pooled,
    durations added)."""
    records = [r for run in runs for r in run["records"]]
    s = metrics.summarize(records, sum(run["summary"]["duration_s"] for run in runs))
    longs = long_requests(records, long_tokens)
    return {
        "label": cfg.label,
        "mode": cfg.mode,
        "threshold": cfg.threshold,
        "runs": len(runs),
        "requests": s["requests"],
        "failures": s["failures"],
        "tpgs": s["total_tokens_per_s"] / cfg.engine_cores if s["total_tokens_per_s"] else None,
        "interactivity_p90": s["interactivity_p90"],
        "ttft_p50": s["ttft_p50"],
        "ttft_p90": s["ttft_p90"],
        "ttft_p99": s["ttft_p99"],
        "long_requests": len(longs),
        "long_ttft_p50": metrics.percentile([r["ttft"] for r in longs], 50),
        "long_ttft_max": max((r["ttft"] for r in longs), default=None),
        "hit_rate": s["hit_rate"],
        "duration_s": s["duration_s"],
    }


def engine_phases(stack: Stack) -> dict[str, dict[str, float]]:
    """Mean seconds per phase, by engine role, from the engines' histograms."""
    found: dict[str, dict[str, float]] = {}
    for proc in stack.procs:
        if not proc.grpc:
            continue
        sums: dict[tuple[str, str], list[float]] = {}
        text = httpx.get(proc.url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for phase in PHASES:
                    base = f"tandem_engine_{phase}_seconds"
                    if sample.name in (f"{base}_sum", f"{base}_count"):
                        key = (sample.labels["role"], phase)
                        sums.setdefault(key, [0.0, 0.0])[sample.name.endswith("_count")] += (
                            sample.value
                        )
        for (role, phase), (total, count) in sums.items():
            if count:
                found.setdefault(role, {})[phase] = total / count
    return found


def scheduler_in_effect(stack: Stack) -> dict[str, str]:
    """Each engine's long-prefill threshold as it reports it (a check that the
    setting reached vLLM)."""
    found = {}
    for proc in stack.procs:
        if not proc.grpc:
            continue
        for family in text_string_to_metric_families(httpx.get(proc.url, timeout=10).text):
            for sample in family.samples:
                if sample.name == "tandem_engine_scheduler_info":
                    found[proc.name] = sample.labels["long_prefill_token_threshold"]
    return found


def run_one(cfg: Config, a, sessions, info, tok, out: Path) -> dict:
    """Start the configuration's stack, replay, stop; the run with what the
    engines measured and the load average around the replay."""
    pools = {
        pool: SchedulerSettings(
            long_prefill_token_threshold=cfg.threshold or None,
            max_num_batched_tokens=a.max_num_batched_tokens.get(pool),
        )
        for pool in POOLS
    }
    # The engines' per-request phase lines are DEBUG lines; their logs stay
    # in the run's directory beside its results.
    os.environ.setdefault("TANDEM_LOG_LEVEL", "DEBUG")
    config = StackConfig(
        router_port=free_port(),
        kv_cache_gib=1,
        max_model_len=4096,
        state_dir=out,
        kv_store=False,
        scheduler=pools,
        **MODES[cfg.mode],
    )
    stack = Stack(config)
    t0 = time.monotonic()
    try:
        stack.start()
        in_effect = scheduler_in_effect(stack)
        wrong = {name: v for name, v in in_effect.items() if v != str(cfg.threshold)}
        if wrong:
            raise RuntimeError(f"{cfg.label}: engines report threshold {wrong}")
        log(
            f"{cfg.label}: stack up in {time.monotonic() - t0:.0f}s, threshold in effect "
            f"{in_effect}"
        )
        builder = PromptBuilder(tok, salt=new_salt())
        prompts = build_prompts(sessions, builder)
        replay_cfg = ReplayConfig(
            url=stack.router_url,
            model=served_model(stack.router_url),
            concurrency=a.concurrency,
            think_scale=a.think_scale,
            timeout_s=a.timeout,
            progress=sys.stderr.isatty(),
        )
        load_before = os.getloadavg()
        result = asyncio.run(Replayer(replay_cfg, sessions, prompts, salt=builder.salt).run())
        load_after = os.getloadavg()
        run = make_run(cfg.label, result.to_json(), info)
        run["load_1min"] = [round(load_before[0], 1), round(load_after[0], 1)]
        run["engine_phases"] = engine_phases(stack)
        entries = [
            e
            for proc in stack.procs
            if proc.grpc
            for e in request_phases.parse_engine_log(Path(proc.log).read_text(), proc.name)
        ]
        run["request_phases"] = request_phases.join(run["records"], entries)
        write_run(run, out / "run.json")
        if result.interrupted:
            raise KeyboardInterrupt
        return run
    finally:
        stack.stop()


def mean_phases(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Mean of the runs' mean phase times, by role and phase."""
    collected: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for role, phases in run["engine_phases"].items():
            for phase, seconds in phases.items():
                collected.setdefault((role, phase), []).append(seconds)
    found: dict[str, dict[str, float]] = {}
    for (role, phase), values in collected.items():
        found.setdefault(role, {})[phase] = sum(values) / len(values)
    return found


def tables(rows: list[dict]) -> list[str]:
    lines = [
        "| config | requests | TPGS (tok/s/core) | P90 interactivity (tok/s/user) | "
        "TTFT p50 | p90 | p99 (s) | long requests | long TTFT p50 | max (s) | hit rate | "
        "load 1-min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['requests']} ({r['failures']} failed) | "
            f"{cell(r['tpgs'], '{:.0f}')} | {cell(r['interactivity_p90'])} | "
            f"{cell(r['ttft_p50'])} | {cell(r['ttft_p90'])} | "
            f"{cell(r['ttft_p99'])} | {r['long_requests']} | {cell(r['long_ttft_p50'])} | "
            f"{cell(r['long_ttft_max'])} | {cell(r['hit_rate'] and 100 * r['hit_rate'], '{:.1f}%')}"
            f" | {', '.join(f'{lo:.1f}→{hi:.1f}' for lo, hi in r['load'])} |"
        )
    lines += [
        "",
        "Ratios against the same mode with the threshold off (TTFT below 1 and "
        "TPGS / interactivity above 1 favour the threshold):",
        "",
        "| config | TPGS | P90 interactivity | TTFT p50 | p90 | p99 | long TTFT p50 | "
        "seeds' direction (interactivity up, long TTFT up) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r["mode"]: r for r in rows if r["threshold"] == 0}
    for r in rows:
        b = base.get(r["mode"])
        if r["threshold"] == 0 or b is None:
            continue
        ratio = {
            k: metrics.ratio(r[k], b[k])
            for k in (
                "tpgs",
                "interactivity_p90",
                "ttft_p50",
                "ttft_p90",
                "ttft_p99",
                "long_ttft_p50",
            )
        }
        inter, long_ttft = ratio["interactivity_p90"], ratio["long_ttft_p50"]
        verdict = (
            "—"
            if inter is None or long_ttft is None
            else "reproduces"
            if inter > 1 and long_ttft > 1
            else f"does not (interactivity {'up' if inter > 1 else 'down'}, long TTFT "
            f"{'up' if long_ttft > 1 else 'down'})"
        )
        lines.append(
            f"| {r['label']} | "
            + " | ".join(
                cell(ratio[k], "{:.2f}×")
                for k in (
                    "tpgs",
                    "interactivity_p90",
                    "ttft_p50",
                    "ttft_p90",
                    "ttft_p99",
                    "long_ttft_p50",
                )
            )
            + f" | {verdict} |"
        )
    lines += [
        "",
        "Engines' mean phase times (s; services/engine/metrics.py):",
        "",
        "| config | " + " | ".join(f"{role} {phase}" for role, phase in PHASE_COLUMNS) + " |",
        "|---|" + "---:|" * len(PHASE_COLUMNS),
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | "
            + " | ".join(
                cell(r["phases"].get(role, {}).get(phase), "{:.3f}")
                for role, phase in PHASE_COLUMNS
            )
            + " |"
        )
    return lines + [""]


PHASE_COLUMNS = (
    ("both", "admission"),
    ("both", "queue"),
    ("both", "prefill"),
    ("prefill", "admission"),
    ("prefill", "queue"),
    ("prefill", "prefill"),
    ("decode", "admission"),
    ("decode", "queue"),
    ("decode", "prefill"),
    ("decode", "kv_pull"),
    ("decode", "first_decode_step"),
)


def _per_pool_batched_tokens(text: str) -> dict[str, int]:
    try:
        return parse_per_pool("max_num_batched_tokens", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.long_prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--modes", default="agg,pd", help="agg, pd or both (default agg,pd)")
    ap.add_argument(
        "--thresholds",
        default="off,512,2048",
        help="long-prefill thresholds, 'off' first (default off,512,2048)",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="replays per configuration, interleaved (default 1)"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=_per_pool_batched_tokens,
        default={},
        help="engine step budget for every configuration: N for every pool, or "
        "POOL=N[,POOL=N] for the pools named (prefill, decode, aggregated; "
        "default: vLLM's, 2048)",
    )
    ap.add_argument("--sessions", type=int, default=6, help="sessions in the trace (default 6)")
    ap.add_argument("--turns-median", type=float, default=5, help="median turns per session")
    ap.add_argument(
        "--first-in-median",
        type=int,
        default=2304,
        help="median first-turn input, tokens, 512 of them shared by all "
        "sessions (default 2304: about 1.8K fresh)",
    )
    ap.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    ap.add_argument("-c", "--concurrency", type=int, default=3, help="session lanes (default 3)")
    ap.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=1024,
        help="a request is long when at least this many of its prompt tokens "
        "were not cached (default 1024)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, s")
    ap.add_argument(
        "--slowest",
        type=int,
        default=5,
        help="requests per replay in the per-phase table of slowest TTFTs (default 5)",
    )
    ap.add_argument("--out", help="output directory (default bench/results/<time>-long-prefill)")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from common.model import resolve_model

    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or a.rounds < 1:
        ap.error(f"--modes takes {', '.join(MODES)}; --rounds >= 1")
    try:
        thresholds = parse_thresholds(a.thresholds)
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-long-prefill")
    sessions, info = generate.generated_trace(
        "small",
        sessions=a.sessions,
        turns_median=a.turns_median,
        seed=a.seed,
        first_in_median=a.first_in_median,
        max_context=3584,
    )
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    order = plan(modes, thresholds, a.rounds)
    log(f"{len(order)} replays: {', '.join(c.label for c in order)}; results in {out}")
    runs: dict[Config, list[dict]] = {}
    problems: list[str] = []
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            for i, cfg in enumerate(order):
                try:
                    run = run_one(cfg, a, sessions, info, tok, out / f"{i:02d}-{cfg.label}")
                except Exception as exc:  # report the other configurations, say what failed
                    problems.append(f"**{cfg.label}: not measured** — {type(exc).__name__}: {exc}")
                    log(f"{cfg.label}: {type(exc).__name__}: {exc}")
                    continue
                runs.setdefault(cfg, []).append(run)
                s = run["summary"]
                log(
                    f"{cfg.label}: {s['ok']} ok, {s['failures']} failed, TTFT p50 "
                    f"{cell(s['ttft_p50'])} s, load {run['load_1min']} "
                    f"({(time.monotonic() - started) / 60:.1f} min so far)"
                )
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
    rows = []
    for cfg in sorted(runs, key=lambda c: (modes.index(c.mode), c.threshold)):
        row = summarize(cfg, runs[cfg], a.long_tokens)
        row["load"] = [run["load_1min"] for run in runs[cfg]]
        row["phases"] = mean_phases(runs[cfg])
        rows.append(row)
    minutes = (time.monotonic() - started) / 60
    command = " ".join(
        ["python -m bench.long_prefill", *(argv if argv is not None else sys.argv[1:])]
    )
    budget = ", ".join(f"{pool}={n}" for pool, n in a.max_num_batched_tokens.items())
    notes = [
        f"`{command}`, {minutes:.0f} min, {os.cpu_count()} cores; configurations "
        f"interleaved in this order: {', '.join(c.label for c in order)}. Threshold "
        f"set on every pool; max batched tokens {budget or 'vLLM default'}; KV store "
        f"off; concurrency {a.concurrency}, think times "
        f"× {a.think_scale}.",
        *problems,
        "",
        *tables(rows),
        f"The {a.slowest} slowest requests of each replay, where their time to first "
        f"token went (seconds; engines' per-request phases, 'other' = TTFT minus the "
        f"phases: router, gRPC, hand-off; 'queued behind' = requests that had not yet "
        f"produced their first output on that engine when this one arrived, and their "
        f"uncached prompt tokens):",
        "",
        *request_phases.SLOWEST_HEADER,
        *[
            line
            for cfg, cfg_runs in runs.items()
            for run in cfg_runs
            for line in request_phases.slowest_table(
                cfg.label, run.get("request_phases", []), a.slowest
            )
        ],
        "",
    ]
    all_runs = [run for cfg_runs in runs.values() for run in cfg_runs]
    md = report.write_report(all_runs, out, title="Long-prefill threshold", notes=notes)
    (out / "long_prefill.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(notes))
    log(f"report: {md}")
    return 0 if len(all_runs) == len(order) and not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
