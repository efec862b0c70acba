"""What the router on/off benchmarks share (``bench.request_classes``,
``bench.session_prefetch``, ``bench.remote_prefill_scope``): one stack of
engines started once, one router process per replay with the configuration's
flags, a fresh content salt per replay so that no run inherits another's
cache, and the configurations alternating round by round so that a drift in
the machine spreads over both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.agentx import report
from bench.harness import log, sigterm_as_interrupt
from common.ports import free_port
from common.procs import Processes, wait_http_ok
from services.stack import Stack
from tandem.workload import generate, metrics
from tandem.workload.content import PromptBuilder
from tandem.workload.endpoint import served_model
from tandem.workload.metrics import cell
from tandem.workload.replay import ReplayConfig, Replayer, ReplayResult, build_prompts, new_salt
from tandem.workload.runs import make_run, write_run
from tandem.workload.trace import Session

CONFIGS = ("off", "on")


def add_order_arguments(ap: argparse.ArgumentParser) -> None:
    """``--rounds`` and ``--first``, which ``replay_order`` takes."""
    ap.add_argument("--rounds", type=int, default=1, help="replays per configuration")
    ap.add_argument(
        "--first",
        choices=CONFIGS,
        default="off",
        help="the configuration replayed first (then alternating; default off)",
    )


def add_trace_arguments(
    ap: argparse.ArgumentParser, *, sessions: int, first_in_median: int, seed: int, concurrency: int
) -> None:
    """The flags of the small generated agentic trace and its replay
    (``small_trace`` reads them), with this benchmark's defaults."""
    ap.add_argument(
        "--sessions", type=int, default=sessions, help=f"sessions in the trace (default {sessions})"
    )
    ap.add_argument("--turns-median", type=float, default=4, help="median turns per session")
    ap.add_argument(
        "--first-in-median",
        type=int,
        default=first_in_median,
        help=f"median first-turn input, tokens (default {first_in_median})",
    )
    ap.add_argument("--seed", type=int, default=seed, help=f"trace seed (default {seed})")
    ap.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=concurrency,
        help=f"session lanes (default {concurrency})",
    )
    ap.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, s")


def small_trace(a: argparse.Namespace) -> tuple[list[Session], dict, Any]:
    """The trace ``add_trace_arguments``' flags describe, its info, and the
    served model's tokenizer."""
    from transformers import AutoTokenizer

    from common.model import resolve_model

    sessions, info = generate.generated_trace(
        "small",
        sessions=a.sessions,
        turns_median=a.turns_median,
        seed=a.seed,
        first_in_median=a.first_in_median,
        max_context=3584,
    )
    return sessions, info, AutoTokenizer.from_pretrained(str(resolve_model(None)))


def replay_small_trace(
    a: argparse.Namespace,
    stack: Stack,
    out: Path,
    router_argv: Callable[[int, str], list[str]],
    figures: Callable[[str], dict],
) -> tuple[dict[str, list[dict]], list[str]]:
    """``replay_each`` over the trace of ``add_trace_arguments``' flags, in
    the order of ``add_order_arguments``'; ``figures(url)`` is read from each
    router after its replay. Returns the runs by configuration and the order."""
    sessions, info, tok = small_trace(a)
    order = replay_order(a.first, a.rounds)

    def replay(url: str) -> tuple[ReplayResult, dict]:
        result = replay_through(
            url,
            sessions,
            tok,
            concurrency=a.concurrency,
            think_scale=a.think_scale,
            timeout_s=a.timeout,
        )
        return result, figures(url)

    runs = replay_each(
        stack, Processes(stack.config.state_dir), order, out, info, router_argv, replay
    )
    return runs, order


def on_off_ratios(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """The line of ratios "on" / "off" of ``keys`` (none when either is missing)."""
    by = {r["label"]: r for r in rows}
    if "on" not in by or "off" not in by:
        return []
    return [
        "",
        "on / off: "
        + ", ".join(
            f"{k} {cell(metrics.ratio(by['on'][k], by['off'][k]), '{:.2f}×')}" for k in keys
        ),
    ]


def replay_order(first: str, rounds: int) -> list[str]:
    """Configurations alternating, each round reversed: off, on, on, off, ..."""
    pair = CONFIGS if first == "off" else CONFIGS[::-1]
    return [c for r in range(rounds) for c in (pair if r % 2 == 0 else pair[::-1])]


def replay_through(
    url: str, sessions: list[Session], tokenizer: Any, **config: Any
) -> ReplayResult:
    """One replay of the trace through the router at ``url``, with a fresh
    content salt; ``config``: ``ReplayConfig`` fields."""
    builder = PromptBuilder(tokenizer, salt=new_salt())
    replay_cfg = ReplayConfig(
        url=url, model=served_model(url), progress=sys.stderr.isatty(), **config
    )
    return asyncio.run(
        Replayer(replay_cfg, sessions, build_prompts(sessions, builder), salt=builder.salt).run()
    )


def write_results(
    out: Path,
    title: str,
    runs: dict[str, list[dict]],
    rows: list[dict],
    notes: list[str],
    json_name: str,
) -> list[dict]:
    """The report (with ``notes`` on top) and the rows as JSON under ``out``;
    prints the notes. Returns every run written."""
    all_runs = [run for config_runs in runs.values() for run in config_runs]
    if all_runs:
        report.write_report(all_runs, out, title=title, notes=notes)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(rows, indent=1))
    print("\n\n".join(notes))
    return all_runs


def replay_each(
    stack: Stack,
    procs: Processes,
    order: list[str],
    out: Path,
    info: dict,
    router_argv: Callable[[int, str], list[str]],
    replay: Callable[[str], tuple[ReplayResult, dict]],
) -> dict[str, list[dict]]:
    """Start ``stack``, then for each configuration in ``order`` a router
    (``router_argv(port, config)``) and ``replay(url)``, which returns the
    replay's result and the run's own figures, read while the router is up.
    Each run is written to ``out/NN-config/run.json``. Ctrl-C or SIGTERM
    stops early; what ran is returned, by configuration."""
    runs: dict[str, list[dict]] = {}
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            stack.start()
            log(f"engines up in {time.monotonic() - started:.0f}s; replays: {order}")
            for i, config in enumerate(order):
                port = free_port()
                url = f"http://{stack.config.host}:{port}"
                proc, _ = procs.launch(f"router-{config}-{i}", router_argv(port, config))
                try:
                    wait_http_ok(f"{url}/health", proc, time.monotonic() + 120)
                    result, figures = replay(url)
                finally:
                    procs.stop(proc)
                run = make_run(config, result.to_json(), info) | figures
                write_run(run, out / f"{i:02d}-{config}" / "run.json")
                runs.setdefault(config, []).append(run)
                s = run["summary"]
                log(
                    f"{config}: {s['ok']} ok, {s['failures']} failed, TTFT p50 "
                    f"{s['ttft_p50']} s, p99 {s['ttft_p99']} s "
                    f"({(time.monotonic() - started) / 60:.1f} min)"
                )
                if result.interrupted:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
    finally:
        procs.stop_all()
        stack.stop()
    return runs
