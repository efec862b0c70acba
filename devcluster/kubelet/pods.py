"""One pod on the node: its network namespace and volumes, its init containers
in order, then its containers; its status (phase, conditions,
containerStatuses) written as it changes; on deletion, its containers stopped
within the grace period and the object deleted (grace 0)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devcluster.kubelet import podspec
from devcluster.kubelet.containers import Container, now
from devcluster.kubelet.podspec import PodSpecError

if TYPE_CHECKING:
    from devcluster.kubelet.kubelet import Kubelet

log = logging.getLogger("devcluster.kubelet")


class PodWorker:
    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.key = f"{self.namespace}/{self.name}"
        self.root = kubelet.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.log_root = kubelet.log_dir / f"{self.namespace}_{self.name}"
        self.netns = ""
        self.ip = ""
        self.deleting = False
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        self.init_containers: list[Container] = []
        self.containers: list[Container] = []
        self.initialized = False
        self.volumes: dict[str, Path] = {}
        self._wake = asyncio.Event()
        self._dirty = asyncio.Event()
        self._transitions: dict[str, tuple[str, str]] = {}
        self._task: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._live_task: asyncio.Task | None = None
        self.start_time = now()

    # ---- from the kubelet ----------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pod {self.key}")
        self._writer = asyncio.create_task(self._write_status(), name=f"status {self.key}")

    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp") and not self.deleting:
            self.deleting = True
            self._wake.set()

    def grace_period(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        return float(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)

    def notify(self) -> None:
        self._dirty.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early when the pod is being deleted."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    # ---- the pod's life ------------------------------------------------------

    async def _run(self) -> None:
        try:
            live = self._live_task = asyncio.create_task(self._live())
            await self._wake.wait()  # deleted (done or failed pods stay until then)
            await self._terminate(self.grace_period(), pre_stop=True)
            # Its containers see `deleting` and stop restarting; one started
            # meanwhile is stopped at once.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(live, 10)
            await self._terminate(0, pre_stop=False)
            self.kubelet.network.remove_pod(self.key)
            self.kubelet.pod_gone(self)
            await self.kubelet.api.request(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            log.info("pod %s: stopped and deleted", self.key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s: the kubelet failed", self.key)
            raise
        finally:
            self._cleanup()

    async def _live(self) -> None:
        spec = self.pod["spec"]
        hostname = spec.get("hostname") or self.name
        self.netns, self.ip = self.kubelet.network.add_pod(self.key, hostname, self.namespace)
        self.notify()
        shutil.rmtree(self.log_root, ignore_errors=True)  # a new pod of an old name
        self.kubelet.sync_dns()
        while not self.deleting:
            try:
                self.volumes = await podspec.materialize_volumes(
                    self.pod,
                    self.root,
                    self.kubelet.state_dir / "claims",
                    self.kubelet.lookup(self),
                )
                break
            except PodSpecError as exc:
                log.info("pod %s: %s", self.key, exc.message)
                await self.sleep(2)
        self.init_containers = [
            Container(c, self, self.log_root / c["name"], self._prepare, init=True)
            for c in spec.get("initContainers", [])
        ]
        self.containers = [
            Container(c, self, self.log_root / c["name"], self._prepare)
            for c in spec.get("containers", [])
        ]
        for container in self.init_containers:
            if self.deleting:
                return
            await container.run()
            if container.exit_code != 0:
                self.notify()
                return  # failed for good (restartPolicy Never): the pod fails
        self.initialized = True
        self.notify()
        runs = [asyncio.create_task(c.run()) for c in self.containers]
        try:
            await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
        self.notify()

    async def _prepare(self, container: dict) -> tuple[list[str], dict[str, str], list[dict]]:
        """A container's argv, environment and bind mounts, read afresh on each
        start (a changed ConfigMap or Secret shows on the next restart)."""
        pod = {**self.pod, "status": {**self.pod.get("status", {}), **self._pod_ips()}}
        env = self.kubelet.base_env(self, container)
        env.update(await podspec.environment(pod, container, self.kubelet.lookup(self)))
        argv = podspec.argv_of(container, env)
        mounts = podspec.mounts_of(container, self.volumes)
        if self.pod["spec"].get("automountServiceAccountToken", True):
            sa_dir = self.kubelet.service_account_dir(self)
            if not any(m["target"] == podspec.SERVICE_ACCOUNT_DIR for m in mounts):
                mounts.append(
                    {"source": str(sa_dir), "target": podspec.SERVICE_ACCOUNT_DIR, "readOnly": True}
                )
        if path := container.get("terminationMessagePath"):
            # A fresh file per start, read when the container ends (containers.py).
            message = self.termination_file(container["name"])
            message.parent.mkdir(parents=True, exist_ok=True)
            message.write_bytes(b"")
            message.chmod(0o666)
            mounts.append({"source": str(message), "target": path, "readOnly": False})
        for mount in mounts:
            self.kubelet.mount_point(Path(mount["target"]), Path(mount["source"]).is_dir())
        return argv, env, mounts

    def termination_file(self, container: str) -> Path:
        """Where a container's `terminationMessagePath` is, on the host."""
        return self.root / "termination" / container

    async def _terminate(self, grace: float, pre_stop: bool) -> None:
        await asyncio.gather(
            *(c.stop(grace, pre_stop) for c in self.init_containers + self.containers)
        )

    async def stop_now(self, grace: float) -> None:
        """The kubelet stops: SIGTERM, SIGKILL after `grace`, no preStop; the
        object stays (the API server goes too)."""
        self.deleting = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
        await self._terminate(grace, pre_stop=False)
        self.kubelet.network.remove_pod(self.key)

    def _cleanup(self) -> None:
        for task in (self._writer, self._live_task):
            if task is not None:
                task.cancel()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- status --------------------------------------------------------------

    def _pod_ips(self) -> dict[str, Any]:
        if not self.ip:
            return {}
        return {
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.kubelet.network.gateway,
            "hostIPs": [{"ip": self.kubelet.network.gateway}],
        }

    def phase(self) -> str:
        if not self.initialized:
            failed = any(c.exit_code not in (None, 0) for c in self.init_containers)
            return "Failed" if failed else "Pending"
        codes = [c.exit_code for c in self.containers]
        if all(code is not None for code in codes) and all(
            c.done.is_set() for c in self.containers
        ):
            return "Succeeded" if all(code == 0 for code in codes) else "Failed"
        if any("running" in c.state or c.restart_count for c in self.containers):
            return "Running"
        return "Pending"

    def _condition(self, kind: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        if self._transitions.get(kind, ("", ""))[0] != status:
            self._transitions[kind] = (status, now())
        return {"type": kind, "status": status, "lastTransitionTime": self._transitions[kind][1]}

    def status(self) -> dict:
        ready = bool(self.containers) and self.initialized and all(c.ready for c in self.containers)
        phase = self.phase()
        if phase != "Running":
            ready = False
        status: dict[str, Any] = {
            "phase": phase,
            "startTime": self.start_time,
            **self._pod_ips(),
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", self.initialized),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
            ],
            "containerStatuses": [c.status() for c in self.containers]
            or [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "PodInitializing"}},
                }
                for c in self.pod["spec"].get("containers", [])
            ],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        return status

    async def _write_status(self) -> None:
        written: dict | None = None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            status = self.status()
            if status != written:
                await self.kubelet.api.patch_status(self.namespace, self.name, status)
                written = status
                self.kubelet.sync_dns()
            await asyncio.sleep(0.05)  # coalesce bursts
