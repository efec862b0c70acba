"""Start, watch and restart the two Mooncake processes.

Order: master first (RPC, HTTP metadata, metrics all answering), then the
pool owner (``mooncake_client``, healthy on its HTTP port). A process that
dies is restarted with exponential backoff; when the master dies the pool
owner is restarted after it, since its segment registration died with the
master. A process that never becomes ready on the first start is a
configuration error: :class:`StartupError` carries the tail of its log.

A pool owner comes back only once the old one is gone for everyone: the
master has dropped its segment (a put allocated in a dead segment fails),
and at least :data:`POOL_OWNER_MIN_DOWN_S` has passed, so that every
engine's shared-memory client has noticed (see there).

Children get ``PR_SET_PDEATHSIG`` so they do not outlive a supervisor that
was killed hard.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.mooncake import Command

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
_STABLE_AFTER_S = 60.0  # a process up this long resets its backoff

# An engine's dummy client (shared-memory transfers, ``shm.py``) maps its KV
# cache into a new pool owner only after one of its pings fails, and its RPC
# pool keeps retrying the connection for about 5 s before a ping does
# (measured 5.0-5.2 s after a SIGKILL, load 8-9). A pool owner back sooner
# answers that ping as healthy without having the engine's memory mapped:
# every shared-memory put and get is then refused (the engines fall back to
# TCP, but never get the one copy back).
POOL_OWNER_MIN_DOWN_S = 8.0


class StartupError(RuntimeError):
    pass


@dataclass
class ProcessStatus:
    ready: bool = False
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    down_since: float | None = None  # time.monotonic() when it stopped or died


def _set_pdeathsig() -> None:  # runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


async def http_ok(url: str, expect: str | None = None, timeout: float = 1.0) -> bool:
    """True when ``url`` answers (any status < 500 unless ``expect`` must appear)."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(url)
    except httpx.HTTPError:
        return False
    if expect is not None:
        return resp.status_code == 200 and expect in resp.text
    return resp.status_code < 500


