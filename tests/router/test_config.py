"""The router's settings from its flags (config.py). No engines."""

from __future__ import annotations

import pytest

from services.router.config import parse_settings


def test_settings_accept_repeated_and_comma_separated_pods():
    s = parse_settings(["--prefill", "a:1,b:2", "--decode", "c:3", "--decode", "d:4"])
    assert s.prefill == ["a:1", "b:2"] and s.decode == ["c:3", "d:4"]


def test_settings_without_pods_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_settings([])
    assert "--decode" in capsys.readouterr().err


def test_prefill_without_decode_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_settings(["--prefill", "a:1"])
    assert "--prefill: needs at least one --decode" in capsys.readouterr().err
