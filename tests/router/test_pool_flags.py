"""Pools on the command line: --prefill POOL=ADDR and --prefill-pool-for."""

import pytest

from common.roles import Role
from common.settings import to_argv
from services.router.config import parse_settings
from services.router.routing import PodSpec
from services.router.routing.classes import ClassPool


def test_pods_carry_their_pool_and_classes_name_pools():
    s = parse_settings(
        [
            "--prefill",
            "fresh=p:1,p:2",
            "--decode",
            "d:1",
            "--prefill-pool-for",
            "long=fresh",
            "--long-request-tokens",
            "2048",
            "--kv-events",
            "p:1=tcp://p:5701",
        ]
    )
    assert s.pods() == [
        PodSpec("p:1", Role.PREFILL, "tcp://p:5701", pool="fresh"),
        PodSpec("p:2", Role.PREFILL),
        PodSpec("d:1", Role.DECODE),
    ]
    policy = s.routing.policy
    assert (policy.prefill_pool_for, policy.long_request_tokens) == (
        (ClassPool("long", "fresh"),),
        2048,
    )
    # The embedded stack passes settings on as flags.
    assert to_argv(policy)[-4:] == [
        "--long-request-tokens",
        "2048",
        "--prefill-pool-for",
        "long=fresh",
    ]


def test_a_class_pool_without_prefill_pods_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_settings(["--prefill", "p:1", "--decode", "d:1", "--prefill-pool-for", "long=fresh"])
    assert "long=fresh: no --prefill pod of that pool" in capsys.readouterr().err
