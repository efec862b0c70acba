"""The Markdown report with plots, from run files.

A *run* is one replay of one trace against one endpoint at one concurrency
(``run.json``, written by ``tandem.workload.runs``). A report takes one
or more runs (a sweep: several endpoints x concurrencies) and writes
``report.md`` next to ``ttft_cdf.png``, ``pareto.png`` and ``hit_rate_by_turn.png``;
with a baseline it adds ratios measured side by side in the same run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tandem.workload import metrics
from tandem.workload.runs import RESULT_KIND


def load_runs(paths: list[str | Path]) -> list[dict]:
    """Runs from run.json files, or from directories holding them (recursively)."""
    runs = []
    for p in map(Path, paths):
        files = sorted(p.rglob("run.json")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"{p}: no run.json found")
        for f in files:
            try:
                obj = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{f}: not a readable run file ({e})") from None
            if obj.get("kind") != RESULT_KIND:
                raise ValueError(f"{f}: not a replay run file (kind={obj.get('kind')!r})")
            runs.append(obj)
    return runs


# --------------------------------------------------------------------- plots


def _plots(runs: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = []
    # TTFT CDF
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        xs = np.sort([r["ttft"] for r in run["records"] if r.get("ok")])
        if len(xs):
            ax.step(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                where="post",
                label=f"{run['label']} c={run['concurrency']}",
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    made.append("ttft_cdf.png")

    # throughput vs interactivity, one line per label across concurrencies
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = sorted({r["label"] for r in runs})
    all_points = []
    for label in labels:
        pts = sorted(
            (
                r["summary"]["interactivity_p90"],
                r["summary"]["output_tokens_per_s"],
                r["concurrency"],
            )
            for r in runs
            if r["label"] == label
            and r["summary"]["interactivity_p90"]
            and r["summary"]["output_tokens_per_s"]
        )
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for x, y, c in pts:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        all_points.extend((p[0], p[1]) for p in pts)
    front = metrics.pareto_front(all_points)
    if len(front) > 1:
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            "k--",
            lw=0.8,
            alpha=0.6,
            label="Pareto frontier",
        )
    ax.set_xlabel("P90 interactivity (output tokens/s/user)")
    ax.set_ylabel("output tokens/s (total)")
    ax.set_title("Throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)
    made.append("pareto.png")

    # hit rate per turn index
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        rows = [row for row in run["per_turn"] if row["hit_rate"] is not None]
        if rows:
            ax.plot(
                [row["turn"] for row in rows],
                [100 * row["hit_rate"] for row in rows],
                marker=".",
                label=f"{run['label']} c={run['concurrency']}",
            )
    ax.set_xlabel("turn index within the agent (0 = first call)")
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Hit rate per turn index")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hit_rate_by_turn.png", dpi=110)
    plt.close(fig)
    made.append("hit_rate_by_turn.png")
    return made


# ------------------------------------------------------------------ markdown


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    if v is None:
        return "—"
    return fmt.format(v)


def _pct(v: Any) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def markdown(
    runs: list[dict],
    baseline: str | None = None,
    images: list[str] = (),
    title: str = "Agentic replay report",
    notes: list[str] = (),
) -> str:
    lines = [
        f"# {title}",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m bench`.",
        "",
    ]
    traces = {json.dumps(r["trace"].get("path")): r["trace"] for r in runs}
    for tr in traces.values():
        st = tr.get("stats", {})
        lines += [
            f"**Trace** `{tr.get('path')}`: {st.get('sessions')} sessions, "
            f"{st.get('requests')} requests, median {st.get('turns_median')} turns, "
            f"{_pct(st.get('subagent_share'))} of sessions with sub-agents "
            f"(median {st.get('subagents_per_fanout_median')} per fan-out), "
            f"per-turn prefix reuse {_pct(st.get('reuse_mean'))}, "
            f"input p50 {_f(st.get('in_p50'), '{:.0f}')} / max "
            f"{_f(st.get('in_max'), '{:.0f}')} tokens, output p50 "
            f"{_f(st.get('out_p50'), '{:.0f}')} tokens. Hit-rate bound "
            f"(unbounded cache, trace order): {_pct(st.get('reuse_bound'))} "
            f"({_pct(st.get('reuse_bound_engine128'))} in 128-token engine blocks).",
            "",
        ]
    for n in notes:
        lines += [n, ""]
    lines += [
        "## Results",
        "",
        "| run | conc. | ok / fail | TTFT p50 | p90 | p99 (s) | ITL p50 (ms) | "
        "P90 interactivity (tok/s/user) | total tok/s | output tok/s | hit rate "
        "| duration (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(runs, key=lambda r: (r["label"], r["concurrency"])):
        s = r["summary"]
        fail = f"{s['ok']} / {s['failures']}" + (
            f" (+{s['interrupted']} interrupted)" if s.get("interrupted") else ""
        )
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {fail} | {_f(s['ttft_p50'])} | "
            f"{_f(s['ttft_p90'])} | {_f(s['ttft_p99'])} | "
            f"{_f(s['itl_p50'] and 1000 * s['itl_p50'], '{:.1f}')} | "
            f"{_f(s['interactivity_p90'], '{:.1f}')} | {_f(s['total_tokens_per_s'], '{:.0f}')} | "
            f"{_f(s['output_tokens_per_s'], '{:.1f}')} | {_pct(s['hit_rate'])} | "
            f"{_f(s['duration_s'], '{:.1f}')} |"
        )
    lines.append("")
    mism = sum(r["summary"].get("prompt_tokens_mismatch", 0) for r in runs)
    if mism:
        lines += [
            f"**Warning:** {mism} responses reported a prompt length different from "
            f"the built prompt: the server's tokenizer or chat template differs from "
            f"the replay's, so the block structure is not reproduced exactly.",
            "",
        ]
    if any(r["summary"]["failures"] for r in runs):
        lines += ["### Failures", ""]
        for r in runs:
            for kind, n in r["summary"]["failure_kinds"].items():
                lines.append(f"* {r['label']} c={r['concurrency']}: {n} × `{kind}`")
        lines.append("")
    if baseline:
        lines += ratio_table(runs, baseline)
    for img in images:
        lines += [f"![{img}]({img})", ""]
    lines += [
        "Metric definitions: TTFT = time to the first non-empty content chunk; "
        "ITL = (E2E − TTFT)/(output tokens − 1); P90 interactivity = 1 / P90 of "
        "(E2E / output tokens) per request; total tok/s = (input tokens, cached "
        "included, + output tokens) / run duration; hit rate = Σ cached_tokens / "
        "Σ prompt_tokens from the server's usage. Run duration: first request sent to "
        "last response finished.",
        "",
    ]
    return "\n".join(lines)


def ratio_table(runs: list[dict], baseline: str) -> list[str]:
    base = {r["concurrency"]: r for r in runs if r["label"] == baseline}
    if not base:
        return [f"*(baseline {baseline!r} not among the runs: no ratios)*", ""]
    lines = [
        f"## Ratios vs baseline `{baseline}` (same run, same trace)",
        "",
        "TTFT ratios below 1 and throughput ratios above 1 favour the configuration.",
        "",
        "| run | conc. | TTFT p50 | TTFT p90 | TTFT p99 | total tok/s | output tok/s | "
        "P90 interactivity | hit rate (pp) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    R = metrics.ratio
    for r in sorted(runs, key=lambda r: (r["label"], r["concurrency"])):
        if r["label"] == baseline or r["concurrency"] not in base:
            continue
        s, b = r["summary"], base[r["concurrency"]]["summary"]
        hit = (
            None
            if s["hit_rate"] is None or b["hit_rate"] is None
            else f"{100 * (s['hit_rate'] - b['hit_rate']):+.1f}"
        )
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {_ratio(R(s['ttft_p50'], b['ttft_p50']))} | "
            f"{_ratio(R(s['ttft_p90'], b['ttft_p90']))} | "
            f"{_ratio(R(s['ttft_p99'], b['ttft_p99']))} | "
            f"{_ratio(R(s['total_tokens_per_s'], b['total_tokens_per_s']))} | "
            f"{_ratio(R(s['output_tokens_per_s'], b['output_tokens_per_s']))} | "
            f"{_ratio(R(s['interactivity_p90'], b['interactivity_p90']))} | {hit or '—'} |"
        )
    lines.append("")
    return lines


def write_report(
    runs: list[dict],
    out_dir: str | Path,
    baseline: str | None = None,
    title: str = "Agentic replay report",
    notes: list[str] = (),
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(runs, out)
    summary = [
        {
            "label": r["label"],
            "concurrency": r["concurrency"],
            "endpoint": r["endpoint"],
            "summary": r["summary"],
        }
        for r in runs
    ]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    path = out / "report.md"
    path.write_text(markdown(runs, baseline, images, title, notes))
    return path
