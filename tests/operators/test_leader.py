"""Leader election (operators/leader.py) over a real Lease in the fake API
server (devcluster/, real HTTP, resourceVersion conflicts as Kubernetes
answers them). Each replica's clock is a number the test moves: expiry is
judged on the standby's own clock, from when it last saw the Lease change."""

from __future__ import annotations

import asyncio

import pytest

from operators.kube import Kube
from operators.leader import LeaderElector

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(kube: Kube, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(
        kube,
        "default",
        "tandem-operator",
        identity,
        lease_duration_s=15.0,
        renew_deadline_s=10.0,
        retry_s=0.05,
        clock=clock,
    )


def lease(kube_api) -> dict:
    return kube_api.get("coordination.k8s.io", "v1", "leases", "default", "tandem-operator")["spec"]


async def test_one_leads_a_standby_takes_over_when_the_lease_expires_or_is_released(kube_api):
    kube = await Kube.connect(str(kube_api.kubeconfig))
    a_clock, b_clock = Clock(), Clock()
    b_clock.now = -50_000.0  # another node's clock: only its own intervals count
    a, b = elector(kube, "a", a_clock), elector(kube, "b", b_clock)
    try:
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()  # b sees a's Lease for the first time
        assert lease(kube_api)["holderIdentity"] == "a"

        # a renews: each renewal is a change b sees, so b's wait starts again.
        a_clock.now += 5
        assert await a.try_acquire_or_renew()
        b_clock.now += 14
        assert not await b.try_acquire_or_renew()
        b_clock.now += 14  # 14 s after it saw the renewal: not yet expired
        assert not await b.try_acquire_or_renew()

        # a dies (no more renewals): b takes over one lease duration after it last saw a change.
        b_clock.now += 1.5
        assert await b.try_acquire_or_renew()
        spec = lease(kube_api)
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
        assert not await a.try_acquire_or_renew()  # a, back, sees b's fresh Lease

        # b steps down: a takes it at its next try, without waiting for expiry.
        await b.release()
        assert "holderIdentity" not in lease(kube_api)
        assert await a.try_acquire_or_renew()
        assert lease(kube_api)["leaseTransitions"] == 2
    finally:
        await kube.close()


async def test_two_racing_for_a_free_lease_get_one_leader(kube_api):
    kube = await Kube.connect(str(kube_api.kubeconfig))
    try:
        replicas = [elector(kube, f"r{i}", Clock()) for i in range(4)]
        won = await asyncio.gather(*(r.try_acquire_or_renew() for r in replicas))
        assert sum(won) == 1
        assert lease(kube_api)["holderIdentity"] == f"r{won.index(True)}"
    finally:
        await kube.close()


async def test_a_leader_that_cannot_renew_gives_up_before_the_lease_expires(kube_api):
    kube = await Kube.connect(str(kube_api.kubeconfig))
    clock = Clock()
    a = elector(kube, "a", clock)
    try:
        await a.acquire()
        holding = asyncio.create_task(a.hold())
        await asyncio.sleep(0.2)
        assert not holding.done()
        kube_api.stop()  # the API server is gone: renewals fail
        await asyncio.sleep(0.3)
        assert not holding.done()  # within the renew deadline it keeps leading
        clock.now += 10.5
        await asyncio.wait_for(holding, 5)
        assert not a.leader
    finally:
        await kube.close()


def test_the_timings_must_nest():
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        LeaderElector(None, "ns", "x", "a", 10, 10, 2)  # type: ignore[arg-type]
