"""Summary metrics from per-request records, as the industry reports them.

Pure functions over plain dicts (a record is ``asdict(RequestRecord)``), so the
formulas are checked on hand-built timings:

* TTFT p50 / p90 / p99 (seconds), over successful requests.
* ITL p50 / p90: ``(e2e - ttft) / (output_tokens - 1)`` per request.
* P90 interactivity, tokens/s/user: ``1 / P90(e2e / output_tokens)``.
* Total tokens per second: (input tokens, cached included, + output tokens)
  of successful requests / run duration; output tokens per second likewise.
* Prefix cache hit rate: sum(cached_tokens) / sum(prompt_tokens).
* Failures: requests that ended in an error (interrupted ones are counted apart).
* Per turn index: hit rate and TTFT p50 of the n-th call of every agent.

Percentiles are linear-interpolated (numpy's default), as aiperf reports them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

INTERRUPTED = "interrupted"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the
    closest ranks (numpy's default); None when there are no values."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs, dtype=float), q))


def run_duration(records: list[dict]) -> float:
    """From the first request sent to the last response finished."""
    ends = [r["start"] + r["e2e"] for r in records if r.get("e2e") is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r["start"] for r in records)


def summarize(records: list[dict], duration_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    interrupted = [r for r in records if not r.get("ok") and r.get("error") == INTERRUPTED]
    failed = [r for r in records if not r.get("ok") and r.get("error") != INTERRUPTED]
    duration = run_duration(records) if duration_s is None else duration_s
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    output = sum(r.get("output_tokens") or 0 for r in ok)
    ttft = [r["ttft"] for r in ok]
    itl = [r["itl"] for r in ok if r.get("itl") is not None]
    per_token = [r["e2e"] / r["output_tokens"] for r in ok if r.get("output_tokens")]
    p90_per_token = percentile(per_token, 90)
    reported_cached = sum(1 for r in ok if r.get("cached_tokens") is not None)
    errors = Counter((r.get("error") or "?")[:160] for r in failed)
    return {
        "requests": len(records),
        "ok": len(ok),
        "failures": len(failed),
        "interrupted": len(interrupted),
        "failure_kinds": dict(errors.most_common(10)),
        "duration_s": duration,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "ttft_mean": float(np.mean(ttft)) if ttft else None,
        "itl_p50": percentile(itl, 50),
        "itl_p90": percentile(itl, 90),
        "e2e_p50": percentile([r["e2e"] for r in ok], 50),
        "e2e_p90": percentile([r["e2e"] for r in ok], 90),
        "interactivity_p90": (1.0 / p90_per_token) if p90_per_token else None,
        "total_tokens_per_s": (prompt + output) / duration if duration > 0 else None,
        "output_tokens_per_s": output / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": cached / prompt if prompt and reported_cached else None,
        "cached_tokens_reported": reported_cached,
        "prompt_tokens_mismatch": sum(
            1
            for r in ok
            if r.get("prompt_tokens") is not None
            and r["prompt_tokens"] != r["expected_prompt_tokens"]
        ),
    }


def hit_rate(records: list[dict]) -> float | None:
    """Cached share of the prompt tokens of the successful requests."""
    ok = [r for r in records if r.get("ok")]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return cached / prompt if prompt else None


def per_turn(records: list[dict]) -> list[dict[str, Any]]:
    """Hit rate and TTFT by the index of the call within its agent."""
    by: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("ok"):
            by[r["turn"]].append(r)
    rows = []
    for turn in sorted(by):
        rs = by[turn]
        rows.append(
            {
                "turn": turn,
                "requests": len(rs),
                "hit_rate": hit_rate(rs),
                "ttft_p50": percentile([r["ttft"] for r in rs], 50),
            }
        )
    return rows


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (interactivity, throughput) not dominated in both; sorted by x."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def cell(value: float | None, fmt: str = "{:.2f}") -> str:
    """A table cell: ``value`` formatted, or a dash when it was not measured."""
    return "—" if value is None else fmt.format(value)
