"""``python -m bench``: the agentic workload benchmark.

    python -m bench generate  -o trace.jsonl         seeded synthetic AgentX traces
    python -m bench stats     trace.jsonl            shape statistics of a trace
    python -m bench replay    --trace trace.jsonl    replay against an endpoint, write a report
    python -m bench report    RUN_DIR...             report (and ratios) from saved runs
    python -m bench sweep     --endpoint pd=URL ...  concurrencies x endpoints, ratios vs a baseline
    python -m bench crosscheck --trace trace.jsonl   the same requests through aiperf, compared
    python -m bench embedded  [--configs agg,pd]     start embedded stacks, replay, compare

Run from the repository root (``bench`` is not part of the installed
package); profiling a pool for the planner is ``tandem profile``. Exit status: 0 success, 1 the run
had failures (or the cross-check disagreed), 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.harness import RESULTS, log
from tandem.workload.args import (
    add_gen_args,
    add_replay_args,
    gen_params,
    load_sessions,
    load_tokenizer,
    replay_config,
    run_command,
)
from tandem.workload.endpoint import served_model

OUT_DEFAULT = "bench/results/<time>-<command>"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Agentic workload benchmark: AgentX-format traces, a replay client with "
        "sub-agents and think time, metrics, reports, sweeps, aiperf cross-check.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python -m bench generate -o /tmp/t.jsonl && "
        "python -m bench replay --trace /tmp/t.jsonl --url http://127.0.0.1:8000 -c 4",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "generate",
        help="write seeded synthetic traces",
        description="Write seeded synthetic agentic traces (AgentX format, JSONL) "
        "and print their statistics.",
    )
    add_gen_args(p, with_output=True)

    p = sub.add_parser(
        "stats",
        help="shape statistics of a trace file",
        description="Validate a trace file or directory and print its "
        "statistics (turns, sub-agent share, prefix reuse, hit-rate "
        "bound) as JSON.",
    )
    p.add_argument("trace", help="trace file or directory")

    p = sub.add_parser(
        "replay",
        help="replay a trace against an endpoint and write a report",
        description="Replay agentic sessions against an OpenAI-compatible endpoint "
        "(streaming chat completions) and write run.json + report.md "
        "with plots. Ctrl-C stops and writes what was measured.",
    )
    add_replay_args(p, OUT_DEFAULT)
    p.add_argument("--label", default="run", help="name of this configuration in reports")
    p.add_argument("--salt", help="content salt (default: random, so the cache starts cold)")

    p = sub.add_parser(
        "report",
        help="report from saved runs",
        description="Write report.md and plots from run.json files (or "
        "directories holding them), with ratios vs a baseline label.",
    )
    p.add_argument("runs", nargs="+", help="run.json files or directories")
    p.add_argument("--baseline", help="label to compute ratios against")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--title", default="Agentic replay report")

    p = sub.add_parser(
        "sweep",
        help="several concurrencies x endpoints, ratios vs a baseline",
        description="Replay one trace at several concurrencies against several "
        "named endpoints (interleaved), fresh cache salt per run, and "
        "write one report with ratios against the baseline endpoint.",
    )
    add_replay_args(p, OUT_DEFAULT, endpoint=False)
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL[#MODEL]",
        help="a named endpoint configuration (repeat), e.g. "
        "pd=http://127.0.0.1:8000 agg=http://127.0.0.1:8301",
    )
    p.add_argument(
        "--concurrencies", default="1,2,4", help="comma-separated concurrencies (default 1,2,4)"
    )
    p.add_argument("--baseline", help="endpoint name to compare against (default: the first)")

    p = sub.add_parser(
        "crosscheck",
        help="the same requests through aiperf, compared",
        description="Replay the trace's requests (flattened: every agent a "
        "session, no think time) with our client and with aiperf at "
        "the same concurrency; report whether TTFT, ITL and "
        "throughput agree within the tolerance.",
    )
    add_replay_args(p, OUT_DEFAULT)
    p.add_argument(
        "--tolerance", type=float, default=0.25, help="relative tolerance (default 0.25 = ±25%%)"
    )
    p.add_argument(
        "--one-after-the-other",
        action="store_true",
        help="run the two clients one after the other instead of side by side "
        "(side by side, each sees the same load; the default)",
    )
    p.add_argument(
        "--aiperf",
        help="aiperf executable (default .tandem/venv-aiperf/bin/aiperf, "
        "made by bench/setup_aiperf.sh)",
    )

    p = sub.add_parser(
        "embedded",
        add_help=False,
        help="start the embedded stack as aggregated and as P/D, replay, compare",
        description="See `python -m bench embedded --help`.",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


# ------------------------------------------------------------------- helpers


def _out_dir(a: argparse.Namespace, command: str) -> Path:
    if a.out:
        return Path(a.out)
    return RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"


def _print_summary(s: dict) -> None:
    def f(v, fmt="{:.3f}"):
        return "—" if v is None else fmt.format(v)

    log(
        f"requests {s['requests']}: ok {s['ok']}, failures {s['failures']}, "
        f"interrupted {s['interrupted']}"
    )
    log(
        f"TTFT p50/p90/p99 {f(s['ttft_p50'])}/{f(s['ttft_p90'])}/{f(s['ttft_p99'])} s; "
        f"ITL p50 {f(s['itl_p50'] and s['itl_p50'] * 1000, '{:.1f}')} ms; "
        f"P90 interactivity {f(s['interactivity_p90'], '{:.1f}')} tok/s/user"
    )
    hit = "—" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    log(
        f"throughput {f(s['total_tokens_per_s'], '{:.0f}')} tok/s total, "
        f"{f(s['output_tokens_per_s'], '{:.1f}')} output tok/s; hit rate {hit}"
    )


# ------------------------------------------------------------------ commands


def cmd_generate(a) -> int:
    from tandem.workload import generate, trace

    p = gen_params(a)
    sessions = generate.generate(p)
    path = trace.dump(sessions, a.output)
    st = generate.trace_stats(sessions)
    log(f"wrote {len(sessions)} sessions, {st['requests']} requests to {path}")
    print(json.dumps(st, indent=1))
    return 0


def cmd_stats(a) -> int:
    from tandem.workload import generate, trace

    print(json.dumps(generate.trace_stats(trace.load(a.trace)), indent=1))
    return 0


def cmd_replay(a) -> int:
    from bench.agentx import report
    from tandem.workload.content import PromptBuilder
    from tandem.workload.replay import Replayer, build_prompts, new_salt
    from tandem.workload.runs import make_run, write_run

    sessions, info = load_sessions(a)
    tok, _ = load_tokenizer(a)
    model = a.model or served_model(a.url)
    builder = PromptBuilder(tok, salt=a.salt or new_salt(), verify=not a.no_verify)
    log(f"building {info['stats']['requests']} prompts ({len(sessions)} sessions)")
    prompts = build_prompts(sessions, builder)
    cfg = replay_config(a, a.url, model)
    out = _out_dir(a, "replay")
    log(f"replaying against {a.url} model {model}, concurrency {cfg.concurrency}; results in {out}")
    result = asyncio.run(Replayer(cfg, sessions, prompts, salt=builder.salt).run())
    run = make_run(a.label, result.to_json(), info)
    write_run(run, out / "run.json")
    md = report.write_report(
        [run], out, notes=(["**Interrupted:** partial results."] if result.interrupted else [])
    )
    _print_summary(run["summary"])
    log(f"report: {md}")
    if result.interrupted:
        return 130
    return 1 if run["summary"]["failures"] else 0


def cmd_report(a) -> int:
    from bench.agentx import report

    runs = report.load_runs(a.runs)
    md = report.write_report(runs, a.out, baseline=a.baseline, title=a.title)
    log(f"report: {md}")
    return 0


def cmd_sweep(a) -> int:
    from bench.agentx import report, sweep

    endpoints = [sweep.parse_endpoint(e) for e in a.endpoint]
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"--endpoint names must be distinct, got {names}")
    try:
        concs = [int(c) for c in a.concurrencies.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrencies {a.concurrencies!r}: expected e.g. 1,2,4") from None
    if not concs or min(concs) < 1:
        raise ValueError("--concurrencies: need positive integers")
    baseline = a.baseline or names[0]
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the endpoints {names}")
    sessions, info = load_sessions(a)
    tok, _ = load_tokenizer(a)
    out = _out_dir(a, "sweep")
    base_cfg = replay_config(a)
    runs = sweep.run_sweep(
        sessions, info, endpoints, concs, base_cfg, tok, out, served_model, log=log
    )
    md = report.write_report(runs, out, baseline=baseline, title="Agentic replay sweep")
    log(f"report: {md}")
    expected = len(concs) * len(endpoints)
    if len(runs) < expected or any(r["replay"]["interrupted"] for r in runs):
        return 130
    return 1 if any(r["summary"]["failures"] for r in runs) else 0


def cmd_crosscheck(a) -> int:
    from bench.agentx.crosscheck import crosscheck

    sessions, _ = load_sessions(a)
    tok, tok_dir = load_tokenizer(a)
    model = a.model or served_model(a.url)
    out = _out_dir(a, "crosscheck")
    doc = crosscheck(
        sessions,
        replay_config(a, a.url, model),
        tok,
        tok_dir,
        out,
        tolerance=a.tolerance,
        aiperf=a.aiperf,
        side_by_side=not a.one_after_the_other,
        log=log,
    )
    print((out / "crosscheck.md").read_text())
    return 0 if doc["comparison"]["agree"] else 1


def cmd_embedded(a) -> int:
    from bench.agentx.embedded import main as embedded_main

    return embedded_main(a.rest)


COMMANDS = {
    "embedded": cmd_embedded,
    "generate": cmd_generate,
    "stats": cmd_stats,
    "replay": cmd_replay,
    "report": cmd_report,
    "sweep": cmd_sweep,
    "crosscheck": cmd_crosscheck,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["embedded"]:  # its own parser, options passed through
        from bench.agentx.embedded import main as embedded_main

        return embedded_main(argv[1:])
    a = build_parser().parse_args(argv)
    return run_command(f"python -m bench {a.command}", lambda: COMMANDS[a.command](a))


if __name__ == "__main__":
    sys.exit(main())
