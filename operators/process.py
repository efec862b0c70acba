"""One operator process: stand by until it leads (operators/leader.py), then
run kopf with every handler and loop (operators/handlers.py) for as long as
it holds the Lease.

* A standby watches nothing and writes nothing but its Lease attempts; its
  /healthz answers (it is alive) and `tandem_operator_leader` is 0.
* SIGTERM while leading: kopf stops (its cleanup stops the loops), then the
  Lease is released, so a standby takes over at its next try.
* Leadership lost (the Lease not renewed within the renew deadline, or taken
  by another replica): kopf is stopped and the process exits with status 1;
  Kubernetes restarts it, as a standby. A leader that cannot reach the API
  server cannot write either, so stopping costs nothing, and a fresh process
  carries no state from the time it led.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from typing import Any

from aiohttp import web

from operators import metrics
from operators.kube import Kube
from operators.leader import LeaderElector
from operators.planner.simulate import Simulator
from operators.settings import OperatorSettings

log = logging.getLogger(__name__)


def identity() -> str:
    """This process among the replicas: the pod's name (or the host's) and a
    random suffix, so a restarted container never mistakes its predecessor's
    Lease for its own."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


async def _standby_health(port: int) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def _stand_by(elector: LeaderElector, health_port: int) -> bool:
    """Until this process leads (True) or is told to stop (False)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    health = await _standby_health(health_port)
    acquire = asyncio.create_task(elector.acquire(), name="tandem-lease-acquire")
    stop = asyncio.create_task(stopping.wait(), name="tandem-standby-stop")
    try:
        await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (acquire, stop):
            task.cancel()
        await asyncio.gather(acquire, stop, return_exceptions=True)
        await health.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return elector.leader


async def run(settings: OperatorSettings, simulator: Simulator | None = None) -> int:
    import kopf

    from operators.handlers import register

    operator: dict[str, Any] = dict(
        registry=register(settings, simulator),
        standalone=True,  # the Lease, not kopf's peering, decides who acts
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz",
    )
    if not settings.leader_election:
        await kopf.operator(**operator)
        return 0
    kube = await Kube.connect(settings.kubeconfig)
    elector = LeaderElector(
        kube,
        settings.lease_namespace,
        settings.lease_name,
        identity(),
        settings.lease_duration_seconds,
        settings.lease_renew_deadline_seconds,
        settings.lease_retry_seconds,
    )
    metrics.LEADER.set(0)
    log.info(
        "standing by for Lease %s/%s as %s",
        settings.lease_namespace,
        settings.lease_name,
        elector.identity,
    )
    try:
        waited = time.monotonic()
        if not await _stand_by(elector, settings.health_port):
            log.info("stopped while standing by")
            return 0
        log.info(
            "leading: Lease %s/%s acquired as %s after %.2fs standing by",
            settings.lease_namespace,
            settings.lease_name,
            elector.identity,
            time.monotonic() - waited,
        )
        metrics.LEADER.set(1)
        metrics.LEADER_TRANSITIONS.inc()
        running = asyncio.create_task(kopf.operator(**operator))
        holding = asyncio.create_task(elector.hold(), name="tandem-lease-renew")
        await asyncio.wait({running, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done() and not running.done():
            metrics.LEADER.set(0)
            log.error("leadership lost: stopping the operator; it restarts as a standby")
            # As a SIGTERM stops it: kopf's stop flag leaves a waiter task that
            # holds every stop for 5 s when a signal came first.
            signal.raise_signal(signal.SIGTERM)
            await asyncio.gather(running, return_exceptions=True)
            return 1
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        await elector.release()
        metrics.LEADER.set(0)
        running.result()  # kopf's own failure, if it failed
        return 0
    finally:
        await kube.close()
