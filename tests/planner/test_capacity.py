"""The capacity check (pure arithmetic, no mocks)."""

from __future__ import annotations

import pytest

from operators.planner.capacity import (
    GIB,
    ContextDemand,
    KvShape,
    MemoryBudget,
    capacity_refusals,
    check_capacity,
    persistent_kv_gib,
)
from operators.planner.profiles import Parallelism
from operators.planner.solver import Demand, Problem, solve
from tests.planner.synthetic import ramp_profile

# The seed's GLM-5.3 note gives totals only: a 1M-token context needs ~53.4 GiB
# of FP8 KV per GPU against ~15 GiB free, and DCP8 brings it to ~6.7 GiB.
# Dimensions that give exactly these figures:
# * MLA, as in the GLM-5/DeepSeek-V3 family: per token and layer the KV is a
#   512-value compressed latent plus a 64-value decoupled RoPE key, 576 values,
#   one byte each in FP8. The latent is shared by every query head, so TP does
#   not split it: each of the 8 TP ranks holds the whole sequence's KV — which
#   is why the figure is *per GPU* at TP8 and why only DCP divides it.
# * "1M tokens" as a 1M-context model card means it: 2^20 = 1,048,576 tokens.
# * 53.4 GiB × 2^30 / (576 B × 2^20 tokens) = 94.9 → 95 layers:
#   95 × 576 × 2^20 B = 53.44 GiB, and / 8 (DCP8) = 6.68 GiB.
# * ~15 GiB free: an H200 (141 GB = 131.3 GiB) at vLLM's default
#   gpu_memory_utilization 0.9 is 118.2 GiB; FP8 weights of a ~744B-parameter
#   model over 8 GPUs take 744e9 / 8 B = 86.6 GiB each; 16.6 GiB reserved for
#   activations, CUDA graphs and NCCL leaves 15.0 GiB for KV.
GLM = KvShape(layers=95, kind="mla", kv_bytes=1.0, latent_dim=512 + 64)
H200_8WAY = MemoryBudget.from_gpu(
    hbm_gib=141e9 / GIB, utilization=0.9, weights_gib_per_gpu=744e9 / 8 / GIB, reserved_gib=16.6
)
ONE_M = ContextDemand(context_tokens=2**20)


def test_glm_one_million_tokens_overflows_at_tp8_and_names_persistent_kv():
    assert H200_8WAY.gpu_free_gib == pytest.approx(15.0, abs=0.05)
    v = check_capacity(GLM, Parallelism(tp=8), H200_8WAY, ONE_M)
    assert not v.fits
    assert v.overflowing == "persistent KV"
    assert v.term("persistent KV") == pytest.approx(53.44, abs=0.01)
    assert (
        "persistent KV 53.4 GiB per GPU (MLA's latent KV is replicated on every TP rank)"
        in v.reason
    )
    assert "exceeds the 15.0 GiB free per GPU" in v.reason
    # The least DCP that fits: DCP4 → 13.4 GiB + the 1.1 GiB gather < 15 GiB.
    assert v.suggestion == "DCP4 brings persistent KV to 13.4 GiB per GPU and fits"


def test_glm_dcp8_fits():
    v = check_capacity(GLM, Parallelism(tp=8, dcp=8), H200_8WAY, ONE_M)
    assert v.fits
    assert v.term("persistent KV") == pytest.approx(6.68, abs=0.01)
    # One layer of the whole context gathered in BF16: 2^20 × 576 × 2 B = 1.125 GiB.
    assert v.term("temporary gather") == pytest.approx(1.125)