async def http_text(url: str, timeout: float = 2.0) -> str | None:
    """The body of a 200 answer from ``url``; None otherwise."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(url)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def tcp_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ManagedProcess:
    def __init__(
        self,
        command: Command,
        ready: Callable[[], Awaitable[bool]],
        log_dir: Path,
        start_timeout_s: float,
        backoff_s: float,
    ) -> None:
        self.command = command
        self.name = command.name
        self._ready_check = ready
        self._log_path = log_dir / f"{self.name}.log"
        self._start_timeout_s = start_timeout_s
        self._backoff_s = backoff_s
        self.status = ProcessStatus()
        self._proc: asyncio.subprocess.Process | None = None
        self._tail: deque[str] = deque(maxlen=20)
        self._pump: asyncio.Task | None = None
        self._started_at = 0.0
        self._backoff_n = 0

    @property
    def log_path(self) -> Path:
        return self._log_path

    async def start(self) -> None:
        """Spawn and wait until ready; StartupError with the log tail otherwise."""
        env = {**os.environ, **self.command.env}
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._tail.clear()
        self._proc = await asyncio.create_subprocess_exec(
            *self.command.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_set_pdeathsig,
        )
        self.status.pid = self._proc.pid
        self._started_at = time.monotonic()
        self._pump = asyncio.create_task(self._pump_output(self._proc))
        log.info("started %s pid=%d: %s", self.name, self._proc.pid, " ".join(self.command.argv))
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                await asyncio.sleep(0.1)  # let the pump drain the last lines
                raise StartupError(
                    f"{self.name} exited with code {self._proc.returncode} "
                    f"during start-up:\n{self.tail()}"
                )
            if await self._ready_check():
                self.status.ready = True
                self.status.down_since = None
                log.info("%s ready", self.name)
                return
            await asyncio.sleep(0.2)
        await self.stop()
        raise StartupError(
            f"{self.name} not ready after {self._start_timeout_s:.0f}s "
            f"(see {self._log_path}):\n{self.tail()}"
        )

    def tail(self) -> str:
        return "\n".join(self._tail)

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        with open(self._log_path, "ab") as sink:
            async for raw in proc.stdout:
                sink.write(raw)
                sink.flush()
                line = raw.decode(errors="replace").rstrip()
                self._tail.append(line)
                # glog severity is the first character: E(rror) and F(atal)
                # matter to an operator; the rest stays in the process log.
                if line[:1] in ("E", "F") and "http=404" not in line:
                    log.warning("%s: %s", self.name, line)

    async def wait_exit(self) -> int:
        assert self._proc is not None
        code = await self._proc.wait()
        if self._pump is not None:
            await asyncio.wait({self._pump}, timeout=1)
        self.status.ready = False
        self.status.last_exit = code
        if self.status.down_since is None:
            self.status.down_since = time.monotonic()
        return code

    def backoff(self) -> float:
        if time.monotonic() - self._started_at > _STABLE_AFTER_S:
            self._backoff_n = 0
        n = self._backoff_n
        self._backoff_n = n + 1
        return min(_MAX_BACKOFF_S, self._backoff_s * (2**n))

    async def stop(self, grace_s: float = 5.0) -> None:
        proc = self._proc
        self.status.ready = False
        if proc is None or proc.returncode is not None:
            return
        self.status.down_since = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            log.warning("%s ignored SIGTERM for %.0fs: killing", self.name, grace_s)
            proc.kill()
            await proc.wait()

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()


class Supervisor:
    """Keeps master and pool owner running until :meth:`shutdown`.

    ``segment_dropped``: whether the master no longer holds a pool owner's
    segment (asked before a pool owner is restarted, for up to
    ``segment_timeout_s`` after it went down: the master's client TTL).
    """

    def __init__(
        self,
        master: ManagedProcess,
        client: ManagedProcess,
        segment_dropped: Callable[[], Awaitable[bool]],
        segment_timeout_s: float,
    ) -> None:
        self.master = master
        self.client = client
        self._segment_dropped = segment_dropped
        self._segment_timeout_s = segment_timeout_s
        self._stopping = False
        self._task: asyncio.Task | None = None

    def statuses(self) -> dict[str, ProcessStatus]:
        return {"master": self.master.status, "client": self.client.status}

    @property
    def ready(self) -> bool:
        return self.master.status.ready and self.client.status.ready

    async def start(self) -> None:
        await self.master.start()
        try:
            await self.client.start()
        except BaseException:
            await self.master.stop()
            raise
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while not self._stopping:
            waits = {
                asyncio.create_task(self.master.wait_exit()): self.master,
                asyncio.create_task(self.client.wait_exit()): self.client,
            }
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if self._stopping:
                return
            died = [waits[t] for t in done]
            if self.master in died:
                # The pool owner's registration lived in the master: restart both.
                log.error(
                    "mooncake master died (exit %s); restarting master and pool owner",
                    self.master.status.last_exit,
                )
                await self.client.stop()
                await self._restart(self.master)
                await self._restart(self.client, self._until_pool_owner_gone)
            else:
                log.error(
                    "mooncake pool owner died (exit %s); restarting it",
                    self.client.status.last_exit,
                )
                await self._restart(self.client, self._until_pool_owner_gone)

    async def _until_pool_owner_gone(self) -> None:
        """Wait until the stopped pool owner is gone for the master and for
        the engines' shared-memory clients (module docstring)."""
        down_since = self.client.status.down_since or time.monotonic()
        while not self._stopping:
            down_s = time.monotonic() - down_since
            if down_s >= POOL_OWNER_MIN_DOWN_S:
                if await self._segment_dropped():
                    return
                if down_s >= self._segment_timeout_s:
                    log.warning(
                        "the master still lists the old pool owner's segment after %.0fs; "
                        "restarting the pool owner anyway",
                        down_s,
                    )
                    return
            await asyncio.sleep(0.25)

    async def _restart(
        self, proc: ManagedProcess, precondition: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        while not self._stopping:
            delay = proc.backoff()
            await asyncio.sleep(delay)
            if precondition is not None:
                await precondition()
            if self._stopping:
                return
            proc.status.restarts += 1
            try:
                await proc.start()
                return
            except StartupError as exc:
                log.error("restart of %s failed (next try with backoff): %s", proc.name, exc)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        # Pool owner first: it unregisters from a master that is still there.
        await self.client.stop()
        await self.master.stop()
