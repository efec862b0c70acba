"""Run files: one replay of one trace against one endpoint at one concurrency,
stored as JSON (``run.json``) with its configuration, the trace statistics,
every request record, the summary and the per-turn table; the benchmarks
build their reports from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import metrics

RESULT_KIND = "tandem-agentx-run"


def make_run(label: str, replay_json: dict[str, Any], trace_info: dict[str, Any]) -> dict:
    records = replay_json["records"]
    return {
        "kind": RESULT_KIND,
        "version": 1,
        "label": label,
        "concurrency": replay_json["config"]["concurrency"],
        "endpoint": replay_json["config"]["url"],
        "model": replay_json["config"]["model"],
        "trace": trace_info,
        "replay": {k: v for k, v in replay_json.items() if k != "records"},
        "summary": metrics.summarize(records, replay_json["duration_s"] or None),
        "per_turn": metrics.per_turn(records),
        "records": records,
    }


def write_run(run: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(path)
    return path
