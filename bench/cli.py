"""``tandem bench``: the agentic workload benchmark.

    tandem bench generate  -o trace.jsonl            seeded synthetic AgentX traces
    tandem bench stats     trace.jsonl               shape statistics of a trace
    tandem bench replay    --trace trace.jsonl       replay against an endpoint, write a report
    tandem bench report    RUN_DIR...                report (and ratios) from saved runs
    tandem bench sweep     --endpoint pd=URL ...     concurrencies x endpoints, ratios vs a baseline
    tandem bench crosscheck --trace trace.jsonl      the same requests through aiperf, compared
    tandem bench embedded  [--configs agg,pd]        start embedded stacks, replay, compare
    tandem bench profile   --role prefill --url URL  profile one pool to saturation (Phase 1)

Also runnable as ``python -m bench.cli``. Exit status: 0 success, 1 the run
had failures (or the cross-check disagreed), 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.harness import RESULTS, log, served_model

DEFAULT_URL = "http://127.0.0.1:8000"


# ----------------------------------------------------------------- arguments

def _add_gen_args(p: argparse.ArgumentParser, with_output: bool) -> None:
    from bench.agentx.generate import PROFILES
    g = p.add_argument_group("synthetic trace (when no --trace is given)")
    g.add_argument("--profile", default="small", choices=sorted(PROFILES),
                   help="parameter set: 'small' fits 2 CPU cores (contexts of a few thousand "
                        "tokens); 'agentx' the published AgentX medians (default: small)")
    g.add_argument("--sessions", type=int, help="number of sessions (small: 12)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--block-size", type=int, help="tokens per hash id (default 64)")
    g.add_argument("--turns-median", type=float, help="median main-agent turns per session")
    g.add_argument("--first-in-median", type=int, help="median first input, tokens")
    g.add_argument("--shared-prefix", type=int,
                   help="tokens shared by all sessions (tool definitions, system prompt)")
    g.add_argument("--reuse", type=float, help="mean per-turn prefix reuse (0..1)")
    g.add_argument("--out-median", type=int, help="median output tokens")
    g.add_argument("--out-max", type=int, help="maximum output tokens")
    g.add_argument("--max-context", type=int, help="compaction threshold, tokens")
    g.add_argument("--subagent-share", type=float, help="share of sessions with sub-agents")
    g.add_argument("--subagents-median", type=int, help="sub-agents per fan-out (median)")
    g.add_argument("--think-median", type=float, help="median think time, seconds")
    if with_output:
        p.add_argument("-o", "--output", required=True, help="trace file to write (.jsonl)")


# Flags of _add_gen_args, each named as its GenParams field.
_GEN_FIELDS = ("sessions", "seed", "block_size", "turns_median", "first_in_median",
               "shared_prefix", "reuse", "out_median", "out_max", "max_context",
               "subagent_share", "subagents_median", "think_median")


def _gen_params(a: argparse.Namespace):
    from bench.agentx.generate import params_for
    return params_for(a.profile, **{name: getattr(a, name) for name in _GEN_FIELDS})


def _add_replay_args(p: argparse.ArgumentParser, endpoint: bool = True,
                     lanes: bool = True) -> None:
    p.add_argument("--trace", help="trace file or directory (.jsonl/.json, AgentX format); "
                                   "without it a synthetic trace is generated")
    if endpoint:
        p.add_argument("--url", default=DEFAULT_URL,
                       help=f"OpenAI-compatible base URL (default {DEFAULT_URL}, the router); "
                            "several, comma-separated, take requests in turn (router "
                            "replicas behind a per-request balancer)")
        p.add_argument("--model", help="model name to request (default: the first of "
                                       "GET /v1/models)")
    p.add_argument("--tokenizer", help="Hugging Face model folder whose tokenizer and chat "
                                       "template the server uses (default: Tandem's default "
                                       "model, SmolLM2-135M-Instruct)")
    if lanes:
        p.add_argument("-c", "--concurrency", type=int, default=4,
                       help="concurrent session lanes (default 4)")
    p.add_argument("--think-scale", type=float, default=1.0,
                   help="multiply trace think times (0 = none; default 1)")
    p.add_argument("--think-max", type=float, help="cap each think time, seconds")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's max_tokens")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (outputs may end before the trace's length)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    if lanes:
        p.add_argument("--duration", type=float,
                       help="stop starting requests after this many seconds")
    p.add_argument("--max-sessions", type=int, help="replay only the first N sessions")
    p.add_argument("--session-header", default="X-Session-ID",
                   help="header carrying the session (and sub-agent) key; '' for none")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-tokenizing every built prompt to check it")
    p.add_argument("--out", help="output directory (default bench/results/<time>-<command>)")
    _add_gen_args(p, with_output=False)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tandem bench",
        description="Agentic workload benchmark: AgentX-format traces, a replay client with "
                    "sub-agents and think time, metrics, reports, sweeps, aiperf cross-check.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: tandem bench generate -o /tmp/t.jsonl && "
               "tandem bench replay --trace /tmp/t.jsonl --url http://127.0.0.1:8000 -c 4")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="write seeded synthetic traces",
                       description="Write seeded synthetic agentic traces (AgentX format, JSONL) "
                                   "and print their statistics.")
    _add_gen_args(p, with_output=True)

    p = sub.add_parser("stats", help="shape statistics of a trace file",
                       description="Validate a trace file or directory and print its "
                                   "statistics (turns, sub-agent share, prefix reuse, hit-rate "
                                   "bound) as JSON.")
    p.add_argument("trace", help="trace file or directory")

    p = sub.add_parser("replay", help="replay a trace against an endpoint and write a report",
                       description="Replay agentic sessions against an OpenAI-compatible endpoint "
                                   "(streaming chat completions) and write run.json + report.md "
                                   "with plots. Ctrl-C stops and writes what was measured.")
    _add_replay_args(p)
    p.add_argument("--label", default="run", help="name of this configuration in reports")
    p.add_argument("--salt", help="content salt (default: random, so the cache starts cold)")

    p = sub.add_parser("report", help="report from saved runs",
                       description="Write report.md and plots from run.json files (or "
                                   "directories holding them), with ratios vs a baseline label.")
    p.add_argument("runs", nargs="+", help="run.json files or directories")
    p.add_argument("--baseline", help="label to compute ratios against")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--title", default="Agentic replay report")

    p = sub.add_parser("sweep", help="several concurrencies x endpoints, ratios vs a baseline",
                       description="Replay one trace at several concurrencies against several "
                                   "named endpoints (interleaved), fresh cache salt per run, and "
                                   "write one report with ratios against the baseline endpoint.")
    _add_replay_args(p, endpoint=False)
    p.add_argument("--endpoint", action="append", required=True, metavar="NAME=URL[#MODEL]",
                   help="a named endpoint configuration (repeat), e.g. "
                        "pd=http://127.0.0.1:8000 agg=http://127.0.0.1:8301")
    p.add_argument("--concurrencies", default="1,2,4",
                   help="comma-separated concurrencies (default 1,2,4)")
    p.add_argument("--baseline", help="endpoint name to compare against (default: the first)")

    p = sub.add_parser("crosscheck", help="the same requests through aiperf, compared",
                       description="Replay the trace's requests (flattened: every agent a "
                                   "session, no think time) with our client and with aiperf at "
                                   "the same concurrency; report whether TTFT, ITL and "
                                   "throughput agree within the tolerance.")
    _add_replay_args(p)
    p.add_argument("--tolerance", type=float, default=0.25,
                   help="relative tolerance (default 0.25 = ±25%%)")
    p.add_argument("--one-after-the-other", action="store_true",
                   help="run the two clients one after the other instead of side by side "
                        "(side by side, each sees the same load; the default)")
    p.add_argument("--aiperf", help="aiperf executable (default .tandem/venv-aiperf/bin/aiperf, "
                                    "made by bench/setup_aiperf.sh)")

    from bench import profile
    p = sub.add_parser("profile", help="profile one pool to saturation (Phase 1 of rate matching)",
                       description=profile.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_replay_args(p, lanes=False)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "aggregated"],
                   help="the pool behind --url being profiled")
    p.add_argument("--concurrencies", default="1,2,4,8,16,32",
                   help="rising concurrencies, until throughput stops growing (default "
                        "1,2,4,8,16,32)")
    p.add_argument("--level-s", type=float, default=60.0,
                   help="seconds of replay per concurrency (default 60)")
    p.add_argument("--ttft-ceiling", type=float, default=60.0,
                   help="stop once TTFT p90 passes this many seconds (default 60)")
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas in the profiled pool; rates are written per replica")
    g = p.add_argument_group("the configuration profiled (written into the profile)")
    g.add_argument("--name", help="configuration name (default <model>-<role>)")
    g.add_argument("--hardware", default="", help="e.g. H100-80GB, cpu-core")
    g.add_argument("--gpus-per-replica", type=int, default=1,
                   help="GPUs of one replica (on CPU: the cores it is pinned to)")
    for flag in ("tp", "pp", "dp", "pcp", "dcp"):
        g.add_argument(f"--{flag}", type=int, default=1, help=f"{flag.upper()} size")
    g.add_argument("--scheduler-flag", action="append", default=[], metavar="FLAG",
                   help="a vLLM scheduler flag the replicas run with (repeat)")
    g.add_argument("--kv-capacity-tokens", type=int,
                   help="KV capacity of one replica, tokens (vLLM: num_gpu_blocks x block "
                        "size)")
    g.add_argument("--namespace", help="namespace of the ConfigMap written")
    p.add_argument("-o", "--output",
                   help="profile ConfigMap to write (default <out>/profile.yaml)")

    p = sub.add_parser("embedded", add_help=False,
                       help="start the embedded stack as aggregated and as P/D, replay, compare",
                       description="See `tandem bench embedded --help`.")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


# ------------------------------------------------------------------- helpers

def _sessions(a: argparse.Namespace):
    from bench.agentx import generate, trace
    if a.trace:
        sessions = trace.load(a.trace)
        info = {"path": str(a.trace)}
    else:
        p = _gen_params(a)
        sessions = generate.generate(p)
        info = {"path": f"<generated profile={a.profile} seed={p.seed}>",
                "params": generate.params_dict(p)}
    if getattr(a, "max_sessions", None):
        sessions = sessions[: a.max_sessions]
    info["stats"] = generate.trace_stats(sessions)
    return sessions, info


def _tokenizer(a: argparse.Namespace):
    from transformers import AutoTokenizer

    from common.model import resolve_model
    path = resolve_model(a.tokenizer)
    return AutoTokenizer.from_pretrained(str(path)), str(path)


def _replay_cfg(a: argparse.Namespace, url: str = "", model: str = ""):
    from bench.agentx.replay import ReplayConfig
    concurrency = getattr(a, "concurrency", 1)
    if concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return ReplayConfig(url=url.rstrip("/"), model=model, concurrency=concurrency,
                        think_scale=a.think_scale, think_max=a.think_max,
                        max_tokens_cap=a.max_tokens_cap, ignore_eos=not a.no_ignore_eos,
                        timeout_s=a.timeout, duration_s=getattr(a, "duration", None),
                        session_header=a.session_header, progress=not a.no_progress)


def _out_dir(a: argparse.Namespace, command: str) -> Path:
    if a.out:
        return Path(a.out)
    return RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"


def _print_summary(s: dict) -> None:
    def f(v, fmt="{:.3f}"):
        return "—" if v is None else fmt.format(v)
    log(f"requests {s['requests']}: ok {s['ok']}, failures {s['failures']}, "
         f"interrupted {s['interrupted']}")
    log(f"TTFT p50/p90/p99 {f(s['ttft_p50'])}/{f(s['ttft_p90'])}/{f(s['ttft_p99'])} s; "
         f"ITL p50 {f(s['itl_p50'] and s['itl_p50'] * 1000, '{:.1f}')} ms; "
         f"P90 interactivity {f(s['interactivity_p90'], '{:.1f}')} tok/s/user")
    hit = "—" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    log(f"throughput {f(s['total_tokens_per_s'], '{:.0f}')} tok/s total, "
         f"{f(s['output_tokens_per_s'], '{:.1f}')} output tok/s; hit rate {hit}")


# ------------------------------------------------------------------ commands

def cmd_generate(a) -> int:
    from bench.agentx import generate, trace
    p = _gen_params(a)
    sessions = generate.generate(p)
    path = trace.dump(sessions, a.output)
    st = generate.trace_stats(sessions)
    log(f"wrote {len(sessions)} sessions, {st['requests']} requests to {path}")
    print(json.dumps(st, indent=1))
    return 0


def cmd_stats(a) -> int:
    from bench.agentx import generate, trace
    print(json.dumps(generate.trace_stats(trace.load(a.trace)), indent=1))
    return 0


def cmd_replay(a) -> int:
    from bench.agentx import report
    from bench.agentx.content import PromptBuilder
    from bench.agentx.replay import Replayer, build_prompts, new_salt
    sessions, info = _sessions(a)
    tok, _ = _tokenizer(a)
    model = a.model or served_model(a.url)
    builder = PromptBuilder(tok, salt=a.salt or new_salt(), verify=not a.no_verify)
    log(f"building {info['stats']['requests']} prompts ({len(sessions)} sessions)")
    prompts = build_prompts(sessions, builder)
    cfg = _replay_cfg(a, a.url, model)
    out = _out_dir(a, "replay")
    log(f"replaying against {a.url} model {model}, concurrency {cfg.concurrency}; "
         f"results in {out}")
    result = asyncio.run(Replayer(cfg, sessions, prompts, salt=builder.salt).run())
    run = report.make_run(a.label, result.to_json(), info)
    report.write_run(run, out / "run.json")
    md = report.write_report([run], out, notes=(
        ["**Interrupted:** partial results."] if result.interrupted else []))
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
    sessions, info = _sessions(a)
    tok, _ = _tokenizer(a)
    out = _out_dir(a, "sweep")
    base_cfg = _replay_cfg(a)
    runs = sweep.run_sweep(sessions, info, endpoints, concs, base_cfg, tok, out,
                           served_model, log=log)
    md = report.write_report(runs, out, baseline=baseline, title="Agentic replay sweep")
    log(f"report: {md}")
    expected = len(concs) * len(endpoints)
    if len(runs) < expected or any(r["replay"]["interrupted"] for r in runs):
        return 130
    return 1 if any(r["summary"]["failures"] for r in runs) else 0


def cmd_crosscheck(a) -> int:
    from bench.agentx.crosscheck import crosscheck
    sessions, _ = _sessions(a)
    tok, tok_dir = _tokenizer(a)
    model = a.model or served_model(a.url)
    out = _out_dir(a, "crosscheck")
    doc = crosscheck(sessions, _replay_cfg(a, a.url, model), tok, tok_dir, out,
                     tolerance=a.tolerance, aiperf=a.aiperf,
                     side_by_side=not a.one_after_the_other, log=log)
    print((out / "crosscheck.md").read_text())
    return 0 if doc["comparison"]["agree"] else 1


def cmd_profile(a) -> int:
    from bench.profile import engine_config, profile_pool
    from operators.planner.profiles import (
        Parallelism,
        manifests_yaml,
        profile_configmap,
    )
    try:
        concs = sorted({int(c) for c in a.concurrencies.split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--concurrencies {a.concurrencies!r}: expected e.g. 1,2,4") from None
    if not concs or concs[0] < 1 or a.replicas < 1 or a.level_s <= 0:
        raise ValueError("--concurrencies, --replicas and --level-s must be positive")
    sessions, info = _sessions(a)
    tok, _ = _tokenizer(a)
    model = a.model or served_model(a.url)
    name = a.name or f"{model}-{a.role}".lower()
    config = engine_config(a.role, name, model, a.gpus_per_replica, a.hardware,
                           Parallelism(a.tp, a.pp, a.dp, a.pcp, a.dcp), a.scheduler_flag,
                           a.kv_capacity_tokens)
    st = info["stats"]
    workload = (f"{info['path']}: {st['sessions']} sessions, {st['requests']} requests, think "
                f"x{a.think_scale:g}")
    out = _out_dir(a, f"profile-{a.role}")
    log(f"profiling the {a.role} pool behind {a.url} ({a.replicas} replica(s)) at "
        f"concurrencies {concs}, {a.level_s:g} s each")
    profile, levels = asyncio.run(profile_pool(
        a.role, a.url.rstrip("/"), sessions, info, tok, _replay_cfg(a, a.url, model), config,
        a.replicas, concs, a.level_s, a.ttft_ceiling, workload, log=log))
    from bench.agentx import report
    for level in levels:
        report.write_run(level.run, out / f"c{level.concurrency}" / "run.json")
    path = Path(a.output) if a.output else out / "profile.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifests_yaml([profile_configmap(profile, name, a.namespace)],
                                   header=f"{profile.note}; {workload}"))
    log(f"profile: {path} ({len(profile.points)} points; runs in {out})")
    return 0


def cmd_embedded(a) -> int:
    from bench.agentx.embedded import main as embedded_main
    return embedded_main(a.rest)


COMMANDS = {"embedded": cmd_embedded, "generate": cmd_generate, "stats": cmd_stats,
            "replay": cmd_replay, "report": cmd_report, "sweep": cmd_sweep,
            "crosscheck": cmd_crosscheck, "profile": cmd_profile}


def main(argv: list[str] | None = None) -> int:
    from bench.agentx.trace import TraceError
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["embedded"]:          # its own parser, options passed through
        from bench.agentx.embedded import main as embedded_main
        return embedded_main(argv[1:])
    a = build_parser().parse_args(argv)
    try:
        return COMMANDS[a.command](a)
    except (TraceError, ValueError, FileNotFoundError) as e:
        log(f"tandem bench {a.command}: error: {e}")
        return 2
    except RuntimeError as e:
        log(f"tandem bench {a.command}: error: {e}")
        return 1
    except KeyboardInterrupt:
        log(f"tandem bench {a.command}: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
