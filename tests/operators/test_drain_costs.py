"""Deletion costs from what the router really exports (its RoutingMetrics, rendered
by prometheus_client as a router's /metrics would be)."""

from __future__ import annotations

from prometheus_client import generate_latest

from operators.drain import deletion_costs, parse_loads
from services.router.routing.metrics import RoutingMetrics


def router_metrics(in_flight: dict[str, int], live_blocks: dict[str, int]) -> str:
    m = RoutingMetrics()
    for pod, n in in_flight.items():
        m.pod_in_flight.labels(pod).set(n)
    for pod, n in live_blocks.items():
        m.pod_live_blocks.labels(pod).set(n)
    return generate_latest(m.registry).decode()


def test_the_pod_with_fewest_requests_then_least_session_kv_is_cheapest():
    # Two router replicas: in-flight is shared (both report all), live blocks per replica.
    a = parse_loads(router_metrics({"10.0.0.1:50061": 3, "10.0.0.2:50061": 0,
                                    "10.0.0.3:50061": 0},
                                   {"10.0.0.2:50061": 40, "10.0.0.3:50061": 5}))
    b = parse_loads(router_metrics({"10.0.0.1:50061": 3, "10.0.0.2:50061": 0,
                                    "10.0.0.3:50061": 0},
                                   {"10.0.0.3:50061": 10}))
    pods = {"decode-a": "10.0.0.1:50061", "decode-b": "10.0.0.2:50061",
            "decode-c": "10.0.0.3:50061", "decode-new": "10.0.0.4:50061"}
    costs = deletion_costs(pods, [a, b])
    assert costs == {"decode-a": 300_000, "decode-b": 40, "decode-c": 15, "decode-new": 0}
    assert sorted(costs, key=costs.get) == ["decode-new", "decode-c", "decode-b", "decode-a"]


def test_costs_fit_the_annotation_and_no_router_means_zero():
    huge = parse_loads(router_metrics({"p:1": 10**6}, {}))
    assert deletion_costs({"x": "p:1"}, [huge]) == {"x": 2**31 - 1}
    assert deletion_costs({"x": "p:1"}, []) == {"x": 0}
