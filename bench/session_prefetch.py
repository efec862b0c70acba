"""Session KV prefetch on vs off: what warming an idle session's prefix
between its turns buys the turn after a long gap, and what it costs the
engines.

One stack of aggregated vLLM CPU engines (KV store on by default, so a
prefix evicted from an engine can come back from the store), started once;
one router process per replay in front of it: "off" is the router as by
default, "on" adds ``--session-prefetch true``. Every replay has a fresh
content salt, so no run inherits another's cache; with ``--rounds 2`` the
order is off, on, on, off (``--first on``: on, off, ...).

The scenario prefetch is for: an agent thinks for a long time between turns
(tool calls), and while it does the engine's LRU evicts its blocks to make
room for other sessions (vLLM does not know which sessions are live; the
router does). So:

* think times with a long tail (lognormal, median ``--think-median`` 6 s,
  spread 1.3, up to ``--think-max`` 60 s): the longer an agent is idle, the
  more other sessions' work passes it in the engine's LRU order;
* the replay sends ``x-session-end: 1`` on each agent's last request
  (sub-agents too): those sessions stop being live in the router, their
  blocks are dead KV the prefetch may replace;
* a KV cache per engine (``--kv-blocks``, 36 blocks of 128 tokens) about the
  size of the live sessions' contexts at ``-c 3``. With more, LRU finds dead
  blocks older than any idle session's and evicts those first, so live
  sessions keep their prefix and prefetch has nothing to do; the router
  warms a session only where the pod has room for it without evicting other
  live sessions' blocks.

Reported per configuration: the TTFT of turns that follow a gap of at least
``--gap-s`` (the idle time since the same agent's previous response, as the
router sees the session), their cached-token share, the TTFT of all turns;
the router's prefetches by outcome and the tokens they warmed; and the
engines' work from their vLLM counters: prompt tokens computed, read from
their own cache and loaded from the KV store, and the store's get/put bytes
(prefetches included: that is their cost). Ratios on/off.

    python -m bench.session_prefetch [--rounds 1] [--sessions 8] [-c 3] [--kv-blocks 36]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
from tandem.workload import generate, metrics
from tandem.workload.metrics import cell

SESSION_END_HEADER = "x-session-end"  # the router's default --session-end-header

# The engines' work: vLLM counters summed over engines, by (sample name,
# label that must match). Prompt tokens by source split each prompt into
# what the engine computed, found in its own prefix cache, and loaded
# through the KV connector (the store).
ENGINE_COUNTERS: dict[str, tuple[str, tuple[str, str] | None]] = {
    "prompt_tokens": ("vllm:prompt_tokens_total", None),
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", ("source", "local_compute")),
    "local_hit_tokens": ("vllm:prompt_tokens_by_source_total", ("source", "local_cache_hit")),
    "store_tokens": ("vllm:prompt_tokens_by_source_total", ("source", "external_kv_transfer")),
    "generation_tokens": ("vllm:generation_tokens_total", None),
    "requests": ("vllm:request_success_total", None),
    "store_get_bytes": ("vllm:mooncake_store_operation_bytes_total", ("operation", "load_get")),
    "store_put_bytes": ("vllm:mooncake_store_operation_bytes_total", ("operation", "save_put")),
}
PREFETCH_OUTCOMES = ("started", "completed", "cancelled", "failed")


def router_argv(stack: Stack, port: int, config: str) -> list[str]:
    return stack.router_argv(port, ["--session-prefetch", "true" if config == "on" else "false"])


def counters(text: str) -> dict[str, float]:
    """``ENGINE_COUNTERS`` from one engine's Prometheus text (0 when absent)."""
    found = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, label) in ENGINE_COUNTERS.items():
                if sample.name == name and (
                    label is None or sample.labels.get(label[0]) == label[1]
                ):
                    found[key] += sample.value
    return found


def engine_counters(stack: Stack) -> dict[str, float]:
    total = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for proc in stack.procs:
        if proc.grpc:
            for key, value in counters(httpx.get(proc.url, timeout=10).text).items():
                total[key] += value
    return total


