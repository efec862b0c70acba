"""The rate-matching controller's pure pieces inside the operator
(operators/scaling.py, operators/planner/persist.py): the spec read into the
loop's settings, profiles loaded from their ConfigMaps with problems that say
what to change, the loop's state through status and back, and the spec
rules the CRD states in CEL, re-checked for API servers without CEL."""

from __future__ import annotations

import pytest

from operators import scaling
from operators.planner.loop import LoopSettings, LoopState, PoolStatus, TickInputs, on_tick
from operators.planner.persist import state_from_dict, state_to_dict
from operators.planner.profiles import profile_configmap
from operators.planner.solver import Demand
from operators.spec import parse, problems, with_defaults
from tests.helpers import assert_spec_refused
from tests.planner.synthetic import ramp_profile

PREFILL = ramp_profile("prefill-a", "prefill", 28.0, kv_capacity_tokens=16_000)
DECODE = ramp_profile("decode-a", "decode", 65.0, kv_capacity_tokens=64_000)


def spec(scaling: dict | None = None, **pools) -> dict:
    return with_defaults(
        {
            "model": {"path": "/m", "maxModelLen": 32768},
            "prefill": pools.get("prefill", {}),
            "decode": pools.get("decode", {}),
            "scaling": scaling or {},
        }
    )


def test_the_crd_defaults_are_the_loops_defaults():
    s = spec({"mode": "Auto"})["scaling"]
    settings = scaling.loop_settings(parse(spec({"mode": "Auto"})).scaling)
    assert (
        settings.up_cooldown_s,
        settings.down_cooldown_s,
        settings.down_window_s,
        settings.max_step,
        settings.history,
    ) == (60, 600, 300, 2, 10)
    assert settings == LoopSettings()  # the CRD's defaults and the loop's are one set
    assert scaling.loop_settings(parse(spec({"switchMargin": 0.25})).scaling).switch_margin == 0.25
    assert s["headroom"] == 1.2
    slo = scaling.slo_of(parse(spec({"slo": {"ttftP90Ms": 800, "itlP90Ms": 40}})).scaling)
    assert slo.ttft_p90_s == 0.8 and slo.interactivity_p90 == pytest.approx(25.0)


def test_profiles_load_from_the_configmaps_the_spec_names():
    s = spec({"mode": "Auto", "profiles": {"prefill": "p", "decode": "d"}})
    cms = {"p": profile_configmap(PREFILL, "p"), "d": profile_configmap(DECODE, "d")}
    found, wrong = scaling.load_profiles(parse(s), cms)
    assert wrong == [] and found == {"prefill": PREFILL, "decode": DECODE}

    found, wrong = scaling.load_profiles(parse(s), {"p": cms["d"], "d": None})
    assert "ConfigMap p holds a decode profile" in wrong[0]
    assert "ConfigMap d (scaling.profiles.decode) does not exist" in wrong[1]
    assert "tandem profile --role decode" in wrong[1]

    broken = profile_configmap(DECODE, "d")
    broken["data"]["profile.json"] = "{"
    _, wrong = scaling.load_profiles(parse(s), {"p": cms["p"], "d": broken})
    assert "is not JSON" in wrong[0]

    # A profile taken on 1 GPU per replica does not size a pool of 2-GPU replicas.
    _, wrong = scaling.load_profiles(
        parse(spec({"profiles": {"prefill": "p", "decode": "d"}}, decode={"gpusPerPod": 2})), cms
    )
    assert "taken with 1 GPU(s) per replica, the decode pool runs 2" in wrong[0]


def test_a_replica_that_cannot_hold_the_longest_context_is_refused():
    both = {"prefill": PREFILL, "decode": DECODE}
    [refused] = scaling.capacity_problems(
        parse(spec({"slo": {"longestContextTokens": 32_000}})), both
    )
    assert "prefill pool's profile prefill-a" in refused and "16,000 tokens of KV" in refused
    assert scaling.capacity_problems(parse(spec()), both) == []


# The seed's GLM-5.3 figures (tests/planner/test_capacity.py): MLA, 95 layers,
# FP8, a 1M-token context, ~15 GiB free per GPU.
GLM_CAPACITY = {"layers": 95, "kvKind": "mla", "kvBytes": 1, "latentDim": 576, "gpuFreeGiB": 15}


