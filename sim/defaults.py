"""Profiles shipped with the simulator and the cost models fitted from them
(the file reading lives here, apart from the pure models in ``costs.py``)."""

from __future__ import annotations

from pathlib import Path

from operators.planner.profiles import EngineProfile, profiles_from_yaml
from sim.costs import StepModel, fit_engine, per_gpu

PROFILES = Path(__file__).parent / "profiles"
CPU_PROFILES = PROFILES / "cpu-smollm2.yaml"
# SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on CPU.
CPU_BLOCK_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def load_profiles(path: Path) -> dict[str, EngineProfile]:
    """Profiles of a file (ConfigMaps as `tandem profile` or the published
    folder write them), by role."""
    return {p.config.role: p for p in profiles_from_yaml(path.read_text())}


def cpu_model(cores: int = 1, path: Path = CPU_PROFILES) -> StepModel:
    """One CPU engine pinned to ``cores`` cores, fitted from the shipped CPU profiles."""
    profiles = load_profiles(path)
    prefill, decode = profiles["prefill"], profiles["decode"]
    model = fit_engine(prefill, decode)
    # The two profiles ran on different core counts: fit_engine keeps each
    # side's own; bring both to `cores`.
    p_side = per_gpu(model, prefill, cores)
    d_side = per_gpu(model, decode, cores)
    return StepModel(
        step_s=d_side.step_s,
        token_s=p_side.token_s,
        token_ctx_s=p_side.token_ctx_s,
        seq_s=d_side.seq_s,
        seq_ctx_s=d_side.seq_ctx_s,
    )
