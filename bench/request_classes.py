"""Request classes on vs off: two prefill pods and one decode pod, the same
engines, one router after the other.

"off": the router chooses among both prefill pods by cost, as by default.
"on": the first prefill pod is the pool ``fresh``, reserved for long fresh
prefills (``--prefill fresh=ADDR --prefill-pool-for long=fresh``); append
turns with a remainder too long for the decode pod go to the other one.
The trace mixes long fresh first turns (about 1.8K new tokens) with append
turns and sub-agent forks (the same as ``bench.long_prefill``'s). Every replay
has a fresh content salt, so no run inherits another's cache; with
``--rounds 2`` the order is off, on, on, off (``--first on``: on, off, ...).

Reported per configuration: TTFT p50/p90/p99, P90 interactivity, the TTFT of
long requests (at least ``--long-request-tokens`` uncached) and of the others,
the router's decisions by class and pod, and ratios on/off.

    python -m bench.request_classes [--rounds 1] [--sessions 4] [-c 3]
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
from bench.long_prefill import long_requests
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

FRESH_POOL = "fresh"


def router_argv(
    stack: Stack, port: int, config: str, long_tokens: int, remote_prefill_threshold: int
) -> list[str]:
    """The stack's router command line; "on" puts the first prefill pod in
    the pool of long requests."""
    argv = stack.router_argv(
        port,
        [
            "--long-request-tokens",
            str(long_tokens),
            "--remote-prefill-threshold",
            str(remote_prefill_threshold),
        ],
    )
    if config == "on":
        i = argv.index("--prefill")
        argv[i + 1] = f"{FRESH_POOL}={argv[i + 1]}"
        argv += ["--prefill-pool-for", f"long={FRESH_POOL}"]
    return argv


def class_counts(router_url: str) -> dict[str, float]:
    """The router's decisions by class and pod, "class@pod": count."""
    found = {}
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_routing_class_requests_total":
                found[f"{sample.labels['class']}@{sample.labels['pod']}"] = sample.value
    return found


def summarize(label: str, runs: list[dict], long_tokens: int) -> dict:
    records = [r for run in runs for r in run["records"]]
    s = metrics.summarize(records, sum(run["summary"]["duration_s"] for run in runs))
    longs = long_requests(records, long_tokens)
    others = [r for r in records if r.get("ok") and r not in longs]
    return {
        "label": label,
        "requests": s["requests"],
        "failures": s["failures"],
        "interactivity_p90": s["interactivity_p90"],
        "ttft_p50": s["ttft_p50"],
        "ttft_p90": s["ttft_p90"],
        "ttft_p99": s["ttft_p99"],
        "long_requests": len(longs),
        "long_ttft_p50": metrics.percentile([r["ttft"] for r in longs], 50),
        "other_ttft_p90": metrics.percentile([r["ttft"] for r in others], 90),
        "hit_rate": s["hit_rate"],
        "duration_s": s["duration_s"],
        "classes": [run["classes"] for run in runs],
    }


KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "interactivity_p90", "long_ttft_p50", "other_ttft_p90")


def tables(rows: list[dict]) -> list[str]:
    lines = [
        "| config | requests | TTFT p50 | p90 | p99 (s) | P90 interactivity (tok/s/user) "
        "| long requests | long TTFT p50 | other TTFT p90 (s) | hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['requests']} ({r['failures']} failed) | {cell(r['ttft_p50'])} | "
            f"{cell(r['ttft_p90'])} | {cell(r['ttft_p99'])} | {cell(r['interactivity_p90'])} | "
            f"{r['long_requests']} | {cell(r['long_ttft_p50'])} | {cell(r['other_ttft_p90'])} | "
            f"{cell(r['hit_rate'] and 100 * r['hit_rate'], '{:.1f}%')} |"
        )
    lines += on_off_ratios(rows, KEYS)
    lines += ["", "Router decisions by class@pod (the pod that computes the prompt), per run:"]
    lines += [f"* {r['label']}: {r['classes']}" for r in rows]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.request_classes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_order_arguments(ap)
    add_trace_arguments(ap, sessions=4, first_in_median=2304, seed=1, concurrency=3)
    ap.add_argument(
        "--long-request-tokens",
        type=int,
        default=1024,
        help="the router's class threshold, also the report's (default 1024)",
    )
    ap.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=256,
        help="the router's: shorter uncached remainders are prefilled on the "
        "decode pod, whatever the class (default 256; lower sends more "
        "append turns to the append pool)",
    )
    ap.add_argument(
        "--kv-store",
        choices=("on", "off"),
        default="off",
        help="the shared KV store (default off; on: a prefill pod loads a "
        "prefix another pod computed from it instead of recomputing it)",
    )
    ap.add_argument("--out", help="output directory (default bench/results/<time>-classes)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds >= 1")

    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-classes")
    state = Path(tempfile.mkdtemp(prefix="tandem-classes-"))
    stack = Stack(
        StackConfig(
            prefill=2,
            decode=1,
            kv_store=a.kv_store == "on",
            router=False,
            kv_cache_gib=1,
            max_model_len=4096,
            state_dir=state,
        )
    )
    started = time.monotonic()

    runs, order = replay_small_trace(
        a,
        stack,
        out,
        lambda port, config: router_argv(
            stack, port, config, a.long_request_tokens, a.remote_prefill_threshold
        ),
        lambda url: {"classes": class_counts(url)},
    )
    rows = [summarize(c, runs[c], a.long_request_tokens) for c in CONFIGS if c in runs]
    minutes = (time.monotonic() - started) / 60
    command = " ".join(
        ["python -m bench.request_classes", *(argv if argv is not None else sys.argv[1:])]
    )
    notes = [
        f"`{command}`, {minutes:.0f} min, {os.cpu_count()} cores; 2 prefill + 1 decode "
        f"vLLM CPU engines, KV store {a.kv_store}; replay order {', '.join(order)}; "
        f"concurrency {a.concurrency}, think times × {a.think_scale}; remote-prefill "
        f"threshold {a.remote_prefill_threshold}.",
        *tables(rows),
    ]
    all_runs = write_results(
        out, "Request classes on vs off", runs, rows, notes, "request_classes.json"
    )
    return 0 if len(all_runs) == len(order) and not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
