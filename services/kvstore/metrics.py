"""Mooncake master metrics → Tandem's Prometheus names.

The master exposes its own text format on ``--master-metrics-port`` with names
such as ``master_key_count`` and ``mem_cache_hit_nums_``. This module parses
that text (pure function, tested without a server) and re-exports the figures
an operator needs under ``tandem_kvstore_*`` with units and ``_total``
suffixes, plus the supervisor's own counters (restarts, process up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Translation:
    source: str  # master sample name
    target: str  # Tandem metric name (counters without the _total suffix)
    kind: str  # "gauge" or "counter"
    help: str
    labels: dict[str, str] | None = None


# One row per exported series. Several sources may feed one target name with
# different labels (tier="memory"/"disk").
TRANSLATIONS: tuple[Translation, ...] = (
    Translation(
        "master_key_count", "tandem_kvstore_objects", "gauge", "Objects (KV blocks) the store holds"
    ),
    Translation(
        "mem_cache_nums_",
        "tandem_kvstore_tier_objects",
        "gauge",
        "Objects per tier",
        {"tier": "memory"},
    ),
    Translation(
        "file_cache_nums_",
        "tandem_kvstore_tier_objects",
        "gauge",
        "Objects per tier",
        {"tier": "disk"},
    ),
    Translation(
        "master_soft_pin_key_count",
        "tandem_kvstore_pinned_objects",
        "gauge",
        "Soft-pinned objects (retention policy soft-pin)",
    ),
    Translation(
        "master_allocated_bytes",
        "tandem_kvstore_used_bytes",
        "gauge",
        "Bytes in use per tier",
        {"tier": "memory"},
    ),
    Translation(
        "master_total_capacity_bytes",
        "tandem_kvstore_capacity_bytes",
        "gauge",
        "Capacity per tier",
        {"tier": "memory"},
    ),
    Translation(
        "master_active_clients",
        "tandem_kvstore_clients",
        "gauge",
        "Clients (pool owner and engines) with a live heartbeat",
    ),
    Translation(
        "mem_cache_hit_nums_",
        "tandem_kvstore_hits",
        "counter",
        "Reads served, per tier",
        {"tier": "memory"},
    ),
    Translation(
        "file_cache_hit_nums_",
        "tandem_kvstore_hits",
        "counter",
        "Reads served, per tier",
        {"tier": "disk"},
    ),
    Translation(
        "mem_cache_hit_bytes_total",
        "tandem_kvstore_hit_bytes",
        "counter",
        "Bytes of reads served, per tier",
        {"tier": "memory"},
    ),
    Translation(
        "file_cache_hit_bytes_total",
        "tandem_kvstore_hit_bytes",
        "counter",
        "Bytes of reads served, per tier",
        {"tier": "disk"},
    ),
    Translation(
        "total_get_nums_",
        "tandem_kvstore_lookups",
        "counter",
        "Object reads asked of the master (replica-list lookups)",
    ),
    Translation(
        "master_exist_key_requests_total",
        "tandem_kvstore_exist_requests",
        "counter",
        "Existence checks (single)",
    ),
    Translation(
        "master_batch_exist_key_items_total",
        "tandem_kvstore_exist_keys",
        "counter",
        "Keys checked for existence in batches (engines' prefix lookups)",
    ),
    Translation(
        "master_put_start_requests_total",
        "tandem_kvstore_puts",
        "counter",
        "Object writes started",
        {"kind": "single"},
    ),
    Translation(
        "master_batch_put_start_items_total",
        "tandem_kvstore_puts",
        "counter",
        "Object writes started",
        {"kind": "batch"},
    ),
    Translation(
        "master_put_start_failures_total",
        "tandem_kvstore_put_failures",
        "counter",
        "Object writes refused",
        {"kind": "single"},
    ),
    Translation(
        "master_batch_put_start_failed_items_total",
        "tandem_kvstore_put_failures",
        "counter",
        "Object writes refused",
        {"kind": "batch"},
    ),
    Translation(
        "master_put_start_alloc_failures_total",
        "tandem_kvstore_alloc_failures",
        "counter",
        "Writes refused because no pool space could be allocated",
    ),
    Translation(
        "master_successful_evictions_total",
        "tandem_kvstore_eviction_rounds",
        "counter",
        "Eviction rounds that freed space",
    ),
    Translation(
        "master_evicted_key_count",
        "tandem_kvstore_evicted_objects",
        "counter",
        "Objects evicted from the memory tier",
    ),
    Translation(
        "master_evicted_size_bytes",
        "tandem_kvstore_evicted_bytes",
        "counter",
        "Bytes evicted from the memory tier",
    ),
    Translation(
        "master_evict_disk_replica_requests_total",
        "tandem_kvstore_disk_evictions",
        "counter",
        "Disk replicas evicted",
    ),
    Translation(
        "master_promotion_completed_total",
        "tandem_kvstore_promotions",
        "counter",
        "Objects promoted from disk back to memory",
    ),
    Translation(
        "master_remove_requests_total", "tandem_kvstore_removes", "counter", "Explicit removals"
    ),
)

# Misses are derived: lookups minus lookups that found a valid replica.
_MISS_SOURCES = ("total_get_nums_", "valid_get_nums_")


def parse_master_metrics(text: str) -> dict[str, float]:
    """Flatten the master's exposition text into {sample name: value}.

    Labelled samples (per-segment gauges) are summed per name; the master's
    per-segment series are an implementation detail of the pool owner.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name.endswith("_total") and family.type == "counter":
                # The parser appends _total to counters that lack it; keep the
                # name the master wrote as well.
                bare = sample.name[: -len("_total")]
                values[bare] = values.get(bare, 0.0) + sample.value
    return values


