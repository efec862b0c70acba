"""Settings dataclasses → flags and environment variables (common/settings.py),
and the services that use them: each default written once, each flag named
by the one unit-suffix rule. Plain argparse, no processes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from common.roles import Role
from common.settings import (
    SettingError,
    add_arguments,
    flag_of,
    from_arguments,
    group,
    setting,
    to_argv,
)


@dataclass(frozen=True)
class Inner:
    depth: int = setting(3, "how deep")
    not_a_flag: float = 0.5


@dataclass(frozen=True)
class Outer:
    port: int = setting(8000, "HTTP port")
    wait_s: float = setting(1.5, "seconds to wait")
    role: Role = setting(Role.BOTH, "what it does")
    names: list[str] = setting([], "names (repeat or comma-separate)", flag="--name")
    token: str | None = setting(None, "a token")
    fast: bool = setting(False, "go fast")
    inner: Inner = group(Inner, "inner things", "about the inner things")
    internal: tuple[str, ...] = field(default=())


def parse(argv, environ=None, **kw):
    parser = argparse.ArgumentParser()
    add_arguments(parser, Outer, "T_", environ=environ or {}, **kw)
    return from_arguments(Outer, parser.parse_args(argv)), parser


def test_defaults_flags_and_units():
    s, parser = parse([])
    assert s == Outer()
    s, _ = parse(
        [
            "--port",
            "9",
            "--wait-s",
            "2",
            "--role",
            "prefill",
            "--name",
            "a,b",
            "--name",
            "c",
            "--token",
            "t",
            "--fast",
            "yes",
            "--depth",
            "7",
        ]
    )
    assert s == Outer(
        port=9,
        wait_s=2.0,
        role=Role.PREFILL,
        names=["a", "b", "c"],
        token="t",
        fast=True,
        inner=Inner(depth=7),
    )
    text = parser.format_help()
    assert "--wait-s SECONDS" in text and "env T_WAIT_S" in text and "default: 1.5" in text
    assert "inner things" in text and "--not-a-flag" not in text and "--internal" not in text


def test_environment_replaces_the_default_and_flags_win():
    env = {"T_PORT": "81", "T_NAME": "x, y", "T_ROLE": "decode", "T_FAST": "true"}
    s, _ = parse([], env)
    assert (s.port, s.names, s.role, s.fast) == (81, ["x", "y"], Role.DECODE, True)
    s, _ = parse(["--port", "82", "--name", "z"], env)
    assert (s.port, s.names) == (82, ["x", "y", "z"])  # lists add up


def test_a_bad_environment_value_names_flag_and_variable():
    with pytest.raises(SettingError, match=r"--port \(env T_PORT\): bad value 'eighty'"):
        parse([], {"T_PORT": "eighty"})


def test_per_entry_point_default_and_flag_names():
    s, _ = parse([], defaults={"role": Role.DECODE})
    assert s.role == Role.DECODE
    assert flag_of(Outer, "names") == "--name" and flag_of(Inner, "not_a_flag") == "not_a_flag"


def test_to_argv_round_trips():
    changed = Outer(port=9, names=["a", "b"], fast=True)
    argv = to_argv(changed, always=("wait_s",))
    assert argv == [
        "--port",
        "9",
        "--wait-s",
        "1.5",
        "--name",
        "a",
        "--name",
        "b",
        "--fast",
        "true",
    ]
    assert parse(argv)[0] == changed


def test_router_flags_come_from_the_settings():
    from services.router.config import parse_settings

    s = parse_settings(
        [
            "--engine",
            "e:1",
            "--poll-interval-s",
            "0.5",
            "--policy",
            "prefix",
            "--redis-timeout-s",
            "2",
            "--block-size",
            "32",
        ]
    )
    assert s.poll_interval_s == 0.5 and s.routing.redis_timeout_s == 2.0
    assert s.routing.policy.policy == "prefix" and s.routing.block_size == 32
    assert [(p.name, p.role) for p in s.pods()] == [("e:1", Role.BOTH)]


def test_router_validation_names_the_flag(capsys):
    from services.router.config import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(["--engine", "e:1", "--block-size", "0"])
    assert "--block-size: 0: must be positive" in capsys.readouterr().err
