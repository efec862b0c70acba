"""What a prefill or decode profile measures (operators/planner/profiling.py): every prompt
through the prefill pool, or the level is refused. Pure: the router's
counters as a window, the router's own settings parser and policy."""

from __future__ import annotations

import pytest

from operators.planner.demand import PoolCounters, Window
from operators.planner.profiling import PD_PROFILE_ROUTER_ARGS, foreign_prompts, point_from_level
from services.router.config import parse_settings
from services.router.routing.policy import Binding, PodView, Policy, RouteInput

# The router's counters over one 45 s level of the agentic trace on 1P1D with
# the router's default threshold (the first Phase 2 run): the decode pod
# prefilled 19 of 21 prompts itself; the prefill pool saw the 2 least cached.
DEFAULT_ROUTING = Window(
    45.0,
    {
        "prefill": PoolCounters(
            prompts=2, prompt_tokens=2825, cached_tokens=512, busy_seconds=60.2
        ),
        "decode": PoolCounters(
            prompts=19,
            prompt_tokens=31367,
            cached_tokens=28544,
            generations=21,
            output_tokens=612,
            busy_seconds=164.9,
        ),
    },
)
# The same traffic with every prompt through the prefill pool.
EVERY_PROMPT_REMOTE = Window(
    45.0,
    {
        "prefill": PoolCounters(
            prompts=21, prompt_tokens=34192, cached_tokens=29056, busy_seconds=80.0
        ),
        "decode": PoolCounters(generations=21, output_tokens=84, busy_seconds=9.0),
    },
)


def _run(requests: int, hit_rate: float) -> dict:
    summary = {
        "output_tokens": 4 * requests,
        "duration_s": 45.0,
        "prompt_tokens": 34192,
        "hit_rate": hit_rate,
        "ttft_p50": 1.0,
        "ttft_p90": 2.0,
        "itl_p50": 0.1,
        "interactivity_p90": 5.0,
    }
    return {"summary": summary, "records": [{"ok": True, "ttft": 1.0, "e2e": 1.3}] * requests}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_level_with_local_prefills_is_refused(role):
    why = foreign_prompts(role, DEFAULT_ROUTING)
    assert why is not None
    assert "19 of the 21 prompts" in why and "--remote-prefill-threshold 0" in why


def test_a_pd_level_with_every_prompt_remote_is_kept_with_the_traces_reuse():
    assert foreign_prompts("prefill", EVERY_PROMPT_REMOTE) is None
    assert foreign_prompts("decode", EVERY_PROMPT_REMOTE) is None
    point = point_from_level("prefill", 1, 2, _run(21, 0.85), EVERY_PROMPT_REMOTE)
    assert point.request_rate == pytest.approx(21 / 45)
    assert point.hit_rate == pytest.approx(29056 / 34192)  # 85%, the trace's own reuse
    # Under default routing the same pool's figures describe the routing: 2
    # prompts in 45 s at an 18% hit rate.
    skewed = point_from_level("prefill", 1, 2, _run(21, 0.85), DEFAULT_ROUTING)
    assert skewed.request_rate < 0.1 * point.request_rate and skewed.hit_rate < 0.2


def test_aggregated_and_missing_counters_need_no_check():
    agg = Window(45.0, {"aggregated": PoolCounters(prompts=21, prompt_tokens=34192)})
    assert foreign_prompts("aggregated", agg) is None
    assert foreign_prompts("prefill", None) is None


def test_the_profile_router_args_send_a_short_uncached_prompt_to_the_prefill_pool():
    settings = parse_settings(
        ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *PD_PROFILE_ROUTER_ARGS]
    )
    views = [
        PodView(name="p1", role="prefill"),
        PodView(name="d1", role="decode", cached_tokens=3968),
    ]
    choice = Policy(settings.routing.policy).choose(RouteInput(4000, views, "s", Binding("d1")))
    assert choice.prefill_pod == "p1" and choice.local_prefill is None
