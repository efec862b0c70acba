"""Deletion costs from router /metrics text in the router's exposition (the metric
names and labels services/router/metrics.py exports, rendered by prometheus_client)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from operators.drain import (
    IN_FLIGHT_METRIC,
    LIVE_BLOCKS_METRIC,
    deletion_costs,
    parse_loads,
)

ROUTER_METRICS = Path(__file__).resolve().parents[2] / "services" / "router" / "metrics.py"


class RouterPods:
    def __init__(self, in_flight: dict[str, int], live_blocks: dict[str, int]) -> None:
        self.in_flight, self.live_blocks = in_flight, live_blocks

    def collect(self):
        flight = GaugeMetricFamily(IN_FLIGHT_METRIC, "in flight", labels=["pod", "role"])
        live = GaugeMetricFamily(LIVE_BLOCKS_METRIC, "live blocks", labels=["pod"])
        for pod, n in self.in_flight.items():
            flight.add_metric([pod, "decode"], n)
        for pod, n in self.live_blocks.items():
            live.add_metric([pod], n)
        yield from (flight, live)


def router_metrics(in_flight: dict[str, int], live_blocks: dict[str, int]) -> str:
    registry = CollectorRegistry()
    registry.register(RouterPods(in_flight, live_blocks))
    return generate_latest(registry).decode()


def test_the_router_still_exports_the_metrics_the_costs_read():
    source = ROUTER_METRICS.read_text()
    assert f'"{IN_FLIGHT_METRIC}"' in source and f'"{LIVE_BLOCKS_METRIC}"' in source


def test_the_pod_with_fewest_requests_then_least_session_kv_is_cheapest():
    # Two router replicas: each reports its own in-flight requests and live blocks.
    a = parse_loads(
        router_metrics(
            {"10.0.0.1:50061": 3, "10.0.0.2:50061": 0, "10.0.0.3:50061": 0},
            {"10.0.0.2:50061": 40, "10.0.0.3:50061": 5},
        )
    )
    b = parse_loads(
        router_metrics(
            {"10.0.0.1:50061": 3, "10.0.0.2:50061": 0, "10.0.0.3:50061": 0}, {"10.0.0.3:50061": 10}
        )
    )
    pods = {
        "decode-a": "10.0.0.1:50061",
        "decode-b": "10.0.0.2:50061",
        "decode-c": "10.0.0.3:50061",
        "decode-new": "10.0.0.4:50061",
    }
    costs = deletion_costs(pods, [a, b])
    assert costs == {"decode-a": 600_000, "decode-b": 40, "decode-c": 15, "decode-new": 0}
    assert sorted(costs, key=costs.get) == ["decode-new", "decode-c", "decode-b", "decode-a"]


def test_costs_fit_the_annotation_and_no_router_means_zero():
    huge = parse_loads(router_metrics({"p:1": 10**6}, {}))
    assert deletion_costs({"x": "p:1"}, [huge]) == {"x": 2**31 - 1}
    assert deletion_costs({"x": "p:1"}, []) == {"x": 0}
