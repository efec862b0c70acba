"""One container as a local process: start it in its pod's namespaces, probe it,
restart it per restartPolicy with back-off, stop it (preStop, SIGTERM to its
process group, SIGKILL after the grace period), and its status as the kubelet
reports it."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from devcluster.kubelet import probes
from devcluster.kubelet.podspec import PodSpecError

log = logging.getLogger("devcluster.kubelet")

PODEXEC = Path(__file__).with_name("podexec.py")
# Restart back-off: Kubernetes' doubling (from 1 s here, not 10 s, so a test
# sees a restart), capped, and reset after a container ran this long.
BACKOFF_START_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 1.0, 30.0, 60.0
# The kubelet's limits on a termination message: the file's first 4 KiB; from
# the log, its last 80 lines and at most 2 KiB of them.
MESSAGE_BYTES, LOG_MESSAGE_LINES, LOG_MESSAGE_BYTES = 4096, 80, 2048


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Container:
    """A container's processes over its restarts, and its status."""

    def __init__(
        self,
        spec: dict,
        pod: Any,  # the PodWorker: netns, ip, deleting, notify, policy
        log_dir: Path,
        prepare: Callable[[dict], Awaitable[tuple[list[str], dict[str, str], list[dict]]]],
        init: bool = False,
    ) -> None:
        self.spec = spec
        self.name = spec["name"]
        self.pod = pod
        self.log_dir = log_dir
        self.prepare = prepare
        self.init = init
        self.proc: asyncio.subprocess.Process | None = None
        self.env: dict[str, str] = {}
        self.restart_count = 0
        self.ready = False
        self.started = False
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.exit_code: int | None = None  # of the last run, once it will not restart
        self.done = asyncio.Event()  # no more runs (exited for good, or stopped)
        self._killed_by_probe = False

    # ---- status ------------------------------------------------------------

    def status(self) -> dict:
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"devcluster://{self.proc.pid}" if self.proc else "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }

    def _set(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
        self.pod.notify()

    # ---- running -----------------------------------------------------------

    async def run(self) -> None:
        """Run until it exits for good (per restartPolicy) or the pod goes."""
        backoff = BACKOFF_START_S
        try:
            while not self.pod.deleting:
                try:
                    argv, env, mounts = await self.prepare(self.spec)
                except PodSpecError as exc:
                    self._set(state={"waiting": {"reason": exc.reason, "message": exc.message}})
                    await self.pod.sleep(2)
                    continue
                started = asyncio.get_running_loop().time()
                code = await self._run_once(argv, env, mounts)
                if self.pod.deleting:
                    return
                policy = self.pod.restart_policy
                if self.init and policy == "Always":
                    policy = "OnFailure"  # init containers re-run only when they fail
                if policy == "Never" or (policy == "OnFailure" and code == 0):
                    self.exit_code = code
                    return
                if asyncio.get_running_loop().time() - started > BACKOFF_RESET_S:
                    backoff = BACKOFF_START_S
                # `kubectl logs --previous` reads the run that ended.
                (self.log_dir / "current.log").replace(self.log_dir / "previous.log")
                self._set(
                    restart_count=self.restart_count + 1,
                    last_state=self.state,
                    state={
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": f"back-off {backoff:.0f}s restarting failed container",
                        }
                    },
                )
                await self.pod.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            self.done.set()

    async def _run_once(self, argv: list[str], env: dict[str, str], mounts: list[dict]) -> int:
        self.env = env
        self.log_dir.mkdir(parents=True, exist_ok=True)
        current = self.log_dir / "current.log"
        spec_file = self.pod.root / "run" / f"{self.name}.json"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.touch(0o600)
        spec_file.write_text(
            json.dumps(
                {
                    "argv": argv,
                    "env": env,
                    "mounts": mounts,
                    "workingDir": self.spec.get("workingDir"),
                    "hostname": env["HOSTNAME"],
                }
            )
        )
        with current.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                self.pod.netns,
                sys.executable,
                str(PODEXEC),
                str(spec_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # a process group of its own: stopped whole
            )
        started_at = now()
        self._killed_by_probe = False
        self._set(state={"running": {"startedAt": started_at}}, ready=False, started=False)
        probing = asyncio.create_task(self._probe())
        code = await self.proc.wait()
        kill_group(self.proc.pid, signal.SIGKILL)  # what it left in its group
        probing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probing
        reason = "Completed" if code == 0 else "Error"
        if self._killed_by_probe:
            reason = "Error"
        terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": reason,
            "startedAt": started_at,
            "finishedAt": now(),
        }
        if message := self._termination_message(code):
            terminated["message"] = message
        self._set(ready=False, started=False, state={"terminated": terminated})
        return code

    def _termination_message(self, code: int) -> str:
        """What the container wrote at its `terminationMessagePath` (the first
        4096 bytes, as the kubelet keeps); with `FallbackToLogsOnError`, the
        end of its log when it failed and wrote nothing there."""
        if not self.spec.get("terminationMessagePath"):
            return ""
        path = self.pod.termination_file(self.name)
        message = path.read_bytes()[:MESSAGE_BYTES] if path.exists() else b""
        if (
            not message
            and code != 0
            and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            log_file = self.log_dir / "current.log"
            lines = log_file.read_bytes().splitlines()[-LOG_MESSAGE_LINES:]
            message = b"\n".join(lines)[-LOG_MESSAGE_BYTES:]
        return message.decode(errors="replace")

    # ---- probes ------------------------------------------------------------

    async def _probe(self) -> None:
        startup = self.spec.get("startupProbe")
        if startup and not await self._probe_loop(startup, until_success=True):
            log.info("%s/%s: startup probe failed; killing it", self.pod.key, self.name)
            await self._kill_for_probe()
            return
        self._set(started=True)
        if self.init:
            return
        tasks = [asyncio.create_task(self._readiness())]
        if liveness := self.spec.get("livenessProbe"):
            tasks.append(asyncio.create_task(self._probe_loop(liveness, until_success=False)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[-1] in done and len(tasks) > 1:  # liveness gave up
                log.info("%s/%s: liveness probe failed; restarting", self.pod.key, self.name)
                self._set(ready=False)
                await self._kill_for_probe()
        finally:
            for task in tasks:
                task.cancel()

    async def _readiness(self) -> None:
        probe = self.spec.get("readinessProbe")
        if probe is None:
            self._set(ready=True)
            await asyncio.Event().wait()
        assert probe is not None
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        successes = failures = 0
        while True:
            if await self._check(probe):
                successes, failures = successes + 1, 0
                if successes >= probe.get("successThreshold", 1) and not self.ready:
                    self._set(ready=True)
            else:
                successes, failures = 0, failures + 1
                if failures >= probe.get("failureThreshold", 3) and self.ready:
                    self._set(ready=False)
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _probe_loop(self, probe: dict, until_success: bool) -> bool:
        """Startup (until_success): True once it passes, False after
        failureThreshold failures. Liveness: returns (False) after
        failureThreshold failures in a row."""
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        failures = 0
        while True:
            if await self._check(probe):
                if until_success:
                    return True
                failures = 0
            else:
                failures += 1
                if failures >= probe.get("failureThreshold", 3):
                    return False
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _check(self, probe: dict) -> bool:
        assert self.proc is not None
        timeout = float(probe.get("timeoutSeconds", 1))
        return await probes.check(probe, self.spec, self.pod.ip, self.proc.pid, self.env, timeout)

    async def _kill_for_probe(self) -> None:
        self._killed_by_probe = True
        await self.stop(self.pod.grace_period(), pre_stop=True)

    # ---- stopping ------------------------------------------------------------

    async def stop(self, grace: float, pre_stop: bool) -> None:
        """preStop (within the grace period), SIGTERM to the process group,
        SIGKILL once the grace period is over."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop and hook:
            with contextlib.suppress(TimeoutError, ValueError):
                await asyncio.wait_for(
                    probes.check(hook, self.spec, self.pod.ip, proc.pid, self.env, grace),
                    max(0.0, grace),
                )
        kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            kill_group(proc.pid, signal.SIGKILL)
            await proc.wait()
