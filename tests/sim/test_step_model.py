"""A step model measured term by term (bench.step_costs) as the simulator's
engines: read, scaled to a pod's GPUs, refused when it is not one."""

from __future__ import annotations

import json

import pytest

from sim.cli import main as sim_main
from sim.costs import StepModel
from sim.defaults import (
    CPU_MEASURED_PROFILES,
    CPU_PROFILES,
    CPU_STEP_MODEL,
    engine_model,
    fitted_model,
    load_step_model,
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
    assert tables[0] == tables[1]
    assert len(set(tables)) == 3
