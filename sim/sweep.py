"""Sweeps: a grid of simulation points run as Ray tasks, one row each.

A point is a plain dict (policy, pods, KV and store capacity, traffic scale,
seed, and the fitted step model's numbers), so a task needs no file of the
driver's. ``ray.init()`` starts a local Ray unless an ``address`` names a
cluster; each point is one task of ``num_cpus=1``.
"""

from __future__ import annotations

import csv
import itertools
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sim.cluster import ClusterConfig, Simulation, Traffic
from sim.costs import Link, StepModel, StoreTier
from sim.engine import EngineSettings

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (
    "policy",
    "pods",
    "kv_blocks",
    "store_blocks",
    "sessions",
    "seed",
    "router_replicas",
    "state_lag_ms",
    "requests",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "interactivity_p90",
    "output_tok_s_per_gpu",
    "local_prefills",
    "sim_time_s",
    "wall_s",
)
# The columns a row takes from its point (the rest are the run's figures).
POINT_COLUMNS = COLUMNS[: COLUMNS.index("requests")]
_PODS = re.compile(r"^(?:(\d+)|(\d+)P(\d+)D)$")


def parse_pods(text: str) -> tuple[int, int, int]:
    """``N`` aggregated pods, or ``xPyD`` prefill and decode pods: (aggregated, prefill, decode)."""
    m = _PODS.match(text.strip())
    if not m:
        raise ValueError(f"pods {text!r}: write N (aggregated) or xPyD, e.g. 2 or 1P3D")
    if m.group(1):
        return int(m.group(1)), 0, 0
    return 0, int(m.group(2)), int(m.group(3))


def point_config(point: dict[str, Any]) -> tuple[ClusterConfig, Traffic]:
    aggregated, prefill, decode = parse_pods(point["pods"])
    store = None
    if point.get("store_blocks"):
        store = StoreTier(
            point["store_blocks"], point["store_gbps"] * 1e9, point["store_latency_ms"] / 1e3
        )
    disk = None
    if point.get("store_disk_blocks"):
        disk = StoreTier(
            point["store_disk_blocks"],
            point["store_disk_gbps"] * 1e9,
            point["store_disk_latency_ms"] / 1e3,
        )
    config = ClusterConfig(
        policy=point["policy"],
        aggregated=aggregated,
        prefill=prefill,
        decode=decode,
        engine=EngineSettings(
            kv_blocks=point["kv_blocks"],
            block_size=point["block_size"],
            max_num_batched_tokens=point["max_num_batched_tokens"],
            max_num_seqs=point.get("max_num_seqs", EngineSettings.max_num_seqs),
            long_prefill_threshold=point["long_prefill_threshold"],
            block_bytes=point["block_bytes"],
            async_scheduling=point.get("async_scheduling", EngineSettings.async_scheduling),
            shared_core_s=point.get("shared_core_s", EngineSettings.shared_core_s),
        ),
        model=StepModel(**point["model"]),
        store=store,
        store_disk=disk,
        store_pin_ttl_s=point.get("store_pin_ttl_s", 0.0),
        link=Link(point["link_gbps"] * 1e9, point["link_latency_ms"] / 1e3),
        gpus_per_pod=point["gpus_per_pod"],
        remote_prefill_threshold=point["remote_prefill_threshold"],
        store_load_weight=point.get("store_load_weight", 1.0),
        router_replicas=point.get("router_replicas", 1),
        state_lag_s=point.get("state_lag_ms", 0.0) / 1e3,
        decode_runs=point.get("decode_runs", True),
        miss_reasons=point.get("miss_reasons", False),
        index_capacity=point.get("index_capacity"),
        live_max_blocks=point.get("live_max_blocks"),
    )
    traffic = Traffic(
        profile=point["trace_profile"],
        sessions=point["sessions"],
        turns_median=point["turns_median"],
        seed=point["seed"],
        think_scale=point["think_scale"],
        concurrency=point["concurrency"],
        trace_file=point.get("trace_file"),
        first_visible=tuple(
            (session, tuple(indices))
            for session, indices in (point.get("first_visible") or {}).items()
        ),
    )
    return config, traffic


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One simulation: the point's columns and the run's figures."""
    config, traffic = point_config(point)
    result = Simulation(config, traffic).run()
    return {
        **{k: point.get(k) for k in POINT_COLUMNS},
        "router_replicas": config.router_replicas,
        "state_lag_ms": config.state_lag_s * 1e3,
        **result,
    }


def grid(base: dict[str, Any], **axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Every combination of the axes' values over ``base``."""
    names = list(axes)
    return [dict(base, **dict(zip(names, values))) for values in itertools.product(*axes.values())]


def model_fields(model: StepModel) -> dict[str, float]:
    return asdict(model)


def run_on_ray(
    points: Sequence[dict[str, Any]], address: str | None = None, num_cpus: int | None = None
) -> list[dict[str, Any]]:
    """Each point a Ray task; rows in the points' order."""
    import ray

    if address:
        # A cluster's workers get this checkout's code.
        runtime_env = {"working_dir": str(ROOT), "excludes": [".git", "*.venv*", "site"]}
        ray.init(address=address, runtime_env=runtime_env)
    else:
        # Local workers inherit the driver's environment: put this checkout on
        # their path (a runtime_env would cost its agent's start, ~30 s here).
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(ROOT) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        task = ray.remote(num_cpus=1)(run_point)
        return list(ray.get([task.remote(p) for p in points]))
    finally:
        ray.shutdown()


def write_csv(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    rows = list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    """A Markdown table of the rows."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Hit rate and TTFT p90 per policy against the pod count (one line per KV size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    keys = sorted({(r["policy"], r["kv_blocks"], r["store_blocks"]) for r in rows}, key=str)
    for key in keys:
        pts = [r for r in rows if (r["policy"], r["kv_blocks"], r["store_blocks"]) == key]
        pts.sort(key=lambda r: (sum(parse_pods(r["pods"])), r["sessions"]))
        label = f"{key[0]} kv={key[1]}" + (f" store={key[2]}" if key[2] else "")
        xs = [f"{r['pods']}/{r['sessions']}s" for r in pts]
        axes[0].plot(xs, [r["hit_rate"] for r in pts], marker="o", label=label)
        axes[1].plot(xs, [r["ttft_p90_s"] for r in pts], marker="o", label=label)
        axes[2].scatter(
            [r["interactivity_p90"] for r in pts],
            [r["output_tok_s_per_gpu"] for r in pts],
            label=label,
        )
    axes[0].set_title("prefix hit rate")
    axes[1].set_title("TTFT p90 (s)")
    axes[2].set_title("output tok/s per GPU vs P90 interactivity")
    axes[2].set_xlabel("P90 interactivity (tok/s/user)")
    for ax in axes[:2]:
        ax.set_xlabel("pods / sessions")
        ax.tick_params(axis="x", rotation=45)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
