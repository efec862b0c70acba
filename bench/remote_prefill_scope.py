"""What ``--remote-prefill-threshold`` bounds, one request's remainder or the
decode pod's prefill work: one prefill and one decode engine, the same
engines, one router after the other.

"off": ``--remote-prefill-scope request`` (the default): a request whose
uncached remainder is under the threshold is prefilled on the decode pod,
however many such requests are already being prefilled there.
"on": ``--remote-prefill-scope pod``: the decode pod's pending prefill counts
too, so a burst of sub-agent forks routed within milliseconds goes to the
prefill pod past the threshold instead of making one long decode step.

The trace is ``bench.long_prefill``'s (seed 0: four sessions, one of which
forks seven sub-agents at once). Every replay has a fresh content salt; with
``--rounds 2`` the order is off, on, on, off.

Reported per configuration: TTFT p50/p90/p99 of all requests, of the
sub-agents' requests and of the main agents', P90 interactivity, the
router's local prefills by reason, and ratios on/off.

    python -m bench.remote_prefill_scope [--rounds 1] [-c 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.agentx import generate, metrics
from bench.agentx.metrics import cell
from bench.harness import RESULTS
from bench.router_ab import (
    CONFIGS,
    add_order_arguments,
    replay_each,
    replay_order,
    replay_through,
    write_results,
)
from common.procs import Processes
from services.stack import Stack, StackConfig

SCOPE = {"off": "request", "on": "pod"}


def local_prefills(router_metrics: str) -> dict[str, float]:
    """The router's P/D requests prefilled on the decode pod, by reason, from
    its /metrics text."""
    found = {}
    for family in text_string_to_metric_families(router_metrics):
        for sample in family.samples:
            if sample.name == "tandem_router_local_prefill_total":
                found[sample.labels["reason"]] = sample.value
    return found


def summarize(label: str, runs: list[dict]) -> dict:
    records = [r for run in runs for r in run["records"]]
    s = metrics.summarize(records, sum(run["summary"]["duration_s"] for run in runs))
    ok = [r for r in records if r.get("ok")]
    forks = [r["ttft"] for r in ok if r.get("agent")]
    mains = [r["ttft"] for r in ok if not r.get("agent")]
    return {
        "label": label, "requests": s["requests"], "failures": s["failures"],
        "interactivity_p90": s["interactivity_p90"],
        "ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"], "ttft_p99": s["ttft_p99"],
        "fork_requests": len(forks),
        "fork_ttft_p50": metrics.percentile(forks, 50),
        "fork_ttft_p90": metrics.percentile(forks, 90),
        "main_ttft_p90": metrics.percentile(mains, 90),
        "main_ttft_p99": metrics.percentile(mains, 99),
        "hit_rate": s["hit_rate"], "duration_s": s["duration_s"],
        "local_prefills": [run["local_prefills"] for run in runs],
    }


KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "interactivity_p90", "fork_ttft_p50",
        "fork_ttft_p90", "main_ttft_p90", "main_ttft_p99")


def tables(rows: list[dict]) -> list[str]:
    lines = ["| config | requests | TTFT p50 | p90 | p99 (s) | P90 interactivity (tok/s/user) "
             "| sub-agent requests | their TTFT p50 | p90 | main agents' TTFT p90 | p99 (s) "
             "| hit rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} ({SCOPE[r['label']]}) | {r['requests']} ({r['failures']} failed) "
            f"| {cell(r['ttft_p50'])} | {cell(r['ttft_p90'])} | {cell(r['ttft_p99'])} "
            f"| {cell(r['interactivity_p90'])} | {r['fork_requests']} "
            f"| {cell(r['fork_ttft_p50'])} | {cell(r['fork_ttft_p90'])} "
            f"| {cell(r['main_ttft_p90'])} | {cell(r['main_ttft_p99'])} "
            f"| {cell(r['hit_rate'] and 100 * r['hit_rate'], '{:.1f}%')} |")
    by = {r["label"]: r for r in rows}
    if "on" in by and "off" in by:
        ratio = {k: metrics.ratio(by["on"][k], by["off"][k]) for k in KEYS}
        lines += ["", "on / off: " + ", ".join(f"{k} {cell(ratio[k], '{:.2f}×')}" for k in KEYS)]
    lines += ["", "Requests prefilled on the decode pod, by reason, per run:"]
    lines += [f"* {r['label']}: {r['local_prefills']}" for r in rows]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.remote_prefill_scope", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_order_arguments(ap)
    ap.add_argument("--sessions", type=int, default=4, help="sessions in the trace (default 4)")
    ap.add_argument("--turns-median", type=float, default=4, help="median turns per session")
    ap.add_argument("--first-in-median", type=int, default=1536,
                    help="median first-turn input, tokens (default 1536)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0: 7 forks)")
    ap.add_argument("-c", "--concurrency", type=int, default=2, help="session lanes")
    ap.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    ap.add_argument("--remote-prefill-threshold", type=int, default=256,
                    help="the router's threshold, both configurations (default 256)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, s")
    ap.add_argument("--out", help="output directory (default bench/results/<time>-scope)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds >= 1")

    from transformers import AutoTokenizer

    from common.model import resolve_model

    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-scope")
    sessions, info = generate.generated_trace(
        "small", sessions=a.sessions, turns_median=a.turns_median, seed=a.seed,
        first_in_median=a.first_in_median, max_context=3584)
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    order = replay_order(a.first, a.rounds)
    state = Path(tempfile.mkdtemp(prefix="tandem-scope-"))
    stack = Stack(StackConfig(prefill=1, decode=1, kv_store=False, router=False,
                              kv_cache_gib=1, max_model_len=4096, state_dir=state))
    started = time.monotonic()

    def router_argv(port: int, config: str) -> list[str]:
        return stack.router_argv(port, [
            "--remote-prefill-threshold", str(a.remote_prefill_threshold),
            "--remote-prefill-scope", SCOPE[config]])

    def replay(url: str):
        result = replay_through(url, sessions, tok, concurrency=a.concurrency,
                                think_scale=a.think_scale, timeout_s=a.timeout)
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return result, {"local_prefills": local_prefills(text)}

    runs = replay_each(stack, Processes(state), order, out, info, router_argv, replay)
    rows = [summarize(c, runs[c]) for c in CONFIGS if c in runs]
    minutes = (time.monotonic() - started) / 60
    command = " ".join(["python -m bench.remote_prefill_scope",
                        *(argv if argv is not None else sys.argv[1:])])
    notes = [f"`{command}`, {minutes:.0f} min, {os.cpu_count()} cores; 1 prefill + 1 decode "
             f"vLLM CPU engines, KV store off; replay order {', '.join(order)}; concurrency "
             f"{a.concurrency}, think times × {a.think_scale}; remote-prefill threshold "
             f"{a.remote_prefill_threshold}.", *tables(rows)]
    all_runs = write_results(out, "Remote-prefill scope: request vs pod", runs, rows, notes,
                             "remote_prefill_scope.json")
    return 0 if len(all_runs) == len(order) and not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
