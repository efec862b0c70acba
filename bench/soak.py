"""The soak: the embedded stack under the agentic replay for an hour (not in
CI), the router's and the engines' resident memory and open file
descriptors sampled every minute; it fails when either grows past a stated
tolerance once warmed up.

The replay plays fresh synthetic sessions (a new seed, so new prompts and
new KV blocks, each round) at steady concurrency until ``--minutes`` pass.
The router runs with small memory bounds (``ROUTER_BOUNDS``), so that its
tables fill within the first minutes and stay full: what the soak then
watches is whether anything else grows. Each process is measured with its
children (vLLM's engine core runs in a child process).

Growth (``growth``): per process, the median of the last quarter of the
samples against the median of the samples from the end of the warm-up
(``--warmup-minutes``) to the end of the second quarter; resident memory
may grow by ``--rss-tolerance`` (a share), open fds by ``--fd-tolerance``
(a count).

    make soak                                  # 60 minutes
    python -m bench.soak --minutes 10 --interval-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import sigterm_as_interrupt

# Small bounds, each reached in the first minutes of the replay.
ROUTER_BOUNDS = [
    "--routing-index-capacity=2000",
    "--routing-predicted-capacity=1000",
    "--max-session-bindings=64",
    "--live-max-sessions=64",
    "--live-max-blocks=2000",
    "--kv-retention-max-sessions=64",
    "--kv-retention-max-blocks=2000",
    "--tokenizer-cache-sessions=32",
    "--tokenizer-cache-tokens=200000",
    "--responses-store-max=64",
]


@dataclass(frozen=True)
class Sample:
    minute: float  # since the replay started
    rss_bytes: int  # the process and its children
    fds: int


@dataclass(frozen=True)
class Growth:
    process: str
    what: str  # "rss" or "fds"
    before: float  # median of the window after warm-up
    after: float  # median of the last quarter
    allowed: float  # the most ``after`` may be
    grew: bool


def growth(
    samples: Sequence[Sample],
    process: str,
    warmup_minutes: float,
    rss_tolerance: float,
    fd_tolerance: int,
) -> list[Growth]:
    """Whether ``process`` grew once warmed up (see the module's doc).

    Needs at least four samples past the warm-up; fewer is an error, not a pass."""
    warm = [s for s in samples if s.minute >= warmup_minutes]
    if len(warm) < 4:
        raise ValueError(
            f"{process}: {len(warm)} samples after a {warmup_minutes:g}-minute warm-up; "
            "need at least 4 (run longer or sample more often)"
        )
    quarter = max(1, len(warm) // 4)
    early, late = warm[: 2 * quarter], warm[-quarter:]
    results = []
    for what, value, allowed_of in (
        ("rss", lambda s: s.rss_bytes, lambda v: v * (1 + rss_tolerance)),
        ("fds", lambda s: s.fds, lambda v: v + fd_tolerance),
    ):
        before = statistics.median(value(s) for s in early)
        after = statistics.median(value(s) for s in late)
        allowed = allowed_of(before)
        results.append(Growth(process, what, before, after, allowed, after > allowed))
    return results


def report(samples: dict[str, list[Sample]]) -> str:
    """One row a sample: each process's RSS (MiB) and open fds."""
    names = list(samples)
    head = f"{'minute':>7} " + " ".join(f"{n + ' MiB':>16} {n + ' fds':>12}" for n in names)
    rows = [head]
    for i in range(max((len(v) for v in samples.values()), default=0)):
        cells = []
        minute = ""
        for n in names:
            if i < len(samples[n]):
                s = samples[n][i]
                minute = f"{s.minute:7.1f}"
                cells.append(f"{s.rss_bytes / 2**20:>16.1f} {s.fds:>12d}")
            else:
                cells.append(f"{'':>16} {'':>12}")
        rows.append(f"{minute:>7} " + " ".join(cells))
    return "\n".join(rows)


def measure(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of a process and its children."""
    import psutil

    root = psutil.Process(pid)
    rss = fds = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
        except psutil.NoSuchProcess:
            continue
    return rss, fds


class Sampler:
    """Samples the named processes every ``interval_s`` in a thread."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: dict[str, list[Sample]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            minute = (time.monotonic() - self._start) / 60
            for name, pid in self.pids.items():
                rss, fds = measure(pid)
                self.samples[name].append(Sample(minute, rss, fds))
            print(report({n: s[-1:] for n, s in self.samples.items()}).splitlines()[-1], flush=True)
            if self._stop.wait(self.interval_s):
                return


async def drive(url: str, minutes: float, concurrency: int, sessions: int) -> int:
    """Replay fresh sessions until ``minutes`` pass; returns requests played."""
    from transformers import AutoTokenizer

    from common.model import resolve_model
    from tandem.workload import generate
    from tandem.workload.content import PromptBuilder
    from tandem.workload.endpoint import served_model
    from tandem.workload.replay import ReplayConfig, new_salt, replay

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    model = served_model(url)
    deadline = time.monotonic() + minutes * 60
    played = 0
    seed = 0
    while (left := deadline - time.monotonic()) > 0:
        params = generate.params_for("small", sessions=sessions, seed=seed)
        config = ReplayConfig(
            url=url,
            model=model,
            concurrency=concurrency,
            duration_s=left,
            session_end_header="x-session-end",
            progress=False,
        )
        result = await replay(
            config, generate.generate(params), PromptBuilder(tokenizer, salt=new_salt())
        )
        played += len(result.records)
        if result.interrupted:
            break
        seed += 1
    return played


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="replay this long (default 60)")
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup-minutes", type=float, default=10.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="share (default 0.10)")
    parser.add_argument("--fd-tolerance", type=int, default=8, help="count (default 8)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=12, help="sessions a replay round")
    args = parser.parse_args(argv)

    from common.ports import free_port
    from services.stack import Stack, StackConfig

    state = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    stack = Stack(
        StackConfig(router_port=free_port(), state_dir=state, router_args=list(ROUTER_BOUNDS))
    )
    stack.start()
    try:
        pids = {p.name: p.pid for p in stack.procs if p.pid is not None and p.name != "kvstore"}
        sampler = Sampler(pids, args.interval_s)
        print(report({n: [] for n in pids}).splitlines()[0], flush=True)
        sampler.start()
        try:
            with sigterm_as_interrupt():
                played = asyncio.run(
                    drive(stack.router_url, args.minutes, args.concurrency, args.sessions)
                )
        finally:
            sampler.stop()
    finally:
        stack.stop()
    print(f"\n{played} requests in {args.minutes:g} minutes; logs in {state}\n")
    print(report(sampler.samples))
    failed = False
    for name, samples in sampler.samples.items():
        try:
            found = growth(
                samples, name, args.warmup_minutes, args.rss_tolerance, args.fd_tolerance
            )
        except ValueError as exc:
            print(f"{name:>10}: {exc}")
            failed = True
            continue
        for g in found:
            unit = 2**20 if g.what == "rss" else 1
            verdict = "GREW" if g.grew else "flat"
            print(
                f"{name:>10} {g.what}: {g.before / unit:.1f} -> {g.after / unit:.1f} "
                f"(at most {g.allowed / unit:.1f}) {verdict}"
            )
            failed |= g.grew
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
