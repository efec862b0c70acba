"""Where decisions meet pools: the actuator protocol and its virtual
implementation.

A shell observes the pools and applies a tick's effects. In the operator
that is ``operators/live.py``'s ``KubeActuator`` (EnginePools and their pods
in; ``/scale``, Events, recommendations and gauges out); ``VirtualActuator``
keeps pools in memory, with pods that take time to schedule, to become ready
and to drain, for the simulator and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .loop import Effects, PoolStatus
from .profiles import PoolRole


class Actuator(Protocol):
    async def observe(self) -> tuple[PoolStatus, ...]:
        """Every pool of the deployment as it is now."""
        ...

    async def apply(self, effects: Effects) -> None:
        """Carry out one tick's effects: scale (in order), events, status."""
        ...


@dataclass
class VirtualPod:
    created: float
    scheduled: float | None = None  # None: pending


@dataclass
class VirtualPool:
    role: PoolRole
    config: str
    gpus_per_replica: int
    spec: int
    ready: int = 0
    starting: list[VirtualPod] = field(default_factory=list)
    draining: list[float] = field(default_factory=list)  # times the pods are gone


class VirtualActuator:
    """Pools in memory. A new pod is pending for ``schedule_s`` (and for as
    long as the cluster has no free GPU for it, when ``cluster_gpus`` is
    set), then ready ``start_s`` after it is scheduled; a removed pod keeps its
    GPUs for ``drain_s``. Starting pods are removed before ready ones."""

    def __init__(
        self,
        pools: list[VirtualPool],
        clock: Callable[[], float],
        schedule_s: float = 5.0,
        start_s: float = 60.0,
        drain_s: float = 30.0,
        cluster_gpus: int | None = None,
    ) -> None:
        self.pools = {p.role: p for p in pools}
        self.clock = clock
        self.schedule_s, self.start_s, self.drain_s = schedule_s, start_s, drain_s
        self.cluster_gpus = cluster_gpus
        self.applied: list[Effects] = []
        for p in pools:
            p.ready = p.spec

    def held_gpus(self) -> int:
        """GPUs pods hold or wait for: ready, starting (pending too) and draining."""
        return sum(
            (p.ready + len(p.starting) + len(p.draining)) * p.gpus_per_replica
            for p in self.pools.values()
        )

    def _scheduled_gpus(self) -> int:
        return sum(
            (p.ready + len(p.draining) + sum(1 for pod in p.starting if pod.scheduled is not None))
            * p.gpus_per_replica
            for p in self.pools.values()
        )

    def advance(self, now: float) -> None:
        for p in self.pools.values():
            p.draining = [t for t in p.draining if t > now]
        for p in self.pools.values():
            for pod in p.starting:
                if (
                    pod.scheduled is None
                    and now >= pod.created + self.schedule_s
                    and (
                        self.cluster_gpus is None
                        or self._scheduled_gpus() + p.gpus_per_replica <= self.cluster_gpus
                    )
                ):
                    pod.scheduled = max(
                        pod.created + self.schedule_s, now if self.cluster_gpus is not None else 0.0
                    )
        for p in self.pools.values():
            ready = [
                pod
                for pod in p.starting
                if pod.scheduled is not None and now >= pod.scheduled + self.start_s
            ]
            p.ready += len(ready)
            p.starting = [pod for pod in p.starting if pod not in ready]

    def status(self) -> tuple[PoolStatus, ...]:
        return tuple(
            PoolStatus(
                role=p.role,
                config=p.config,
                spec_replicas=p.spec,
                pods=p.ready + len(p.starting) + len(p.draining),
                ready=p.ready,
                pending=sum(1 for pod in p.starting if pod.scheduled is None),
                gpus_per_replica=p.gpus_per_replica,
            )
            for p in self.pools.values()
        )

    def set_replicas(self, role: PoolRole, replicas: int, now: float) -> None:
        p = self.pools[role]
        p.spec = replicas
        while p.ready + len(p.starting) < replicas:
            p.starting.append(VirtualPod(created=now))
        while p.ready + len(p.starting) > replicas:
            if p.starting:
                pod = p.starting.pop()
                if pod.scheduled is not None:
                    p.draining.append(now + self.drain_s)
            else:
                p.ready -= 1
                p.draining.append(now + self.drain_s)

    async def observe(self) -> tuple[PoolStatus, ...]:
        self.advance(self.clock())
        return self.status()

    async def apply(self, effects: Effects) -> None:
        now = self.clock()
        for s in effects.scale:
            self.set_replicas(s.role, s.replicas, now)
        self.applied.append(effects)
