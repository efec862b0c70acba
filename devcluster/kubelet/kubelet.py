"""The process kubelet: runs the pods bound to the node as local processes, each
pod in a network namespace of its own (network.py), and serves Services on
ClusterIPs and loopback ports (services.py).

It talks to the API server over HTTP like a real kubelet (client.py): a watch
of the pods with `spec.nodeName` = its node, of Services and EndpointSlices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from devcluster.kubelet import podspec
from devcluster.kubelet.client import Api, Informer
from devcluster.kubelet.network import Network
from devcluster.kubelet.pods import PodWorker
from devcluster.kubelet.proxy import Forwarder, make_certificates, server_context
from devcluster.kubelet.services import Services

log = logging.getLogger("devcluster.kubelet")

NODE_NAME = "devcluster-node"
API_PORT = 443
# The label of the operator's engine pods (common/kube.py), which get the CPU
# settings the embedded stack uses (`engine_env`) under their own env.
ENGINE_LABEL = ("app.kubernetes.io/component", "engine")
STOP_GRACE_S = 5.0


class Kubelet:
    def __init__(
        self,
        api_url: str,
        state_dir: Path,
        *,
        pod_cidr: str = "10.250.0.0/16",
        bridge: str = "tandem0",
        engine_env: dict[str, str] | None = None,
        node: str = NODE_NAME,
    ) -> None:
        self.api_url = api_url
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.network = Network(pod_cidr, bridge)
        self.engine_env = dict(engine_env or {})
        self.node = node
        self.services = Services(self.network, state_dir / "services.json")
        self.workers: dict[str, PodWorker] = {}
        self._created: list[Path] = []  # mount points made on the host, removed at stop
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._api_front: Forwarder | None = None
        self.api: Api
        self.pods: Informer
        self.service_objects: Informer
        self.slices: Informer
        self.ingresses: Informer

    # ---- start and stop ------------------------------------------------------

    async def start(self) -> None:
        self.network.up()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            ca, cert, key = make_certificates(self.state_dir / "pki", self.network.gateway)
            # A new CA each start: service-account files of an earlier run are stale.
            shutil.rmtree(self.state_dir / "serviceaccount", ignore_errors=True)
            self.ca = ca
            api = urlsplit(self.api_url)
            target = [(api.hostname or "127.0.0.1", api.port or 80)]
            self._api_front = Forwarder(lambda: target)
            await self._api_front.listen(self.network.gateway, API_PORT, server_context(cert, key))
            self.api = Api(self.api_url)
            self.pods = Informer(
                self.api, "/api/v1/pods", self._changed, f"spec.nodeName={self.node}"
            )
            self.service_objects = Informer(self.api, "/api/v1/services", self._changed)
            self.slices = Informer(
                self.api, "/apis/discovery.k8s.io/v1/endpointslices", self._changed
            )
            self.ingresses = Informer(
                self.api, "/apis/networking.k8s.io/v1/ingresses", self._changed
            )
            for informer in (self.pods, self.service_objects, self.slices, self.ingresses):
                informer.start()
            self._tasks.append(asyncio.create_task(self._sync_loop(), name="kubelet sync"))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every pod's processes (SIGTERM, SIGKILL after a few seconds),
        the proxies, and take the network down."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for informer in (
            getattr(self, n, None) for n in ("pods", "service_objects", "slices", "ingresses")
        ):
            if informer is not None:
                await informer.stop()
        await asyncio.gather(*(w.stop_now(STOP_GRACE_S) for w in list(self.workers.values())))
        self.workers.clear()
        await self.services.close()
        if self._api_front is not None:
            await self._api_front.close()
        self.network.down()
        for path in reversed(self._created):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        if hasattr(self, "api"):
            await self.api.close()

    # ---- the loop ------------------------------------------------------------

    def _changed(self) -> None:
        self._kick.set()

    async def _sync_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self._sync()
            except Exception:
                log.exception("kubelet: sync failed")
            await asyncio.sleep(0.05)

    async def _sync(self) -> None:
        current = {p["metadata"]["uid"]: p for p in self.pods.items.values()}
        for uid, pod in current.items():
            worker = self.workers.get(uid)
            if worker is not None:
                worker.update(pod)
            elif pod["metadata"].get("deletionTimestamp"):
                meta = pod["metadata"]
                await self.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
            else:
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
        for uid in [u for u in self.workers if u not in current]:
            # Deleted with grace 0 by someone else: stop what still runs.
            worker = self.workers.pop(uid)
            asyncio.create_task(worker.stop_now(worker.grace_period()))
        await self.services.sync(
            self.service_objects.items, self.slices.items, self.ingresses.items
        )
        self.sync_dns()

    def pod_gone(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        self.sync_dns()

    def sync_dns(self) -> None:
        pods = list(self.pods.items.values())
        for worker in list(self.workers.values()):
            if not worker.ip:
                continue
            spec = worker.pod["spec"]
            own = [spec.get("hostname") or worker.name]
            if spec.get("subdomain"):
                own.insert(
                    0,
                    f"{own[0]}.{spec['subdomain']}.{worker.namespace}.svc.cluster.local",
                )
            text = self.services.hosts(
                worker.namespace, (worker.ip, " ".join(own)), self.service_objects.items, pods
            )
            self.network.write_hosts(worker.key, text)

    # ---- what pods get -------------------------------------------------------

    def base_env(self, worker: PodWorker, container: dict) -> dict[str, str]:
        """The environment under a container's own: PATH with the venv first,
        the in-cluster API address, the image's ENV, engines' CPU settings."""
        gateway = self.network.gateway
        env = {
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": "/root",
            "HOSTNAME": worker.pod["spec"].get("hostname") or worker.name,
            "KUBERNETES_SERVICE_HOST": gateway,
            "KUBERNETES_SERVICE_PORT": str(API_PORT),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(API_PORT),
            "KUBERNETES_PORT": f"tcp://{gateway}:{API_PORT}",
        }
        env.update(podspec.image_env(container.get("image", "")))
        labels = worker.pod["metadata"].get("labels") or {}
        if labels.get(ENGINE_LABEL[0]) == ENGINE_LABEL[1]:
            env.update(self.engine_env)
        return env

    def lookup(self, worker: PodWorker) -> podspec.Lookup:
        async def get(plural: str, name: str) -> dict | None:
            return await self.api.get(f"/api/v1/namespaces/{worker.namespace}/{plural}/{name}")

        return get

    def service_account_dir(self, worker: PodWorker) -> Path:
        """token, ca.crt and namespace, as a service account's projected volume."""
        folder = self.state_dir / "serviceaccount" / worker.namespace
        if not (folder / "namespace").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            # The API server checks no credentials; clients need a token to send.
            (folder / "token").write_text("devcluster")
            (folder / "ca.crt").write_bytes(self.ca.read_bytes())
            (folder / "namespace").write_text(worker.namespace)
        return folder

    def mount_point(self, target: Path, directory: bool) -> None:
        """Make a missing mount point on the host (recorded, removed at stop)."""
        if target.exists():
            return
        missing = [target]
        while not missing[-1].parent.exists():
            missing.append(missing[-1].parent)
        for path in reversed(missing[1:]):
            path.mkdir()
            self._created.append(path)
        if directory:
            target.mkdir()
        else:
            target.touch()
        self._created.append(target)

    def loopback(self, namespace: str, service: str, port: Any) -> int:
        return self.services.loopback(namespace, service, port)
