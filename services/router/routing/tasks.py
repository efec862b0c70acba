"""Small asyncio helpers shared by the routing core's background tasks."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, recancel_s: float = 0.1) -> None:
    """Cancel a background task and wait until it has ended.

    The task is cancelled again every ``recancel_s`` while it runs on: library
    code can swallow a cancellation (on Python 3.11, ``asyncio.wait_for``, which
    redis-py uses for socket writes, loses one that races with the inner
    call finishing), and the task would then loop forever. Whatever the task
    ended with is not raised; a cancellation of the caller still propagates.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as never retrieved
