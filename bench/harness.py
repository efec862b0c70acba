"""What every benchmark (and the tests' helpers) share: where results go,
progress lines, the `tandem` command run as a user runs it, CPU counters, a
Redis server, and Ctrl-C/SIGTERM handling.

Processes and ports come from ``common.procs`` and ``common.ports``; the
endpoint, its SSE stream and percentiles from ``tandem.workload``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.ports import free_port
from common.procs import Proc, launch, stop_process_group
from devcluster.client import COMMAND_TIMEOUT_S, LocalCluster

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries reports)."""
    print(msg, file=sys.stderr, flush=True)


def tandem_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`tandem ARGS...` as a user runs it, from the repository root, its
    output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cluster_up(state: Path, bridge: str, pod_cidr: str) -> LocalCluster:
    """`tandem cluster up` on a bridge and addresses of the caller's own (a
    user's cluster and other runs may be beside it); raises with its error."""
    started = tandem_cli(
        "cluster",
        "up",
        "--state-dir",
        str(state),
        "--bridge",
        bridge,
        "--pod-cidr",
        pod_cidr,
        timeout=COMMAND_TIMEOUT_S,
    )
    if started.returncode:
        raise RuntimeError(f"tandem cluster up failed:\n{started.stderr}")
    return LocalCluster(state)


def cluster_down(state: Path) -> subprocess.CompletedProcess:
    """`tandem cluster down`: every pod's processes, netns and link gone."""
    return tandem_cli("cluster", "down", "--state-dir", str(state), timeout=COMMAND_TIMEOUT_S)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so a benchmark
    stopped either way cleans up (stops what it started) the same way."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- CPU ------------------------------------------------------------------------------


def cpu_busy_seconds(cpus: list[int]) -> dict[int, float]:
    """Seconds each CPU spent busy (anything but idle and iowait) since boot,
    from /proc/stat: whatever ran there, the benchmark's processes or not."""
    tick = os.sysconf("SC_CLK_TCK")
    wanted = {f"cpu{n}": n for n in cpus}
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name in wanted:
                # user nice system idle iowait irq softirq steal
                ticks = [int(v) for v in values[:8]]
                out[wanted[name]] = (sum(ticks) - ticks[3] - ticks[4]) / tick
    return out


# -- Redis ----------------------------------------------------------------------------


class RedisServer:
    """A real ``redis-server`` on a loopback port (``make apt`` installs it),
    without persistence: a restart comes back empty, as a Redis pod without a
    volume does. ``stop`` is a clean shutdown, ``kill`` a SIGKILL; ``start``
    again reuses the port. Its output goes to ``<log_dir>/redis-<port>.log``.
    A missing binary or a server that does not answer raises RuntimeError."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log = Path(log_dir) / f"redis-{self.port}.log"
        self.proc: Proc | None = None
        self._popen = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (make apt, or apt-get install -y redis-server)"
            )
        self.proc, self._popen = launch(
            "redis",
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            self.log,
            append=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._popen.returncode} on port "
                    f"{self.port} (log: {self.log})"
                )
            if self.ping():
                return
            time.sleep(0.02)
        raise RuntimeError(
            f"redis-server did not answer PING on port {self.port} (log: {self.log})"
        )

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._running():
            stop_process_group(self.proc, grace_s=10.0)
            self._popen.wait(timeout=10)

    def kill(self) -> None:
        if self._running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self._popen.wait(timeout=10)

    def _running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None
