"""Profiles shipped with the simulator and the cost models fitted from them
(the file reading lives here, apart from the pure models in ``costs.py``)."""

from __future__ import annotations

from dataclasses import replace
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
