"""The simulator as the rate-matching controller's check of a decision
(``operators/planner/simulate.py``: the ``Simulator`` protocol, which
``tandem operator`` hands the operator an instance of).

For a proposal, the current and the proposed pools each serve the same
synthesized traffic, and each side's goodput (requests finished within the
SLOs per second) and TTFT p90 come back:

* the engines: the step model fitted from the pools' own profiles
  (``costs.fit_engine``: the prompt side from the prefill or aggregated
  profile, the decode side from the decode or aggregated one), one pod per
  replica, each replica's KV capacity from its profile;
* the traffic: ``tandem.workload``'s generator (the ``agentx`` shape by
  default, the generator ``bench/agentx`` replays), its sizes fitted in a few
  rounds so that the trace's mean prompt and output tokens and its prefix
  reuse match the measured demand's; sessions start as a Poisson process at
  the rate that offers the measured request rate times the planned headroom,
  until ``request.requests`` requests;
* the router: its routing core with its default policy.

A request is within the SLOs when its TTFT is within ``ttft_p90_s`` and its
output came at ``interactivity_p90`` tokens/s or faster (end-to-end time per
output token, as the profiles count it); goodput divides those by the time
from the first arrival to the last request's end, so pools that fall behind
the offered load score lower.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from operators.planner.profiles import EngineProfile
from operators.planner.simulate import CheckRequest, Prediction
from operators.planner.solver import Demand, Slo
from sim.cluster import ClusterConfig, Record, Simulation, Traffic
from sim.costs import StepModel, fit_engine
from sim.engine import EngineSettings
from tandem.workload.generate import generate, params_for, reuse_bound
from tandem.workload.metrics import percentile
from tandem.workload.trace import Session

# The generator's sizes scaled together to fit a demand's mean prompt.
_SIZES = ("shared_prefix", "first_in_median", "max_context", "subagent_task_median")


@dataclass(frozen=True)
class CheckSettings:
    block_size: int = 64
    # A replica's KV when its profile does not give kvCapacityTokens.
    kv_tokens: int = 1_000_000
    max_num_batched_tokens: int = 8192
    remote_prefill_threshold: int = 256
    trace_profile: str = "agentx"
    turns_median: float = 8.0
    fit_rounds: int = 4
    seed: int = 0


@dataclass(frozen=True)
class FittedTraffic:
    traffic: Traffic
    requests: int
    mean_input_tokens: float
    mean_output_tokens: float
    reuse: float  # the trace's prefix reuse bound


def _stats(sessions: list[Session], block_size: int) -> tuple[int, float, float, float]:
    reqs = [r for s in sessions for _, _, r in s.iter_requests()]
    n = len(reqs)
    return (
        n,
        sum(r.in_tokens for r in reqs) / n,
        sum(r.out_tokens for r in reqs) / n,
        reuse_bound(sessions, block_size),
    )


def fit_traffic(demand: Demand, load: float, requests: int, s: CheckSettings) -> FittedTraffic:
    """The generator's parameters whose trace matches ``demand``'s shape,
    started at the rate that offers ``demand × load`` requests per second."""
    if not demand.request_rate or demand.request_rate <= 0:
        raise ValueError("no request rate measured: nothing to simulate")
    base = params_for(s.trace_profile, block_size=s.block_size, seed=s.seed)
    over: dict[str, Any] = {
        "sessions": max(1, round(requests / s.turns_median)),
        "turns_median": s.turns_median,
        "block_size": s.block_size,
        "seed": s.seed,
        **{k: getattr(base, k) for k in _SIZES},
        "out_median": base.out_median,
        "out_max": base.out_max,
        "reuse": base.reuse,
    }
    n = mean_in = mean_out = reuse = 0.0
    for _ in range(max(1, s.fit_rounds)):
        sessions = generate(params_for(s.trace_profile, **over))
        n, mean_in, mean_out, reuse = _stats(sessions, s.block_size)
        k = demand.mean_input_tokens / mean_in
        k_out = demand.mean_output_tokens / mean_out
        over["sessions"] = max(1, math.ceil(over["sessions"] * requests / n))
        for name in _SIZES:
            over[name] = max(1, round(over[name] * k))
        over["out_median"] = max(1, round(over["out_median"] * k_out))
        over["out_max"] = max(over["out_median"] * 4, 1)
        over["shared_prefix"] = min(over["shared_prefix"], over["first_in_median"] - 1)
        over["max_context"] = max(
            over["max_context"], over["first_in_median"] + over["out_max"] + s.block_size
        )
        if demand.hit_rate is not None:
            over["reuse"] = min(0.99, max(0.3, over["reuse"] + demand.hit_rate - reuse))
    sessions = generate(params_for(s.trace_profile, **over))
    n, mean_in, mean_out, reuse = _stats(sessions, s.block_size)
    per_session = n / len(sessions)
    rate = demand.request_rate * load / per_session
    generator = {k: v for k, v in over.items() if k not in ("sessions", "turns_median", "seed")}
    traffic = Traffic(
        profile=s.trace_profile,
        sessions=over["sessions"],
        turns_median=s.turns_median,
        seed=s.seed,
        think_scale=1.0,
        overrides=tuple(sorted(generator.items())),
        session_rate=rate,
    )
    return FittedTraffic(traffic, int(n), mean_in, mean_out, reuse)


def step_model(request: CheckRequest) -> StepModel:
    """One engine's step model from the pools' profiles (P/D's when both run)."""
    by_role: dict[str, EngineProfile] = {p.role: p.profile for p in request.pools}
    prefill = by_role.get("prefill") or by_role.get("aggregated")
    decode = by_role.get("decode") or by_role.get("aggregated")
    if prefill is None or decode is None:
        raise ValueError("no profile for a pool that decodes")
    return fit_engine(prefill, decode)


def kv_blocks(request: CheckRequest, s: CheckSettings) -> int:
    tokens = [p.profile.config.kv_capacity_tokens or s.kv_tokens for p in request.pools]
    return max(1, min(tokens) // s.block_size)


def goodput(records: list[Record], slo: Slo) -> tuple[float, float]:
    """(requests within the SLOs per second, TTFT p90 in seconds)."""
    done = [
        (r.arrival, r.first_token, r.end, r.out_tokens)
        for r in records
        if r.end is not None and r.first_token is not None
    ]
    if not done:
        return 0.0, math.inf
    ttft = [first - arrival for arrival, first, _, _ in done]
    good = 0
    for (arrival, _, end, out), t in zip(done, ttft, strict=True):
        per_token = (end - arrival) / max(1, out)
        ok_ttft = slo.ttft_p90_s is None or t <= slo.ttft_p90_s
        ok_rate = slo.interactivity_p90 is None or per_token * slo.interactivity_p90 <= 1.0
        good += ok_ttft and ok_rate
    span = max(end for _, _, end, _ in done) - min(arrival for arrival, _, _, _ in done)
    return (good / span if span > 0 else 0.0), float(percentile(ttft, 90) or 0.0)


class SimulationChecker:
    """``operators.planner.simulate.Simulator`` by simulation."""

    def __init__(self, settings: CheckSettings | None = None) -> None:
        self.settings = settings or CheckSettings()

    def predict(self, request: CheckRequest, deadline: float) -> tuple[Prediction, Prediction]:
        s = self.settings
        fitted = fit_traffic(request.demand, request.load, request.requests, s)
        config = ClusterConfig(
            engine=EngineSettings(
                kv_blocks=kv_blocks(request, s),
                block_size=s.block_size,
                max_num_batched_tokens=s.max_num_batched_tokens,
            ),
            model=step_model(request),
            remote_prefill_threshold=s.remote_prefill_threshold,
        )

        def past_deadline() -> bool:
            return time.monotonic() > deadline

        def side(sizes: dict[str, int]) -> Prediction:
            if past_deadline():
                raise TimeoutError("the deadline passed before the simulation started")
            pods = replace(
                config,
                aggregated=sizes.get("aggregated", 0),
                prefill=sizes.get("prefill", 0),
                decode=sizes.get("decode", 0),
            )
            sim = Simulation(pods, fitted.traffic)
            try:
                sim.run(interrupt=past_deadline)
            except Exception as exc:
                if past_deadline():
                    raise TimeoutError(str(exc)) from exc
                raise
            rps, ttft_p90 = goodput(sim.records, request.slo)
            return Prediction(rps, ttft_p90, len(sim.records))

        return side(request.current), side(request.proposed)
