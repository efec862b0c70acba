"""Processes in their own process groups: start them, wait until they are
ready, stop them with everything they forked.

vLLM forks engine-core and worker processes, so every service runs in a
process group of its own (``start_new_session``) and is stopped as a group:
SIGTERM to the main process, SIGKILL to the group after a grace period — no
orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Seconds the rest of a process group may outlive its main process at a stop.
ORPHAN_GRACE_S = 2.0
# How long a SIGKILLed group may take to be gone.
KILL_WAIT_S = 5.0


class ProcessError(RuntimeError):
    """A process exited during start-up or was not ready in time."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: str
    pid: int | None = None
    grpc: str | None = None  # host:port of an engine
    kv_events: str | None = None  # the engine's KV event endpoints, as the router takes them
    url: str | None = None  # http URL (router, metrics)

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        # A zombie (exited, not reaped) counts as dead.
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except OSError:
            return False


def raise_if_exited(proc: Proc) -> None:
    if not proc.alive():
        tail = Path(proc.log).read_text(errors="replace")[-3000:]
        raise ProcessError(f"{proc.name} exited during start-up; last log lines:\n{tail}")


def wait_http_ok(url: str, proc: Proc, deadline: float) -> None:
    """Wait until `url` answers 200, failing early if `proc` exits."""
    while True:
        raise_if_exited(proc)
        try:
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ProcessError(f"{proc.name} not ready in time; see {proc.log}")
        time.sleep(0.3)


def wait_grpc_serving(address: str, proc: Proc, deadline: float, poll_s: float = 0.5) -> None:
    """Wait until grpc.health.v1 at `address` says SERVING, failing early if
    `proc` exits."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            raise_if_exited(proc)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise ProcessError(f"{proc.name} not ready in time; see {proc.log}")
            time.sleep(poll_s)


def stop_process_group(proc: Proc, grace_s: float) -> None:
    """SIGTERM the service's main process, SIGKILL its whole group if anything
    is left after the grace period.

    Only the main process gets SIGTERM, as in a Kubernetes pod: it drains and
    shuts its vLLM engine down in order. (SIGTERM to the whole group would make
    vLLM's engine core abort in-flight requests at once.)"""
    stop_process_groups([proc], grace_s)


def stop_process_groups(procs: Iterable[Proc], grace_s: float) -> None:
    """`stop_process_group` for several services at once: all get SIGTERM
    together and share one grace period, so peers (a stack's engines) shut
    down side by side rather than one after another."""
    pids = [p.pid for p in procs if p.pid is not None]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.2)
    # The services have shut down: what is left of their groups are helpers
    # that do not exit on their own (vLLM's CPU worker), given a moment, then
    # killed, rather than the whole grace period meant for draining.
    deadline = min(deadline, time.monotonic() + ORPHAN_GRACE_S)
    while time.monotonic() < deadline and any(group_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # SIGKILL takes effect when each process is next scheduled, which on a
    # busy machine is not at once: callers take "returned" to mean "gone".
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(group_alive(pid) for pid in pids):
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """Whether the process runs (an exited child not yet waited for does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def group_stats(pgid: int) -> Iterator[list[str]]:
    """The /proc/<pid>/stat fields (after the command name) of every process
    in process group ``pgid``: field 0 is the state, 11 and 12 utime/stime."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            yield fields


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies are not)."""
    return any(fields[0] != "Z" for fields in group_stats(pgid))


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(int(f[11]) + int(f[12]) for f in group_stats(pgid))  # utime + stime
    return total / tick


def launch(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
    stdout=None,
    append: bool = False,
) -> tuple[Proc, subprocess.Popen]:
    """Start `argv` in a process group of its own (stop it with
    `stop_process_group`), its output (stderr, and stdout unless `stdout` is
    given) in `log` — appended to with `append`, else overwritten. `env` adds
    to this process's environment; `cpus` pins it (and what it forks)."""
    with open(log, "ab" if append else "wb") as log_file:
        popen = subprocess.Popen(
            argv,
            stdout=stdout or log_file,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=None if cpus is None else _pinned(cpus),
        )
    return Proc(name=name, argv=argv, log=str(log), pid=popen.pid), popen


def _pinned(cpus: set[int]):
    def preexec() -> None:
        os.sched_setaffinity(0, cpus)

    return preexec


class Processes:
    """Every process a benchmark or test starts, each in its own process
    group and pinned to given CPUs, its output in ``<log_dir>/<name>.log``;
    `stop_all` (also on errors and Ctrl-C) ends them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[Proc, subprocess.Popen]] = []

    def launch(
        self,
        name: str,
        argv: list[str],
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
        stdout=None,
    ) -> tuple[Proc, subprocess.Popen]:
        proc, popen = launch(name, argv, self.log_dir / f"{name}.log", env, cpus, stdout)
        self.procs.append((proc, popen))
        return proc, popen

    def stop(self, proc: Proc, grace_s: float = 5.0) -> None:
        for i, (p, popen) in enumerate(self.procs):
            if p is proc:
                stop_process_group(p, grace_s)
                try:
                    popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                del self.procs[i]
                return

    def stop_all(self) -> None:
        for proc, _ in list(reversed(self.procs)):
            self.stop(proc)
