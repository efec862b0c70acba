"""Synthetic engine profiles for the planner's tests: a replica whose request
rate rises with load to a saturation figure while its latencies grow, in the
shape real sweeps show (throughput flattens, TTFT and per-token time climb)."""

from __future__ import annotations

from operators.planner.profiles import (
    EngineConfig,
    EngineProfile,
    Parallelism,
    PoolRole,
    ProfilePoint,
    validate,
)

# The fake engine's latency in the profiling tests: first token after 200 ms,
# then one every 20 ms.
FIRST_TOKEN_MS, TOKEN_DELAY_MS = 200.0, 20.0
# Share of saturation reached at each load level, and how latency grows there.
RAMP = (0.25, 0.5, 0.75, 0.9, 1.0, 1.0)
LATENCY_GROWTH = (1.0, 1.1, 1.3, 1.8, 3.0, 6.0)


def ramp_profile(
    name: str,
    role: PoolRole,
    saturation_rps: float,
    *,
    input_tokens: float = 2000.0,
    output_tokens: float = 200.0,
    hit_rate: float = 0.0,
    gpus: int = 1,
    ttft_s: float = 0.2,
    interactivity: float = 60.0,
    kv_capacity_tokens: int | None = None,
    model: str = "m",
    hardware: str = "gpu",
    parallelism: Parallelism | None = None,
) -> EngineProfile:
    """Per-replica points; a prefill profile's requests produce one token, as
    `tandem profile --role prefill` replays them."""
    out = 1.0 if role == "prefill" else output_tokens
    points = []
    for i, (share, growth) in enumerate(zip(RAMP, LATENCY_GROWTH)):
        rate = saturation_rps * share
        ttft = ttft_s * growth
        per_token = growth / interactivity
        time_in_pool = (
            ttft
            if role == "prefill"
            else (out * per_token if role == "decode" else ttft + out * per_token)
        )
        points.append(
            ProfilePoint(
                concurrency=float(2**i),
                request_rate=rate,
                input_tokens_per_s=rate * input_tokens,
                output_tokens_per_s=rate * out,
                ttft_p50_s=ttft * 0.6,
                ttft_p90_s=ttft,
                hit_rate=hit_rate,
                in_flight=rate * time_in_pool,
                itl_s=per_token,
                interactivity_p90=1.0 / per_token,
            )
        )
    config = EngineConfig(
        name=name,
        role=role,
        model=model,
        gpus_per_replica=gpus,
        hardware=hardware,
        parallelism=parallelism or Parallelism(),
        kv_capacity_tokens=kv_capacity_tokens,
    )
    return validate(
        EngineProfile(
            config=config, points=tuple(points), source="published", workload="synthetic ramp"
        )
    )
