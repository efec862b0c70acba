"""Runs the controllers on the API server's own event loop.

They watch through the store's subscriptions (the queue a watch request
reads) and write through its create/replace/patch/delete, so every write has
a real resourceVersion and reaches every watcher; no HTTP in between. Each
controller has a work queue of keys (namespace, name): a watch event adds
the keys the controller says it wakes, a worker task reconciles them one at
a time, and a reconcile that asks to look again after a delay (or fails) is
queued again after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from devcluster.controllers.base import Controller, KindKey, ObjRef
from devcluster.controllers.daemonset import DaemonSetController
from devcluster.controllers.deployment import DeploymentController
from devcluster.controllers.endpointslice import EndpointSliceController
from devcluster.controllers.job import JobController
from devcluster.controllers.lws import LeaderWorkerSetController
from devcluster.controllers.node import ensure_node
from devcluster.controllers.replicaset import ReplicaSetController
from devcluster.controllers.scheduler import Scheduler
from devcluster.kinds import Kind
from devcluster.store import Store, Subscription

log = logging.getLogger("devcluster.controllers")

CONTROLLERS: tuple[type[Controller], ...] = (
    DeploymentController,
    ReplicaSetController,
    DaemonSetController,
    JobController,
    LeaderWorkerSetController,
    EndpointSliceController,
    Scheduler,
)
RETRY_S = 1.0


class _Queue:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.dirty: set[ObjRef] = set()
        self.wake = asyncio.Event()

    def add(self, key: ObjRef) -> None:
        self.dirty.add(key)
        self.wake.set()


class ControllerManager:
    """Starts the controllers on the running loop; `stop()` ends them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.queues = [_Queue(cls(store)) for cls in CONTROLLERS]
        self._tasks: list[asyncio.Task] = []
        self._subs: list[Subscription] = []
        # What reconciles raised (the newest 100), for tests to look at.
        self.errors: collections.deque[str] = collections.deque(maxlen=100)

    def start(self) -> None:
        ensure_node(self.store)
        kinds: set[KindKey] = {k for q in self.queues for k in q.controller.watches}
        for key in sorted(kinds):
            # A kind not served yet (a CRD installed later) is watched all the
            # same: the store publishes by kind key.
            sub = Subscription(self.store.kinds.get(key) or Kind(*key, kind=""))
            self.store.subscriptions.add(sub)
            self._subs.append(sub)
            self._tasks.append(asyncio.ensure_future(self._pump(key, sub)))
        for queue in self.queues:
            primary = queue.controller.primary
            if primary in self.store.kinds:
                for obj in self.store.list(self.store.kinds[primary], None):
                    queue.add((obj["metadata"].get("namespace", ""), obj["metadata"]["name"]))
            self._tasks.append(asyncio.ensure_future(self._work(queue)))

    def idle(self) -> bool:
        """No watch event waiting and no key to reconcile (timers aside): what
        was written has been acted on. Call on the server's loop."""
        return all(s.queue.empty() for s in self._subs) and not any(q.dirty for q in self.queues)

    async def stop(self) -> None:
        for sub in self._subs:
            self.store.subscriptions.discard(sub)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, key: KindKey, sub: Subscription) -> None:
        while True:
            event = await sub.queue.get()
            for queue in self.queues:
                if key in queue.controller.watches:
                    for ref in queue.controller.keys_for(key, event):
                        queue.add(ref)

    async def _work(self, queue: _Queue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await queue.wake.wait()
            queue.wake.clear()
            while queue.dirty:
                ref = queue.dirty.pop()
                try:
                    again = queue.controller.reconcile(*ref)
                except Exception as exc:  # noqa: BLE001  (a controller keeps going, as in Kubernetes)
                    log.exception("%s controller: reconciling %s/%s", queue.controller.name, *ref)
                    self.errors.append(f"{queue.controller.name} {ref[0]}/{ref[1]}: {exc!r}")
                    again = RETRY_S
                if again is not None:
                    loop.call_later(max(again, 0.05), queue.add, ref)
                # Let the HTTP side and the other controllers run between keys.
                await asyncio.sleep(0)
