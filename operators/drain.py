"""Drain before delete: which engine pods a scale-down should remove.

Before lowering a pool's replicas the operator sets
`controller.kubernetes.io/pod-deletion-cost` on each of its pods, so the
ReplicaSet controller removes the cheapest: the fewest requests in flight as
the routers report them (`tandem_router_pod_in_flight`, each router its own,
so summed), then the least session KV (`tandem_routing_pod_live_blocks`: the
KV blocks live sessions need on the pod, per router, so summed). Pods no
router knows cost nothing (they serve nothing yet). `deletion_costs` is pure; `router_loads`
reads every router pod's /metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

IN_FLIGHT_METRIC = "tandem_router_pod_in_flight"
LIVE_BLOCKS_METRIC = "tandem_routing_pod_live_blocks"
# Kubernetes takes the annotation as an int32.
MAX_COST = 2**31 - 1


def parse_loads(metrics_text: str) -> dict[str, tuple[float, float]]:
    """pod address → (in flight, live session blocks) from one router's /metrics."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            pod = sample.labels.get("pod")
            if pod is None:
                continue
            if sample.name == IN_FLIGHT_METRIC:
                out[pod][0] += sample.value
            elif sample.name == LIVE_BLOCKS_METRIC:
                out[pod][1] += sample.value
    return {pod: (v[0], v[1]) for pod, v in out.items()}


def deletion_costs(
    pods: dict[str, str], loads: list[dict[str, tuple[float, float]]]
) -> dict[str, int]:
    """Pod name → deletion cost, from each pod's gRPC address and every router's loads."""
    out = {}
    for name, address in pods.items():
        in_flight = sum(load.get(address, (0.0, 0.0))[0] for load in loads)
        blocks = sum(load.get(address, (0.0, 0.0))[1] for load in loads)
        out[name] = min(MAX_COST, int(in_flight) * 100_000 + int(blocks))
    return out


async def router_loads(
    urls: list[str], timeout: float = 2.0
) -> list[dict[str, tuple[float, float]]]:
    """Each reachable router's loads; a router that does not answer is left out."""
    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(url: str) -> dict[str, tuple[float, float]] | None:
            try:
                response = await http.get(url)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("router %s did not report its loads: %s", url, exc)
                return None
            return parse_loads(response.text)

        found = await asyncio.gather(*(one(u) for u in urls))
    return [f for f in found if f is not None]
