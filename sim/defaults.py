"""Profiles shipped with the simulator and the cost models fitted from them
(the file reading lives here, apart from the pure models in ``costs.py``)."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

from operators.planner.profiles import EngineProfile, profiles_from_yaml
from sim.costs import (
    DEFAULT_CTX_SHARE,
    DEFAULT_STEP_SHARE,
    StepModel,
    fit_engine,
    per_gpu,
    rank_speedup,
)

PROFILES = Path(__file__).parent / "profiles"
CPU_PROFILES = PROFILES / "cpu-smollm2.yaml"
# The same engines profiled by `tandem profile` (`python -m bench.cpu_profile`).
CPU_MEASURED_PROFILES = PROFILES / "cpu-smollm2-measured.yaml"
# The same engines' step costs measured term by term (`python -m bench.step_costs`).
CPU_STEP_MODEL = PROFILES / "cpu-smollm2-steps.json"
STEP_MODEL_KIND = "tandem-step-model"
# SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on CPU.
CPU_BLOCK_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def load_profiles(path: Path) -> dict[str, EngineProfile]:
    """Profiles of a file (ConfigMaps as `tandem profile` or the published
    folder write them), by role."""
    return {p.config.role: p for p in profiles_from_yaml(path.read_text())}


def scaled_profile(profile: EngineProfile, gpus: int) -> EngineProfile:
    """The profile of a replica on ``gpus`` GPUs of the same hardware, scaled
    as the simulator scales its pods (``costs.per_gpu``): rates × k for k
    times the GPUs, latencies ÷ the rank's speed-up r (1 when more GPUs are
    more data-parallel ranks), requests in flight × k / r (Little's law)."""
    k = gpus / profile.config.gpus_per_replica
    r = rank_speedup(profile, gpus)

    def over(v: float | None) -> float | None:
        return None if v is None else v / r

    points = tuple(
        replace(
            p,
            concurrency=p.concurrency * k / r,
            request_rate=p.request_rate * k,
            input_tokens_per_s=p.input_tokens_per_s * k,
            output_tokens_per_s=p.output_tokens_per_s * k,
            ttft_p50_s=over(p.ttft_p50_s),
            ttft_p90_s=over(p.ttft_p90_s),
            itl_s=over(p.itl_s),
            in_flight=None if p.in_flight is None else p.in_flight * k / r,
            interactivity_p90=None if p.interactivity_p90 is None else p.interactivity_p90 * r,
        )
        for p in profile.points
    )
    return replace(profile, config=replace(profile.config, gpus_per_replica=gpus), points=points)


def fitted_model(
    profiles: Path = CPU_PROFILES,
    gpus_per_pod: int = 1,
    ctx_share: float = DEFAULT_CTX_SHARE,
    step_share: float = DEFAULT_STEP_SHARE,
) -> StepModel:
    """The step model of one pod on ``gpus_per_pod`` GPUs (cores on CPU), from
    the prefill and the decode profile of a file, each side scaled from the
    GPUs its own profile ran on."""
    found = load_profiles(profiles)
    missing = {"prefill", "decode"} - set(found)
    if missing:
        raise ValueError(f"{profiles}: no {' or '.join(sorted(missing))} profile")
    prefill, decode = found["prefill"], found["decode"]
    model = fit_engine(prefill, decode, ctx_share, step_share)
    p_side = per_gpu(model, prefill, gpus_per_pod)
    d_side = per_gpu(model, decode, gpus_per_pod)
    return StepModel(
        step_s=d_side.step_s,
        token_s=p_side.token_s,
        token_ctx_s=p_side.token_ctx_s,
        seq_s=d_side.seq_s,
        seq_ctx_s=d_side.seq_ctx_s,
    )


def load_step_model(path: Path, gpus_per_pod: int = 1) -> StepModel:
    """A step model measured term by term on one GPU (one core on CPU), as
    ``python -m bench.step_costs --out`` writes it, for a pod of
    ``gpus_per_pod`` of them (every term ``gpus_per_pod`` times faster: one
    rank across the pod)."""
    data = json.loads(path.read_text())
    if data.get("kind") != STEP_MODEL_KIND:
        raise ValueError(f"{path}: not a step model (kind {data.get('kind')!r})")
    measured = data["model"]
    missing = [f.name for f in fields(StepModel) if f.name not in measured]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    return StepModel(**{f.name: float(measured[f.name]) for f in fields(StepModel)}).scaled(
        gpus_per_pod
    )


def with_decode_of(prompt: StepModel, decode: StepModel) -> StepModel:
    """``prompt``'s prompt side with ``decode``'s decode side (the step's
    fixed cost, per sequence, per token of its context)."""
    return replace(prompt, step_s=decode.step_s, seq_s=decode.seq_s, seq_ctx_s=decode.seq_ctx_s)


def engine_model(profiles: Path, step_model: Path | None, gpus_per_pod: int = 1) -> StepModel:
    """The pods' step model: measured term by term when ``step_model`` is
    given, else fitted from the engine profiles."""
    if step_model is not None:
        return load_step_model(step_model, gpus_per_pod)
    return fitted_model(profiles, gpus_per_pod)