def prefetch_counts(text: str) -> dict[str, float]:
    """The router's prefetches by outcome, and the tokens completed ones warmed."""
    found = dict.fromkeys((*PREFETCH_OUTCOMES, "tokens"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_prefetches_total":
                found[sample.labels["outcome"]] += sample.value
            elif sample.name == "tandem_router_prefetch_tokens_total":
                found["tokens"] += sample.value
    return found


def with_gaps(records: list[dict]) -> list[dict]:
    """Each record with ``gap``: seconds from the end of the same agent's
    previous request (its session as the router keys it) to this one's
    start; None for an agent's first request, or after a failed one."""
    last_end: dict[tuple[str, str], float | None] = {}
    out = []
    for r in sorted(records, key=lambda r: r["start"]):
        agent = (r["session"], r["agent"])
        end = last_end.get(agent)
        out.append({**r, "gap": None if end is None else r["start"] - end})
        last_end[agent] = r["start"] + r["e2e"] if r.get("e2e") is not None else None
    return out


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def summarize(label: str, runs: list[dict], gap_s: float) -> dict:
    """One configuration's row over its runs (records pooled, counters summed)."""
    records = [r for run in runs for r in with_gaps(run["records"])]
    ok = [r for r in records if r.get("ok")]
    after_gap = [r for r in ok if r["gap"] is not None and r["gap"] >= gap_s]
    ttft = [r["ttft"] for r in ok]
    gap_ttft = [r["ttft"] for r in after_gap]
    prompt = sum(r.get("prompt_tokens") or 0 for r in after_gap)
    cached = sum(r.get("cached_tokens") or 0 for r in after_gap)
    engines = {k: sum(run["engines"][k] for run in runs) for k in ENGINE_COUNTERS}
    prefetch = {k: sum(run["prefetch"][k] for run in runs) for k in (*PREFETCH_OUTCOMES, "tokens")}
    return {
        "label": label,
        "runs": len(runs),
        "requests": len(records),
        "ok": len(ok),
        "failures": sum(1 for r in records if not r.get("ok")),
        "gap_turns": len(after_gap),
        "gap_ttft_p50": metrics.percentile(gap_ttft, 50),
        "gap_ttft_p90": metrics.percentile(gap_ttft, 90),
        "gap_ttft_mean": sum(gap_ttft) / len(gap_ttft) if gap_ttft else None,
        "gap_cached_share": _share(cached, prompt),
        "gap_uncached_tokens": prompt - cached,
        "ttft_p50": metrics.percentile(ttft, 50),
        "ttft_p90": metrics.percentile(ttft, 90),
        "hit_rate": _share(
            sum(r.get("cached_tokens") or 0 for r in ok),
            sum(r.get("prompt_tokens") or 0 for r in ok),
        ),
        "duration_s": sum(run["summary"]["duration_s"] for run in runs),
        "prefetch": prefetch,
        "engines": engines,
    }


def _pct(value) -> str:
    return cell(value and 100 * value, "{:.1f}%")


RATIO_KEYS = (
    "gap_ttft_p50",
    "gap_ttft_p90",
    "gap_ttft_mean",
    "gap_cached_share",
    "ttft_p50",
    "ttft_p90",
)
ENGINE_RATIO_KEYS = (
    "prompt_tokens",
    "computed_tokens",
    "store_tokens",
    "store_get_bytes",
    "requests",
)


def tables(rows: list[dict], gap_s: float) -> list[str]:
    lines = [
        f"| config | requests | turns after a gap ≥ {gap_s:g} s | their TTFT p50 | p90 "
        f"| mean (s) | their cached share | all TTFT p50 | p90 (s) | hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['requests']} ({r['failures']} failed) | {r['gap_turns']} "
            f"| {cell(r['gap_ttft_p50'])} | {cell(r['gap_ttft_p90'])} | {cell(r['gap_ttft_mean'])} "
            f"| {_pct(r['gap_cached_share'])} | {cell(r['ttft_p50'])} | {cell(r['ttft_p90'])} "
            f"| {_pct(r['hit_rate'])} |"
        )
    lines += [
        "",
        "| config | prefetches started | completed | cancelled | failed "
        "| tokens warmed | engine requests | prompt tokens | computed | own cache "
        "| from store | store get MB | store put MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, e = r["prefetch"], r["engines"]
        lines.append(
            f"| {r['label']} | {p['started']:.0f} | {p['completed']:.0f} | {p['cancelled']:.0f} "
            f"| {p['failed']:.0f} | {p['tokens']:.0f} | {e['requests']:.0f} "
            f"| {e['prompt_tokens']:.0f} | {e['computed_tokens']:.0f} "
            f"| {e['local_hit_tokens']:.0f} | {e['store_tokens']:.0f} "
            f"| {e['store_get_bytes'] / 1e6:.0f} | {e['store_put_bytes'] / 1e6:.0f} |"
        )
    by = {r["label"]: r for r in rows}
    if "on" in by and "off" in by:
        on, off = by["on"], by["off"]
        ratios = [f"{k} {cell(metrics.ratio(on[k], off[k]), '{:.2f}×')}" for k in RATIO_KEYS]
        ratios += [
            f"engine {k} {cell(metrics.ratio(on['engines'][k], off['engines'][k]), '{:.2f}×')}"
            for k in ENGINE_RATIO_KEYS
        ]
        lines += ["", "on / off: " + ", ".join(ratios)]
    return lines + [""]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.session_prefetch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_order_arguments(ap)
    ap.add_argument("--sessions", type=int, default=8, help="sessions in the trace (default 8)")
    ap.add_argument("--turns-median", type=float, default=5, help="median turns per session")
    ap.add_argument(
        "--think-median",
        type=float,
        default=6.0,
        help="median think time between an agent's turns, s (default 6)",
    )
    ap.add_argument(
        "--think-sigma",
        type=float,
        default=1.3,
        help="lognormal spread of think times (default 1.3: a long tail)",
    )
    ap.add_argument("--think-max", type=float, default=60.0, help="longest think time, s")
    ap.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    ap.add_argument("-c", "--concurrency", type=int, default=3, help="session lanes")
    ap.add_argument("--engines", type=int, default=1, help="aggregated engines (default 1)")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=36,
        help="KV blocks of 128 tokens per engine (--num-gpu-blocks-override; "
        "default 36: about the live sessions' contexts at -c 3)",
    )
    ap.add_argument(
        "--kv-store",
        choices=("on", "off"),
        default="on",
        help="the shared KV store (default on: an evicted prefix is loaded from "
        "it; off: recomputed)",
    )
    ap.add_argument(
        "--gap-s",
        type=float,
        default=5.0,
        help="a turn 'follows a gap' when its agent was idle this long (default 5)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--out", help="output directory (default bench/results/<time>-prefetch)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.rounds, a.engines, a.kv_blocks, a.concurrency) < 1:
        print("--rounds, --engines, --kv-blocks and -c must be at least 1", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from common.model import resolve_model

    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-prefetch")
    sessions, info = generate.generated_trace(
        "small",
        sessions=a.sessions,
        turns_median=a.turns_median,
        seed=a.seed,
        think_median=a.think_median,
        think_sigma=a.think_sigma,
        think_max=a.think_max,
    )
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    order = replay_order(a.first, a.rounds)
    state = out / "logs"  # engine, store and router logs, beside the results
    stack = Stack(
        StackConfig(
            prefill=0,
            decode=0,
            aggregated=a.engines,
            kv_store=a.kv_store == "on",
            router=False,
            kv_cache_gib=1,
            max_model_len=4096,
            state_dir=state,
            kv_store_pool="4GB",
            engine_args=["--num-gpu-blocks-override", str(a.kv_blocks)],
        )
    )
    started = time.monotonic()

    def replay(url: str):
        before = engine_counters(stack)
        result = replay_through(
            url,
            sessions,
            tok,
            concurrency=a.concurrency,
            timeout_s=a.timeout,
            session_end_header=SESSION_END_HEADER,
        )
        prefetch = prefetch_counts(httpx.get(f"{url}/metrics", timeout=10).text)
        after = engine_counters(stack)
        return result, {
            "prefetch": prefetch,
            "engines": {k: after[k] - before[k] for k in ENGINE_COUNTERS},
        }

    runs = replay_each(
        stack,
        Processes(state),
        order,
        out,
        info,
        lambda port, config: router_argv(stack, port, config),
        replay,
    )
    rows = [summarize(c, runs[c], a.gap_s) for c in CONFIGS if c in runs]
    minutes = (time.monotonic() - started) / 60
    command = " ".join(
        ["python -m bench.session_prefetch", *(argv if argv is not None else sys.argv[1:])]
    )
    stats = info["stats"]
    notes = [
        f"`{command}`, {minutes:.0f} min, {os.cpu_count()} cores; {a.engines} aggregated "
        f"vLLM CPU engine(s) of {a.kv_blocks} KV blocks (128 tokens), KV store "
        f"{a.kv_store}; replay order {', '.join(order)}; concurrency {a.concurrency}; "
        f"trace: {stats['sessions']} sessions, {stats['requests']} requests, input p50 "
        f"{stats['in_p50']:.0f} tokens, think p50 {stats['think_p50']:.1f} s; "
        f"`{SESSION_END_HEADER}: 1` on each agent's last request.",
        "\n".join(tables(rows, a.gap_s)),
    ]  # one note: a paragraph of tables
    all_runs = write_results(
        out, "Session KV prefetch on vs off", runs, rows, notes, "session_prefetch.json"
    )
    return 0 if len(all_runs) == len(order) and not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
