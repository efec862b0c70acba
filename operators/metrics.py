"""The operator's Prometheus metrics (served on --metrics-port)."""

from prometheus_client import Counter, Histogram

RECONCILE_SECONDS = Histogram(
    "tandem_operator_reconcile_seconds",
    "Time of one TandemDeployment reconcile (render, apply, status)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
RECONCILES = Counter("tandem_operator_reconciles_total", "Reconciles by result", ["result"])
OBJECTS_WRITTEN = Counter(
    "tandem_operator_objects_total",
    "Objects the operator compared, by kind and what it did (created, updated, reverted, "
    "unchanged)", ["kind", "action"])