def translate(raw: dict[str, float]) -> list:
    """Tandem metric families from parsed master values (missing ones are skipped)."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for row in TRANSLATIONS:
        if row.source not in raw:
            continue
        labels = row.labels or {}
        family = families.get(row.target)
        if family is None:
            cls = GaugeMetricFamily if row.kind == "gauge" else CounterMetricFamily
            family = cls(row.target, row.help, labels=list(labels))
            families[row.target] = family
        family.add_metric(list(labels.values()), raw[row.source])
    total, valid = (raw.get(name) for name in _MISS_SOURCES)
    if total is not None and valid is not None:
        misses = CounterMetricFamily(
            "tandem_kvstore_misses", "Object reads that found no valid replica"
        )
        misses.add_metric([], max(0.0, total - valid))
        families["tandem_kvstore_misses"] = misses
    return list(families.values())


class StoreCollector:
    """A prometheus_client collector: scrapes the master on each collect."""

    def __init__(self, fetch, supervisor_status) -> None:
        self._fetch = fetch  # () -> str | None (master text)
        self._status = supervisor_status  # () -> dict[name, ProcessStatus]

    def collect(self):
        up = GaugeMetricFamily(
            "tandem_kvstore_process_up",
            "1 when the supervised Mooncake process is running and ready",
            labels=["process"],
        )
        restarts = CounterMetricFamily(
            "tandem_kvstore_process_restarts",
            "Restarts of a supervised Mooncake process after it died",
            labels=["process"],
        )
        for name, status in self._status().items():
            up.add_metric([name], 1.0 if status.ready else 0.0)
            restarts.add_metric([name], float(status.restarts))
        yield up
        yield restarts
        text = self._fetch()
        scrape_ok = GaugeMetricFamily(
            "tandem_kvstore_master_scrape_ok", "1 when the master's metrics could be read"
        )
        scrape_ok.add_metric([], 0.0 if text is None else 1.0)
        yield scrape_ok
        if text:
            yield from translate(parse_master_metrics(text))