def test_pcp_shards_tokens_and_the_gather_can_overflow_alone():
    v = check_capacity(GLM, Parallelism(tp=8, dcp=8), MemoryBudget(gpu_free_gib=7.0), ONE_M)
    assert not v.fits  # 6.68 + 1.125 > 7
    assert v.overflowing == "persistent KV"
    assert v.suggestion is not None and v.suggestion.startswith("DCP8 with PCP2 (16 GPUs")
    chunked = ContextDemand(context_tokens=2**20, gather_tokens=8192)
    assert check_capacity(GLM, Parallelism(tp=8, dcp=8), MemoryBudget(7.0), chunked).fits
    huge_gather = check_capacity(
        GLM, Parallelism(tp=8, dcp=8), MemoryBudget(8.0), ContextDemand(2**20, gather_tokens=2**23)
    )
    assert huge_gather.overflowing == "temporary gather"


def test_gqa_heads_split_by_tp_up_to_the_head_count():
    llama = KvShape(layers=80, kind="gqa", kv_bytes=2.0, kv_heads=8, head_dim=128)
    # 2 × 8 × 128 values × 2 B × 80 layers = 327,680 B per token.
    assert persistent_kv_gib(llama, Parallelism(tp=1), 2**15) == pytest.approx(10.0)
    assert persistent_kv_gib(llama, Parallelism(tp=8), 2**15) == pytest.approx(1.25)
    # TP16 replicates heads beyond 8: no further split, but DCP2 uses the copies.
    assert persistent_kv_gib(llama, Parallelism(tp=16), 2**15) == pytest.approx(1.25)
    assert persistent_kv_gib(llama, Parallelism(tp=16, dcp=2), 2**15) == pytest.approx(0.625)
    # Pipeline stages hold their own layers; DP does not split a sequence.
    assert persistent_kv_gib(llama, Parallelism(tp=8, pp=2), 2**15) == pytest.approx(0.625)
    assert persistent_kv_gib(llama, Parallelism(tp=8, dp=4), 2**15) == pytest.approx(1.25)


def test_host_pools_checked_per_node():
    ctx = ContextDemand(context_tokens=1024, host_pool_gib=600.0)
    v = check_capacity(GLM, Parallelism(tp=8), MemoryBudget(15.0, host_free_gib=512.0), ctx)
    assert not v.fits and v.overflowing == "host pools"
    assert "host pools 600.0 GiB per node exceed the 512.0 GiB" in v.reason


def test_refusals_feed_the_solver():
    pre = ramp_profile(
        "prefill-tp8",
        "prefill",
        2.0,
        gpus=8,
        model="glm",
        hardware="h200",
        parallelism=Parallelism(tp=8),
    )
    dec = ramp_profile(
        "decode-tp8",
        "decode",
        4.0,
        gpus=8,
        model="glm",
        hardware="h200",
        parallelism=Parallelism(tp=8),
    )
    dcp = ramp_profile(
        "decode-tp8-dcp8",
        "decode",
        3.0,
        gpus=8,
        model="glm",
        hardware="h200",
        parallelism=Parallelism(tp=8, dcp=8),
    )
    refused = capacity_refusals((pre, dec, dcp), {"glm": GLM}, {"h200": H200_8WAY}, ONE_M)
    assert set(refused) == {"prefill-tp8", "decode-tp8"}
    assert "DCP4 brings persistent KV" in refused["decode-tp8"]
    d = solve(Problem((pre, dec, dcp), Demand(1.0, 2000.0, 200.0), refused=refused))
    assert d.plan is None and d.binding == "capacity"
    pre_dcp = ramp_profile(
        "prefill-tp8-dcp8",
        "prefill",
        1.5,
        gpus=8,
        model="glm",
        hardware="h200",
        parallelism=Parallelism(tp=8, dcp=8),
    )
    profiles = (pre, dec, dcp, pre_dcp)
    refused = capacity_refusals(profiles, {"glm": GLM}, {"h200": H200_8WAY}, ONE_M)
    d = solve(Problem(profiles, Demand(1.0, 2000.0, 200.0), refused=refused))
    assert d.plan is not None
    assert [p.config for p in d.plan.pools] == ["prefill-tp8-dcp8", "decode-tp8-dcp8"]
    assert any(r.startswith("not used: decode-tp8: persistent KV 53.4 GiB") for r in d.reasons)
