"""The operator's Prometheus metrics (served on --metrics-port)."""

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

RECONCILE_SECONDS = Histogram(
    "tandem_operator_reconcile_seconds",
    "Time of one TandemDeployment reconcile (render, apply, status)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILES = Counter("tandem_operator_reconciles_total", "Reconciles by result", ["result"])
OBJECTS_WRITTEN = Counter(
    "tandem_operator_objects_total",
    "Objects the operator compared, by kind and what it did (created, updated, reverted, "
    "unchanged)",
    ["kind", "action"],
)
LEADER = Gauge(
    "tandem_operator_leader",
    "1 while this replica holds the leader Lease and reconciles, 0 while it stands by",
)
LEADER_TRANSITIONS = Counter(
    "tandem_operator_leader_acquired_total", "Times this replica became the leader"
)

# The rate-matching controller (operators/live.py), in Recommend and Auto.
SCALING_RECOMMENDED = Gauge(
    "tandem_operator_scaling_recommended_replicas",
    "Replicas the rate-matching controller writes (Auto) or recommends (Recommend) now, after "
    "cooldowns, steps and the budget",
    ["namespace", "deployment", "role"],
)
SCALING_TARGET = Gauge(
    "tandem_operator_scaling_target_replicas",
    "Replicas the solver wants for the measured demand",
    ["namespace", "deployment", "role"],
)
SCALING_DEMAND = Gauge(
    "tandem_operator_scaling_demand_requests_per_second",
    "Request rate the routers measured over the last window",
    ["namespace", "deployment"],
)


def forget_scaling(namespace: str, deployment: str, roles: Sequence[str]) -> None:
    """Drop a deployment's scaling series (its mode went Off)."""
    for role in roles:
        for gauge in (SCALING_RECOMMENDED, SCALING_TARGET):
            try:
                gauge.remove(namespace, deployment, role)
            except KeyError:
                pass
    try:
        SCALING_DEMAND.remove(namespace, deployment)
    except KeyError:
        pass
