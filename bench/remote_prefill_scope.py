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

from bench.harness import RESULTS
from bench.router_ab import (
    CONFIGS,
    add_order_arguments,
    add_trace_arguments,
    on_off_ratios,
    replay_small_trace,
    write_results,
)
from services.stack import Stack, StackConfig
from tandem.workload import metrics
from tandem.workload.metrics import cell

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
        "label": label,
        "requests": s["requests"],
        "failures": s["failures"],
        "interactivity_p90": s["interactivity_p90"],
        "ttft_p50": s["ttft_p50"],
        "ttft_p90": s["ttft_p90"],
        "ttft_p99": s["ttft_p99"],
        "fork_requests": len(forks),
        "fork_ttft_p50": metrics.percentile(forks, 50),
        "fork_ttft_p90": metrics.percentile(forks, 90),
        "main_ttft_p90": metrics.percentile(mains, 90),
        "main_ttft_p99": metrics.percentile(mains, 99),
        "hit_rate": s["hit_rate"],
        "duration_s": s["duration_s"],
        "local_prefills": [run["local_prefills"] for run in runs],
    }


KEYS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "interactivity_p90",
    "fork_ttft_p50",
    "fork_ttft_p90",
    "main_ttft_p90",
    "main_ttft_p99",
)


def tables(rows: list[dict]) -> list[str]:
    lines = [
        "| config | requests | TTFT p50 | p90 | p99 (s) | P90 interactivity (tok/s/user) "
        "| sub-agent requests | their TTFT p50 | p90 | main agents' TTFT p90 | p99 (s) "
        "| hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} ({SCOPE[r['label']]}) | {r['requests']} ({r['failures']} failed) "
            f"| {cell(r['ttft_p50'])} | {cell(r['ttft_p90'])} | {cell(r['ttft_p99'])} "
            f"| {cell(r['interactivity_p90'])} | {r['fork_requests']} "
            f"| {cell(r['fork_ttft_p50'])} | {cell(r['fork_ttft_p90'])} "
            f"| {cell(r['main_ttft_p90'])} | {cell(r['main_ttft_p99'])} "
            f"| {cell(r['hit_rate'] and 100 * r['hit_rate'], '{:.1f}%')} |"
        )
    lines += on_off_ratios(rows, KEYS)
    lines += ["", "Requests prefilled on the decode pod, by reason, per run:"]
    lines += [f"* {r['label']}: {r['local_prefills']}" for r in rows]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.remote_prefill_scope",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_order_arguments(ap)
    add_trace_arguments(ap, sessions=4, first_in_median=1536, seed=0, concurrency=2)
    ap.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=256,
        help="the router's threshold, both configurations (default 256)",
    )
    ap.add_argument("--out", help="output directory (default bench/results/<time>-scope)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds >= 1")

    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-scope")
    state = Path(tempfile.mkdtemp(prefix="tandem-scope-"))
    stack = Stack(
        StackConfig(
            prefill=1,
            decode=1,
            kv_store=False,
            router=False,
            kv_cache_gib=1,
            max_model_len=4096,
            state_dir=state,
        )
    )
    started = time.monotonic()

    def router_argv(port: int, config: str) -> list[str]:
        return stack.router_argv(
            port,
            [
                "--remote-prefill-threshold",
                str(a.remote_prefill_threshold),
                "--remote-prefill-scope",
                SCOPE[config],
            ],
        )

    def figures(url: str) -> dict:
        return {"local_prefills": local_prefills(httpx.get(f"{url}/metrics", timeout=10).text)}

    runs, order = replay_small_trace(a, stack, out, router_argv, figures)
    rows = [summarize(c, runs[c]) for c in CONFIGS if c in runs]
    minutes = (time.monotonic() - started) / 60
    command = " ".join(
        ["python -m bench.remote_prefill_scope", *(argv if argv is not None else sys.argv[1:])]
    )
    notes = [
        f"`{command}`, {minutes:.0f} min, {os.cpu_count()} cores; 1 prefill + 1 decode "
        f"vLLM CPU engines, KV store off; replay order {', '.join(order)}; concurrency "
        f"{a.concurrency}, think times × {a.think_scale}; remote-prefill threshold "
        f"{a.remote_prefill_threshold}.",
        *tables(rows),
    ]
    all_runs = write_results(
        out, "Remote-prefill scope: request vs pod", runs, rows, notes, "remote_prefill_scope.json"
    )
    return 0 if len(all_runs) == len(order) and not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