def test_the_capacity_check_names_the_overflowing_term_and_the_parallelism_that_fits():
    pools = {"prefill": PREFILL, "decode": DECODE}
    long = {"slo": {"longestContextTokens": 2**20}, "capacity": GLM_CAPACITY}
    # The profiles' own KV figures are not what this checks.
    ramp = {r: ramp_profile(p.name, r, 30.0) for r, p in pools.items()}
    s = spec(long, **{role: {"parallelism": {"tensor": 8}, "gpusPerPod": 8} for role in pools})
    s["model"]["maxModelLen"] = 2**20
    found = scaling.capacity_problems(parse(s), ramp)
    assert [f.split(" pool")[0] for f in found] == ["the prefill", "the decode"]
    assert (
        "persistent KV 53.4 GiB per GPU (MLA's latent KV is replicated on every TP rank)"
        in found[1]
    )
    # DCP4: 13.4 GiB of KV plus the 1.1 GiB gather fit in 15 GiB.
    assert (
        "DCP4 brings persistent KV to 13.4 GiB per GPU and fits: set it in "
        "spec.decode.parallelism (decodeContext is DCP" in found[1]
    )
    # With DCP4 on decode only the prefill pool is left.
    s["decode"]["parallelism"]["decodeContext"] = 4
    [left] = scaling.capacity_problems(parse(s), ramp)
    assert left.startswith("the prefill pool")
    # A GQA shape without its heads is a problem of its own, not a silent pass.
    s["scaling"]["capacity"] = {**GLM_CAPACITY, "kvKind": "gqa"}
    assert (
        scaling.capacity_problems(parse(s), ramp)[-1]
        == "scaling.capacity.kvKind gqa needs kvHeads and headDim"
    )


def test_the_simulation_check_is_off_by_default_and_its_spec_reaches_the_loop():
    assert parse(spec({"mode": "Auto"})).scaling.simulation.mode == "Off"
    s = parse(spec({"mode": "Auto", "simulation": {"mode": "Gate", "timeoutSeconds": 9}}))
    assert (s.scaling.simulation.mode, s.scaling.simulation.timeout_seconds) == ("Gate", 9)
    assert (s.scaling.simulation.requests, s.scaling.simulation.tolerance) == (300, 0.05)
    inputs = scaling.tick_inputs(s, (), {}, None, {})
    assert inputs.simulate == "Gate"


def test_pods_count_as_the_loop_needs():
    pool = {"spec": {"replicas": 3}}
    pods = [
        {
            "metadata": {},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        },
        {"metadata": {}, "status": {"phase": "Pending"}},
        {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Running"}},
    ]
    status = scaling.pool_status("decode", pool, pods, DECODE)
    assert status == PoolStatus(
        "decode", "decode-a", 3, pods=3, ready=1, pending=1, gpus_per_replica=1
    )


def test_the_loop_state_survives_status_and_a_bad_document_starts_fresh():
    state = LoopState()
    pools = (
        PoolStatus("prefill", "prefill-a", 1, 1, 1, 0, 1),
        PoolStatus("decode", "decode-a", 1, 1, 1, 0, 1),
    )
    for t in (1_000.0, 1_060.0):
        state, effects = on_tick(
            t,
            state,
            TickInputs(
                mode="Auto",
                pools=pools,
                profiles=(PREFILL, DECODE),
                demand=Demand(40.0, 2000.0, 200.0, 0.0),
            ),
        )
    back = state_from_dict(state_to_dict(state))
    assert back == state
    doc = scaling.scaling_document(state, effects, "Auto")
    assert (
        doc["recommendation"] == f"{effects.record.replicas['prefill']}:"
        f"{effects.record.replicas['decode']}"
    )
    assert doc["reasons"] and doc["pools"][0]["limit"]
    assert state_from_dict({"history": [{"mode": "Sideways"}]}) == LoopState()
    assert state_from_dict(None) == LoopState()


def test_targets_outside_the_pools_bounds_are_held_and_said():
    pools = (
        PoolStatus("prefill", "prefill-a", 1, 1, 1, 0, 1),
        PoolStatus("decode", "decode-a", 1, 1, 1, 0, 1),
    )
    _, effects = on_tick(
        0.0,
        LoopState(),
        TickInputs(
            mode="Auto",
            pools=pools,
            profiles=(PREFILL, DECODE),
            demand=Demand(77.0, 2000.0, 200.0, 0.25),
            bounds={"prefill": (1, 2), "decode": (1, 8)},
        ),
    )
    assert effects.record.targets["prefill"] == 3 and effects.record.replicas["prefill"] == 2
    assert "prefill: target 3 is above maxReplicas 2" in effects.record.held
    met = next(c for c in effects.conditions if c.type == "DemandMet")
    assert (met.status, met.reason) == ("False", "MaxReplicas")


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"slo": {"longestContextTokens": 65536}}, "exceeds model.maxModelLen"),
        ({"slo": {"itlP90Ms": 40, "interactivityP90": 25}}, "not both"),
        ({"upCooldownSeconds": 900}, "downCooldownSeconds must be at least"),
    ],
)
def test_scaling_problems_say_what_to_fix_and_the_crd_agrees(change, fragment):
    s = spec(change)
    assert_spec_refused(s, fragment)
    assert (
        problems(
            parse(
                spec(
                    {
                        "mode": "Recommend",
                        "profiles": {"prefill": "p", "decode": "d"},
                        "slo": {"longestContextTokens": 8192},
                    }
                )
            )
        )
        == []
    )
