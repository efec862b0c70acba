"""Where each request's time to first token went, per engine phase.

Tandem's engine hosts log one line per request at its first output when
``TANDEM_LOG_LEVEL=DEBUG`` (services/engine/servicer.py): the request id (the
router's, which is also the response id the client sees), the kind (prefill
or generate), the prompt and cached token counts, and the phases of
services/engine/metrics.py. Joined with a replay's records by that id, they
say for one slow request whether its time went to the prefill engine's queue,
the prefill itself, the KV pull or the decode engine; the lines' timestamps
(first output) and phases also place every request on its engine's timeline,
so a request's queue wait can be matched to the requests ahead of it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) DEBUG \S+ \S+: request (?P<id>\S+) "
    r"\((?P<kind>\w+), (?P<prompt>\d+) prompt tokens, (?P<cached>\S+) cached\):(?P<phases>.*)$"
)
_PHASE = re.compile(r"(\w+) ([0-9.]+)s")


def parse_engine_log(text: str, engine: str) -> list[dict[str, Any]]:
    """The per-request phase lines of one engine's log: id, kind, engine,
    prompt and cached tokens, ``first_output`` (epoch seconds, from the
    line's local-time timestamp), ``arrived`` (first output minus the phases: when
    the request entered vLLM's queue) and the phases in seconds."""
    found = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        phases = {name: float(v) for name, v in _PHASE.findall(m["phases"])}
        at = datetime.strptime(m["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        cached = m["cached"]
        found.append(
            {
                "id": m["id"],
                "kind": m["kind"],
                "engine": engine,
                "prompt_tokens": int(m["prompt"]),
                "cached_tokens": int(cached) if cached.isdigit() else None,
                "first_output": at,
                "arrived": at - sum(phases.values()),
                "phases": phases,
            }
        )
    return found


def queue_ahead(entry: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, int]:
    """The requests on the same engine that arrived before `entry` and had
    not produced their first output when it arrived (what it queued behind),
    and their uncached prompt tokens."""
    ahead = [
        e
        for e in entries
        if e is not entry
        and e["engine"] == entry["engine"]
        and e["arrived"] <= entry["arrived"] < e["first_output"]
    ]
    return {
        "requests": len(ahead),
        "uncached_tokens": sum(e["prompt_tokens"] - (e["cached_tokens"] or 0) for e in ahead),
    }


def join(records: list[dict[str, Any]], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per successful record: who it was (session, agent, turn),
    when it started (seconds into the replay), its TTFT and tokens, the
    phases on the engine that prefilled it (``prefill.*``: a prefill engine,
    or the decode/aggregated engine computing the prompt itself) and on the
    decode engine (``decode.*``: kv_pull, first_decode_step), what queued
    ahead of it where it prefilled, and ``other``: TTFT minus the phases (the
    router, gRPC, the hand-off between engines)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_id.setdefault(e["id"], []).append(e)
    rows = []
    for r in records:
        if not r.get("ok") or r.get("ttft") is None:
            continue
        mine = by_id.get(r.get("response_id") or "", [])
        row: dict[str, Any] = {
            "session": r["session"],
            "agent": r["agent"] or "main",
            "turn": r["turn"],
            "start": r["start"],
            "ttft": r["ttft"],
            "prompt_tokens": r.get("prompt_tokens"),
            "cached_tokens": r.get("cached_tokens"),
            "phases": {},
            "ahead": None,
            "prefilled_on": None,
            "other": None,
        }
        for e in mine:
            remote = "kv_pull" in e["phases"]
            for phase, seconds in e["phases"].items():
                row["phases"][f"{'decode' if remote else 'prefill'}.{phase}"] = seconds
            if not remote:
                row["prefilled_on"] = e["engine"]
                row["ahead"] = queue_ahead(e, entries)
        if mine:
            row["other"] = r["ttft"] - sum(row["phases"].values())
        rows.append(row)
    return rows


PHASE_COLUMNS = (
    "prefill.admission",
    "prefill.queue",
    "prefill.prefill",
    "decode.admission",
    "decode.kv_pull",
    "decode.first_decode_step",
)


def slowest_table(label: str, rows: list[dict[str, Any]], n: int) -> list[str]:
    """Markdown rows for the `n` slowest requests by TTFT (no header)."""

    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}"

    lines = []
    for row in sorted(rows, key=lambda r: -r["ttft"])[:n]:
        ahead = row["ahead"]
        lines.append(
            f"| {label} | {row['session']}/{row['agent']}/{row['turn']} | {row['start']:.1f} | "
            f"{row['ttft']:.2f} | {row['prompt_tokens']} ({row['cached_tokens']} cached) | "
            f"{row['prefilled_on'] or '—'} | "
            + " | ".join(f(row["phases"].get(p)) for p in PHASE_COLUMNS)
            + f" | {f(row['other'])} | "
            + ("—" if ahead is None else f"{ahead['requests']} ({ahead['uncached_tokens']} tok)")
            + " |"
        )
    return lines


SLOWEST_HEADER = [
    "| config | session/agent/turn | start (s) | TTFT (s) | prompt | prefilled on | "
    "admission | queue | prefill | decode admission | KV pull | first decode step | other | "
    "queued behind |",
    "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]
