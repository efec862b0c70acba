"""``python -m bench embedded``: the embedded stack with P/D (one prefill + one
decode engine) against the same router in front of one aggregated engine, on a
small agentic trace at a few concurrencies; one report with ratios vs the first
configuration (aggregated by default). Starts and stops the stacks itself.

The two stacks run one after the other (this machine holds two engines at a
time, not three); within each, the concurrencies run back to back on the same
trace with a fresh content salt per run. Absolute times drift on a shared
machine: read the ratios, and rerun to see the spread.

    python -m bench embedded [--concurrencies 1,2] [--sessions 4] [--out DIR]
    python -m bench.agentx.embedded ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.agentx import report
from bench.agentx.sweep import Endpoint, run_sweep
from bench.harness import RESULTS, log
from tandem.workload import generate
from tandem.workload.endpoint import served_model
from tandem.workload.replay import ReplayConfig

CONFIGS = {
    "agg": dict(prefill=0, decode=0, aggregated=1),
    "pd": dict(prefill=1, decode=1, aggregated=0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench embedded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--concurrencies", default="1,2", help="comma-separated (default 1,2)")
    ap.add_argument(
        "--configs",
        default="agg,pd",
        help="stacks to run, in order; the first is the baseline (default agg,pd)",
    )
    ap.add_argument("--sessions", type=int, default=4, help="sessions of the small profile")
    ap.add_argument("--turns-median", type=float, default=4, help="median turns per session")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, s")
    ap.add_argument("--out", help="output directory (default bench/results/<time>-pd-vs-agg)")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from common.model import resolve_model
    from common.ports import free_port
    from services.stack import Stack, StackConfig

    concs = [int(c) for c in a.concurrencies.split(",")]
    names = [n for n in a.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        log(f"unknown config(s) {bad}; choose from {sorted(CONFIGS)}")
        return 2
    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-pd-vs-agg")
    sessions, info = generate.generated_trace(
        "small", sessions=a.sessions, turns_median=a.turns_median, seed=a.seed
    )
    model_dir = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    base = ReplayConfig(
        url="",
        model="",
        think_scale=a.think_scale,
        timeout_s=a.timeout,
        progress=sys.stderr.isatty(),
    )
    runs: list[dict] = []
    problems: list[str] = []
    for name in names:
        cfg = StackConfig(
            router_port=free_port(),
            kv_cache_gib=1,
            max_model_len=4096,
            state_dir=Path(tempfile.mkdtemp(prefix=f"tandem-bench-{name}-")),
            **CONFIGS[name],
        )
        stack = Stack(cfg)
        log(f"starting the {name} stack ({CONFIGS[name]})")
        t0 = time.time()
        try:
            stack.start()
            log(f"{name} stack up in {time.time() - t0:.0f}s at {stack.router_url}")
            runs += run_sweep(
                sessions,
                info,
                [Endpoint(name, stack.router_url)],
                concs,
                replace(base),
                tok,
                out,
                served_model,
                log=log,
            )
        except Exception as e:  # report what was measured, say what was not
            problems.append(f"**{name}: not measured** — {type(e).__name__}: {e}")
            log(f"{name}: {type(e).__name__}: {e}")
        finally:
            stack.stop()
    md = report.write_report(
        runs,
        out,
        baseline=names[0],
        title="P/D vs aggregated",
        notes=[
            f"Configurations run one after the other ({', '.join(names)}), each behind the "
            f"Tandem router; think times scaled by {a.think_scale}.",
            *problems,
        ],
    )
    log(f"report: {md}")
    return 1 if problems or any(r["summary"]["failures"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
