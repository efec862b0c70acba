"""Where the stack puts its engines' model threads: a core each while there
are enough cores, else nowhere in particular (services.stack.engine_cores)."""

from __future__ import annotations

import os

import pytest

from services.stack import engine_cores, engine_env


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 7})


def test_one_core_per_engine_while_there_are_enough(two_cores):
    assert engine_cores(1) == [4]
    assert engine_cores(2) == [4, 7]
    env = engine_env(3, 7)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "7"}


def test_more_engines_than_cores_are_left_unbound(two_cores):
    # Bound round-robin, a 1P2D stack put the prefill and one decode on one
    # core; with the other decode gone, that core ran both while the second idled.
    assert engine_cores(3) == [None, None, None]
    env = engine_env(1, None)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # One model thread each, as when bound: more would spin against each other.
    assert env["OMP_NUM_THREADS"] == "1"
