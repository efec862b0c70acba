"""The live loop's state as a JSON document, and back (pure).

The operator keeps it in the TandemDeployment's ``status.scaling`` so that the
cooldowns, the sustained-down window, the measured efficiencies and the
decision history survive an operator restart, and so that ``kubectl get td -o
yaml`` shows the last decisions with their inputs and reasons. Times are
RFC 3339 in UTC (seconds since the epoch inside the loop). A document this
module cannot read gives a fresh state: the loop then starts as on a new
deployment (its cooldowns restart), which is safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

from .loop import MODES, DecisionRecord, LoopState
from .simulate import Prediction, SimulationCheck
from .solver import Demand


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def record_to_dict(r: DecisionRecord) -> dict[str, Any]:
    return {
        "time": rfc3339(r.at),
        "mode": r.mode,
        "demandRps": r.demand_rps,
        "meanInputTokens": r.mean_input_tokens,
        "meanOutputTokens": r.mean_output_tokens,
        "hitRate": r.hit_rate,
        "targets": dict(r.targets),
        "replicas": dict(r.replicas),
        "binding": r.binding,
        "summary": r.summary,
        "held": list(r.held),
        **({"simulation": simulation_to_dict(r.simulation)} if r.simulation else {}),
    }


def _prediction_to_dict(replicas: Mapping[str, int], p: Prediction | None) -> dict[str, Any]:
    figures = (
        {}
        if p is None
        else {
            "goodputRps": round(p.goodput_rps, 4),
            "ttftP90Seconds": round(p.ttft_p90_s, 3),
            "requests": p.requests,
        }
    )
    return {"replicas": dict(replicas), **figures}


def _prediction(doc: Mapping[str, Any]) -> Prediction | None:
    if "goodputRps" not in doc:
        return None
    return Prediction(float(doc["goodputRps"]), float(doc["ttftP90Seconds"]), int(doc["requests"]))


def simulation_to_dict(c: SimulationCheck) -> dict[str, Any]:
    """`status.scaling.simulation`: both sides' predictions and the verdict."""
    doc: dict[str, Any] = {
        "current": _prediction_to_dict(c.current_replicas, c.current),
        "proposed": _prediction_to_dict(c.proposed_replicas, c.proposed),
        "verdict": c.verdict,
        "reason": c.reason,
        "wallSeconds": round(c.wall_s, 2),
    }
    if c.demand is not None:
        doc["demand"] = {
            "requestRate": c.demand.request_rate,
            "meanInputTokens": c.demand.mean_input_tokens,
            "meanOutputTokens": c.demand.mean_output_tokens,
            "hitRate": c.demand.hit_rate,
        }
    return doc


def simulation_from_dict(doc: Mapping[str, Any]) -> SimulationCheck:
    verdict = str(doc["verdict"])
    if verdict not in ("Better", "Same", "Worse", "Failed"):
        raise ValueError(f"verdict {verdict!r}")
    d = doc.get("demand")
    return SimulationCheck(
        current_replicas=_ints(doc["current"].get("replicas")),
        proposed_replicas=_ints(doc["proposed"].get("replicas")),
        current=_prediction(doc["current"]),
        proposed=_prediction(doc["proposed"]),
        verdict=cast(Any, verdict),
        reason=str(doc.get("reason", "")),
        wall_s=float(doc.get("wallSeconds", 0.0)),
        demand=None
        if d is None
        else Demand(
            _optional_float(d.get("requestRate")),
            float(d["meanInputTokens"]),
            float(d["meanOutputTokens"]),
            _optional_float(d.get("hitRate")),
        ),
    )


def _optional_float(value: object) -> float | None:
    return None if value is None else float(cast(float, value))


def _ints(value: object) -> dict[str, int]:
    return {str(k): int(v) for k, v in cast(Mapping[str, Any], value or {}).items()}


def _times(value: object) -> dict[str, float]:
    return {str(k): from_rfc3339(str(v)) for k, v in cast(Mapping[str, Any], value or {}).items()}


def record_from_dict(doc: Mapping[str, Any]) -> DecisionRecord:
    mode = str(doc["mode"])
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}")
    return DecisionRecord(
        at=from_rfc3339(str(doc["time"])),
        mode=mode,
        demand_rps=_optional_float(doc.get("demandRps")),
        mean_input_tokens=_optional_float(doc.get("meanInputTokens")),
        mean_output_tokens=_optional_float(doc.get("meanOutputTokens")),
        hit_rate=_optional_float(doc.get("hitRate")),
        targets=_ints(doc.get("targets")),
        replicas=_ints(doc.get("replicas")),
        binding=str(doc.get("binding", "")),
        summary=str(doc.get("summary", "")),
        held=tuple(str(h) for h in doc.get("held", [])),
        simulation=simulation_from_dict(doc["simulation"]) if doc.get("simulation") else None,
    )


def state_to_dict(state: LoopState) -> dict[str, Any]:
    return {
        "lastSpec": dict(state.last_spec),
        "lastChange": {k: rfc3339(v) for k, v in state.last_change_at.items()},
        "belowSince": {k: rfc3339(v) for k, v in state.below_since.items()},
        "windowMax": dict(state.window_max),
        "efficiency": {k: round(v, 4) for k, v in state.efficiency.items()},
        "lastMessage": state.last_message,
        "history": [record_to_dict(r) for r in state.history],
    }


def state_from_dict(doc: Mapping[str, Any] | None) -> LoopState:
    """The stored state; a fresh one when there is none or it cannot be read."""
    if not doc:
        return LoopState()
    try:
        return LoopState(
            last_spec=_ints(doc.get("lastSpec")),
            last_change_at=_times(doc.get("lastChange")),
            below_since=_times(doc.get("belowSince")),
            window_max=_ints(doc.get("windowMax")),
            efficiency={str(k): float(v) for k, v in doc.get("efficiency", {}).items()},
            history=tuple(record_from_dict(r) for r in doc.get("history", [])),
            last_message=str(doc.get("lastMessage", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return LoopState()
