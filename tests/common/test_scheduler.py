"""Scheduler settings per pool: parsing, the vLLM flags they become, and
validation errors that name the flag at fault. Pure; no engine."""

from __future__ import annotations

import pytest

from common.scheduler import (
    POOLS,
    SETTINGS,
    SchedulerSettings,
    by_pool,
    flag_name,
    parse_per_pool,
    scheduler_flag,
)


def test_settings_are_vllms_names():
    assert [flag_name(s) for s in SETTINGS] == [
        "--long-prefill-token-threshold",
        "--long-prefill-token-threshold-adaptive",
        "--max-num-batched-tokens",
        "--max-num-seqs",
    ]


def test_one_value_sets_every_pool_and_pairs_set_the_pools_named():
    assert parse_per_pool("long_prefill_token_threshold", "512") == dict.fromkeys(POOLS, 512)
    assert parse_per_pool("long_prefill_token_threshold", "prefill=2048, decode=0") == {
        "prefill": 2048,
        "decode": 0,
    }
    assert parse_per_pool("long_prefill_token_threshold_adaptive", "aggregated=on") == {
        "aggregated": True
    }
    assert parse_per_pool("long_prefill_token_threshold_adaptive", "false") == dict.fromkeys(
        POOLS, False
    )


@pytest.mark.parametrize(
    ("setting", "text", "says"),
    [
        ("max_num_seqs", "many", "--max-num-seqs 'many': 'many' is not an integer"),
        ("max_num_seqs", "prefill=8,gpu=4", "POOL one of prefill, decode, aggregated"),
        (
            "max_num_seqs",
            "decode=8,decode=4",
            "--max-num-seqs 'decode=8,decode=4': pool decode given twice",
        ),
        ("long_prefill_token_threshold_adaptive", "decode", "is not true or false"),
    ],
)
def test_parse_errors_name_the_flag(setting, text, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")) as err:
        parse_per_pool(setting, text)
    assert flag_name(setting) in str(err.value)


def test_settings_become_vllm_flags_and_unset_ones_are_left_to_vllm():
    assert SchedulerSettings().vllm_flags() == []
    assert SchedulerSettings(long_prefill_token_threshold=512, max_num_seqs=32).vllm_flags() == [
        "--long-prefill-token-threshold",
        "512",
        "--max-num-seqs",
        "32",
    ]
    assert SchedulerSettings(
        long_prefill_token_threshold=512, long_prefill_token_threshold_adaptive=False
    ).vllm_flags() == [
        "--long-prefill-token-threshold",
        "512",
        "--no-long-prefill-token-threshold-adaptive",
    ]


def test_by_pool_groups_values_per_pool():
    pools = by_pool(
        {
            "long_prefill_token_threshold": {"prefill": 2048, "decode": 512},
            "max_num_seqs": {"decode": 64},
        }
    )
    assert pools == {
        "prefill": SchedulerSettings(long_prefill_token_threshold=2048),
        "decode": SchedulerSettings(long_prefill_token_threshold=512, max_num_seqs=64),
    }


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (
            SchedulerSettings(long_prefill_token_threshold=-1),
            "--long-prefill-token-threshold -1: must be >= 0",
        ),
        (SchedulerSettings(max_num_seqs=0), "--max-num-seqs 0: must be >= 1"),
        (SchedulerSettings(max_num_batched_tokens=0), "--max-num-batched-tokens 0: must be >= 1"),
        (
            SchedulerSettings(long_prefill_token_threshold=5000),
            "--long-prefill-token-threshold 5000: above the context length (--max-model-len 4096)",
        ),
        (
            SchedulerSettings(long_prefill_token_threshold_adaptive=True),
            "--long-prefill-token-threshold-adaptive needs --long-prefill-token-threshold > 0",
        ),
        (
            SchedulerSettings(max_num_batched_tokens=64, max_num_seqs=128),
            "--max-num-batched-tokens 64 is below --max-num-seqs 128",
        ),
    ],
)
def test_problems_name_the_flag(settings, says):
    assert any(p.startswith(says) for p in settings.problems(max_model_len=4096)), (
        settings.problems(max_model_len=4096)
    )


def test_sound_settings_have_no_problems():
    assert (
        SchedulerSettings(
            long_prefill_token_threshold=512,
            long_prefill_token_threshold_adaptive=True,
            max_num_batched_tokens=1024,
            max_num_seqs=64,
        ).problems(max_model_len=4096)
        == []
    )


def test_scheduler_flags_are_recognised_in_any_spelling():
    assert scheduler_flag("--max-num-seqs=8") == "--max-num-seqs"
    assert scheduler_flag("--max_num_seqs") == "--max-num-seqs"
    assert (
        scheduler_flag("--no-long-prefill-token-threshold-adaptive")
        == "--long-prefill-token-threshold-adaptive"
    )
    assert scheduler_flag("--block-size=64") is None
    assert scheduler_flag("8") is None
