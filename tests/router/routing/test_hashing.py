"""Block hashes against vLLM's own functions (no mocks: vLLM's hashing code runs here)."""

import random

import pytest

# vLLM is required here (no skip): this is the cross-check against the engine's code.
import vllm.v1.core.kv_cache_utils as kv_cache_utils  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402

from services.router.routing.hashing import BlockHasher, to_event_hash


def vllm_hashes(tokens, block_size, algo, extra_first=None, extra_all=None):
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    parent = None
    out = []
    for i, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        keys = list(extra_all or [])
        if i == 0 and extra_first:
            keys += extra_first
        parent = kv_cache_utils.hash_block_tokens(
            fn, parent, tokens[start : start + block_size], tuple(keys) if keys else None
        )
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("block_size", [32, 128])
def test_matches_vllm(algo, block_size, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rng = random.Random(7)
    tokens = [rng.randrange(49152) for _ in range(block_size * 5 + 17)]
    ours = BlockHasher(block_size, algo).block_hashes(tokens)
    assert ours == vllm_hashes(tokens, block_size, algo)
    assert len(ours) == 5


def test_cache_salt_and_lora_match_vllm(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(300))
    hasher = BlockHasher(64)
    salted = hasher.block_hashes(tokens, cache_salt="tenant-a")
    assert salted == vllm_hashes(tokens, 64, "sha256", extra_first=[("cache_salt", "tenant-a")])
    assert salted[0] != hasher.block_hashes(tokens)[0]
    lora = hasher.block_hashes(tokens, cache_salt="s", lora=("ad", "/p"))
    assert lora == vllm_hashes(
        tokens, 64, "sha256", extra_first=[("cache_salt", "s")], extra_all=[("lora", "ad", "/p")]
    )


def test_request_block_hasher_agrees(monkeypatch):
    """vLLM's per-request hasher (what the scheduler runs) on a real Request object."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    from vllm import SamplingParams
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    tokens = list(range(1000, 1000 + 4 * 32 + 5))
    try:
        req = Request(
            request_id="r",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt="salty",
            block_hasher=kv_cache_utils.get_request_block_hasher(32, fn),
        )
    except TypeError as err:  # constructor drifted between vLLM versions: say so loudly
        pytest.fail(f"vllm.v1.request.Request signature changed: {err}")
    assert list(req.block_hashes) == BlockHasher(32).block_hashes(tokens, cache_salt="salty")


def test_seed_from_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    tokens = list(range(64))
    assert BlockHasher(32).seed == "123"
    assert BlockHasher(32).block_hashes(tokens) == vllm_hashes(tokens, 32, "sha256")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher(32).seed == "vllm-none-hash"


def test_event_hash_is_low_64_bits():
    h = bytes(range(32))
    assert to_event_hash(h) == int.from_bytes(h[-8:], "big")
    assert to_event_hash(h) == kv_cache_utils.maybe_convert_block_hash(h)


def test_rejects_unreproducible_algorithms():
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher(32, "xxhash")
