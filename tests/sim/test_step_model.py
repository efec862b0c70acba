"""A step model measured term by term (bench.step_costs) as the simulator's
engines: read, scaled to a pod's GPUs, refused when it is not one."""

from __future__ import annotations

import json

import pytest

from sim import validation
from sim.cli import main as sim_main
from sim.costs import StepModel
from sim.defaults import (
    CPU_MEASURED_PROFILES,
    CPU_PROFILES,
    CPU_STEP_MODEL,
    engine_model,
    fitted_model,
    load_step_model,
    with_decode_of,
)


def write(path, model: dict, kind: str = "tandem-step-model"):
    path.write_text(json.dumps({"kind": kind, "model": model}))
    return path


def test_a_measured_model_is_read_and_scaled_to_the_pod(tmp_path):
    fields = {"step_s": 0.06, "token_s": 2e-3, "token_ctx_s": 1e-6, "seq_s": 1e-3}
    fields["seq_ctx_s"] = 5e-6
    path = write(tmp_path / "m.json", {**fields, "prefill_fixed_s": 0.0})
    assert load_step_model(path) == StepModel(**fields)
    assert load_step_model(path, gpus_per_pod=4).token_s == pytest.approx(5e-4)
    assert engine_model(path.parent / "none.yaml", path) == StepModel(**fields)


def test_without_a_step_model_the_profiles_are_fitted():
    assert engine_model(CPU_STEP_MODEL.with_name("cpu-smollm2.yaml"), None) == fitted_model()


@pytest.mark.parametrize(
    ("model", "kind", "error"),
    [({"step_s": 1.0}, "tandem-step-model", "no token_s"), ({}, "profile", "not a step model")],
)
def test_what_is_not_a_step_model_is_refused(tmp_path, model, kind, error):
    with pytest.raises(ValueError, match=error):
        load_step_model(write(tmp_path / "bad.json", model, kind))


def test_validation_runs_on_a_step_model_or_on_profiles(capsys):
    tables = []
    for flags in (
        [],
        ["--profiles", str(CPU_MEASURED_PROFILES)],
        ["--step-model", str(CPU_STEP_MODEL)],
        ["--profiles", str(CPU_PROFILES)],
    ):
        assert sim_main(["validate", *flags]) == 0
        tables.append(capsys.readouterr().out)
    assert "| 6 sessions, 64 blocks | cost |" in tables[0]
    # The default takes its decode side from the step model, its prompt side
    # from the measured profile: neither's table alone.
    assert len(set(tables)) == 4


def test_a_models_decode_side_replaces_the_others():
    prompt, decode = fitted_model(CPU_MEASURED_PROFILES), load_step_model(CPU_STEP_MODEL)
    both = with_decode_of(prompt, decode)
    assert both.step([], 3, 5000) == decode.step([], 3, 5000)
    assert both.prefill_s(512, 1024) == prompt.prefill_s(512, 1024)


def test_the_runs_engines_decode_a_lone_sequence_as_the_runs_did():
    """A sequence decoding alone on its engine (nothing prefilling on either)
    took 74 ms a token in the recorded runs (median of 53 requests, 59-89 ms
    from the 10th to the 90th percentile, about 1,700 tokens of context):
    the validation's engines step within that range, the profile's decode
    fit (a line through 3.8-8.4 requests in flight) below it."""
    assert 0.059 <= validation.engines_model().step([], 1, 1700) <= 0.089
    assert fitted_model(CPU_MEASURED_PROFILES).step([], 1, 1700) < 0.059
