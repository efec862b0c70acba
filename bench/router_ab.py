"""What the router on/off benchmarks share (``bench.request_classes``,
``bench.session_prefetch``): one stack of engines started once, one router
process per replay with the configuration's flags, a fresh content salt per
replay so that no run inherits another's cache, and the configurations
alternating round by round so that a drift in the machine spreads over both.
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
from bench.agentx.content import PromptBuilder
from bench.agentx.replay import ReplayConfig, Replayer, ReplayResult, build_prompts, new_salt
from bench.agentx.trace import Session
from bench.harness import log, served_model, sigterm_as_interrupt
from common.ports import free_port
from common.procs import Processes, wait_http_ok
from services.stack import Stack

CONFIGS = ("off", "on")


def add_order_arguments(ap: argparse.ArgumentParser) -> None:
    """``--rounds`` and ``--first``, which ``replay_order`` takes."""
    ap.add_argument("--rounds", type=int, default=1, help="replays per configuration")
    ap.add_argument("--first", choices=CONFIGS, default="off",
                    help="the configuration replayed first (then alternating; default off)")


def replay_order(first: str, rounds: int) -> list[str]:
    """Configurations alternating, each round reversed: off, on, on, off, ..."""
    pair = CONFIGS if first == "off" else CONFIGS[::-1]
    return [c for r in range(rounds) for c in (pair if r % 2 == 0 else pair[::-1])]


def replay_through(url: str, sessions: list[Session], tokenizer: Any,
                   **config: Any) -> ReplayResult:
    """One replay of the trace through the router at ``url``, with a fresh
    content salt; ``config``: ``ReplayConfig`` fields."""
    builder = PromptBuilder(tokenizer, salt=new_salt())
    replay_cfg = ReplayConfig(url=url, model=served_model(url), progress=sys.stderr.isatty(),
                              **config)
    return asyncio.run(Replayer(replay_cfg, sessions, build_prompts(sessions, builder),
                                salt=builder.salt).run())


def write_results(out: Path, title: str, runs: dict[str, list[dict]], rows: list[dict],
                  notes: list[str], json_name: str) -> list[dict]:
    """The report (with ``notes`` on top) and the rows as JSON under ``out``;
    prints the notes. Returns every run written."""
    all_runs = [run for config_runs in runs.values() for run in config_runs]
    if all_runs:
        report.write_report(all_runs, out, title=title, notes=notes)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(rows, indent=1))
    print("\n\n".join(notes))
    return all_runs


def replay_each(stack: Stack, procs: Processes, order: list[str], out: Path, info: dict,
                router_argv: Callable[[int, str], list[str]],
                replay: Callable[[str], tuple[ReplayResult, dict]]) -> dict[str, list[dict]]:
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
                run = report.make_run(config, result.to_json(), info) | figures
                report.write_run(run, out / f"{i:02d}-{config}" / "run.json")
                runs.setdefault(config, []).append(run)
                s = run["summary"]
                log(f"{config}: {s['ok']} ok, {s['failures']} failed, TTFT p50 "
                    f"{s['ttft_p50']} s, p99 {s['ttft_p99']} s "
                    f"({(time.monotonic() - started) / 60:.1f} min)")
                if result.interrupted:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
    finally:
        procs.stop_all()
        stack.stop()
    return runs
