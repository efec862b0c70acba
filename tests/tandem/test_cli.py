"""`tandem up`'s scheduler flags reach each pool's engines: flags → stack
configuration → engine command line → the engine host's own parser (vLLM's
AsyncEngineArgs, as a real engine parses it). Bad values fail before
anything starts, naming the flag. No engine is started."""

from __future__ import annotations

import pytest

from common.roles import Role
from services.engine.config import parse_settings
from services.stack import POOL_OF_ROLE, vllm_flags
from tandem.cli import build_parser, main, stack_config


def _config(*flags: str):
    return stack_config(build_parser().parse_args(["up", *flags]))


def _engine_args(config, role: str):
    """What an engine of this role would run with (its stack command line
    minus ports and the store), parsed as the engine host parses it."""
    argv = [*vllm_flags(config), *config.pool_flags(role), *config.engine_args]
    module_role = {"prefill": Role.PREFILL, "decode": Role.DECODE, "engine": Role.BOTH}[role]
    return parse_settings(argv, default_role=module_role).engine_args


def test_per_pool_flags_reach_each_pools_engines():
    config = _config(
        "--aggregated",
        "1",
        "--long-prefill-token-threshold",
        "prefill=2048,decode=512",
        "--long-prefill-token-threshold-adaptive",
        "decode=true",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "aggregated=1024",
        "--engine-arg=--block-size=64",
    )
    config.validate()
    prefill, decode, aggregated = (_engine_args(config, role) for role in POOL_OF_ROLE)
    assert (
        prefill.long_prefill_token_threshold,
        prefill.long_prefill_token_threshold_adaptive,
        prefill.max_num_seqs,
        prefill.max_num_batched_tokens,
    ) == (2048, False, 64, None)
    assert (
        decode.long_prefill_token_threshold,
        decode.long_prefill_token_threshold_adaptive,
        decode.max_num_seqs,
        decode.max_num_batched_tokens,
    ) == (512, True, 64, None)
    assert (
        aggregated.long_prefill_token_threshold,
        aggregated.max_num_seqs,
        aggregated.max_num_batched_tokens,
    ) == (0, 64, 1024)
    assert aggregated.block_size == prefill.block_size == 64  # --engine-arg: every engine


def test_without_flags_every_pool_keeps_vllms_defaults():
    config = _config()
    assert config.scheduler == {}
    assert all(config.pool_flags(role) == [] for role in POOL_OF_ROLE)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--max-num-seqs", "prefill=lots"],
            "--max-num-seqs 'prefill=lots': 'lots' is not an integer",
        ),
        (
            ["--long-prefill-token-threshold", "gpu=512"],
            "--long-prefill-token-threshold 'gpu=512': expected VALUE or POOL=VALUE",
        ),
        (
            ["--max-model-len", "4096", "--long-prefill-token-threshold", "decode=8192"],
            "decode pool: --long-prefill-token-threshold 8192: above the context length "
            "(--max-model-len 4096)",
        ),
        (
            ["--long-prefill-token-threshold-adaptive"],
            "prefill pool: --long-prefill-token-threshold-adaptive needs "
            "--long-prefill-token-threshold > 0",
        ),
        (
            ["--max-num-batched-tokens", "aggregated=16", "--max-num-seqs", "aggregated=32"],
            "aggregated pool: --max-num-batched-tokens 16 is below --max-num-seqs 32",
        ),
        (
            ["--engine-arg=--max-num-seqs=8"],
            "engine argument --max-num-seqs=8: a scheduler "
            "setting, set per pool with --max-num-seqs",
        ),
    ],
)
def test_bad_settings_stop_tandem_up_before_anything_starts(flags, says, tmp_path, capsys):
    assert main(["--state-dir", str(tmp_path), "up", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem up: ") and says in err, err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
