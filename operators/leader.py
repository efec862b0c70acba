"""Leader election over a coordination.k8s.io/v1 Lease, as client-go's
leaderelection does it (kube-controller-manager, controller-runtime): one
operator replica holds the Lease and runs kopf; the others wait.

* **Acquire**: a replica takes the Lease when nobody holds it, when it was
  released (no holder), or when the holder has not renewed it for
  `lease_duration_s` — measured on the replica's own clock from the moment
  it last saw the Lease change (so clocks need not agree between nodes).
* **Renew**: the leader writes `renewTime` every `retry_s`. A leader that
  cannot renew for `renew_deadline_s` (< `lease_duration_s`) stops: it
  gives up before any standby may take over, so two never act at once.
* **Release**: on a clean stop (SIGTERM) the leader clears the holder, so a
  standby takes over at its next try instead of after a whole lease.

Every write is a PUT carrying the resourceVersion read: of two replicas
racing for the same Lease one gets 409 and tries again later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiException

from operators.kube import Kube

log = logging.getLogger(__name__)

LEASE_API = "coordination.k8s.io/v1"
# What a try may meet: an API error, or no API server at all.
ERRORS = (ApiException, aiohttp.ClientError, OSError, TimeoutError)


def micro_time(at: float) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One replica's side of the election for one Lease."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float,
        renew_deadline_s: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < retry_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "leader election needs retry < renew deadline < lease duration, got "
                f"{retry_s} / {renew_deadline_s} / {lease_duration_s}"
            )
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration_s, self.renew_deadline_s = lease_duration_s, renew_deadline_s
        self.retry_s = retry_s
        self.clock, self.wall = clock, wall
        # The Lease as last seen (its resourceVersion), and when, on our clock.
        self.observed_rv: str | None = None
        self.observed_at = 0.0
        self.last_renew = 0.0
        self.leader = False

    def _spec(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = micro_time(self.wall())
        before = previous or {}
        mine = before.get("holderIdentity") == self.identity
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
            "acquireTime": before.get("acquireTime", now) if mine else now,
            "renewTime": now,
            "leaseTransitions": before.get("leaseTransitions", 0) + (0 if mine else 1),
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease after it."""
        now = self.clock()
        lease = await self.kube.get(LEASE_API, "Lease", self.namespace, self.name)
        if lease is None:
            body = {
                "apiVersion": LEASE_API,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**self._spec(None), "leaseTransitions": 0},
            }
            try:
                created = await self.kube.create(body)
            except ApiException as exc:
                if exc.status == 409:  # another replica created it first
                    return False
                raise
            self._observe(created, now)
            return True
        rv = lease["metadata"]["resourceVersion"]
        if rv != self.observed_rv:
            self._observe(lease, now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and now < self.observed_at + duration:
            return False
        lease["spec"] = self._spec(spec)
        try:
            written = await self.kube.replace(lease)
        except ApiException as exc:
            if exc.status == 409:  # written meanwhile: look again next time
                return False
            raise
        self._observe(written, now)
        return True

    def _observe(self, lease: dict[str, Any], now: float) -> None:
        self.observed_rv = lease["metadata"]["resourceVersion"]
        self.observed_at = now

    async def acquire(self) -> None:
        """Until this replica leads."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self.leader, self.last_renew = True, self.clock()
                    return
            except ERRORS as exc:
                log.warning("lease %s/%s: %s; trying again", self.namespace, self.name, exc)
            await asyncio.sleep(self.retry_s)

    async def hold(self) -> None:
        """Renew every retry period; return when leadership is lost (another
        holder, or no renewal for the renew deadline)."""
        while True:
            await asyncio.sleep(self.retry_s)
            try:
                if await self.try_acquire_or_renew():
                    self.last_renew = self.clock()
                    continue
                log.error("lease %s/%s: held by another replica now", self.namespace, self.name)
                self.leader = False
                return
            except ERRORS as exc:
                log.warning("lease %s/%s: renewal failed: %s", self.namespace, self.name, exc)
            if self.clock() - self.last_renew >= self.renew_deadline_s:
                log.error(
                    "lease %s/%s: not renewed for %.1fs (renew deadline)",
                    self.namespace,
                    self.name,
                    self.clock() - self.last_renew,
                )
                self.leader = False
                return

    async def release(self) -> None:
        """Clear the holder (only if it is still this replica)."""
        self.leader = False
        try:
            lease = await self.kube.get(LEASE_API, "Lease", self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = lease["spec"]
            lease["spec"] = {
                "leaseDurationSeconds": 1,
                "leaseTransitions": spec.get("leaseTransitions", 0),
                "renewTime": micro_time(self.wall()),
                "acquireTime": spec.get("acquireTime", micro_time(self.wall())),
            }
            await self.kube.replace(lease)
            log.info("lease %s/%s released", self.namespace, self.name)
        except ERRORS as exc:
            log.warning(
                "lease %s/%s not released (%s): a standby takes over when it expires",
                self.namespace,
                self.name,
                exc,
            )
