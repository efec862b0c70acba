"""The supervisor starts the store's processes ahead of itself in priority
(a real child process; no Mooncake needed)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from common.mooncake import Command
from services.kvstore.supervisor import ManagedProcess, autogroup_nice


def _start_sleeper(tmp_path, boost: int) -> tuple[int, int | None, int]:
    """(nice the child got, its autogroup's nice, the nice it was meant to get)."""

    async def ready() -> bool:
        return True

    proc = ManagedProcess(
        Command("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], {}),
        ready,
        tmp_path,
        start_timeout_s=10,
        backoff_s=1,
        priority_boost=boost,
    )

    async def run() -> tuple[int, int | None]:
        await proc.start()
        try:
            pid = proc.status.pid
            assert pid is not None
            return os.getpriority(os.PRIO_PROCESS, pid), autogroup_nice(pid)
        finally:
            await proc.stop()

    got, group = asyncio.run(run())
    return got, group, max(-20, os.getpriority(os.PRIO_PROCESS, 0) - boost)


def test_children_run_ahead_of_the_supervisor_or_it_says_why_not(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="services.kvstore.supervisor"):
        got, group, wanted = _start_sleeper(tmp_path, boost=3)
    if got == wanted and group in (None, -3):
        assert "priority-boost" not in caplog.text
    else:  # no privilege to raise priority here: run on, and say so
        assert got == os.getpriority(os.PRIO_PROCESS, 0)
        assert "sleeper runs at nice" in caplog.text and "--priority-boost 3" in caplog.text


def test_no_boost_leaves_the_priority_alone(tmp_path):
    got, group, wanted = _start_sleeper(tmp_path, boost=0)
    assert got == wanted == os.getpriority(os.PRIO_PROCESS, 0)
    assert group == autogroup_nice(os.getpid())
