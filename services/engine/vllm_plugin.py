"""vLLM plugin: gives NIXL's progress thread a poll timeout instead of a spin.

NIXL's UCX backend runs a progress thread that waits on the UCX workers'
event file descriptors with ``poll(timeout=pthrDelay)``. nixl's Python API
hard-codes ``pthrDelay=0``, so the thread never sleeps: on a CPU-only machine
each idle engine burns a whole core (two idle P/D engines measured at ~97%
each on 2 cores), starving the engines' models. The thread cannot simply be
off: over UCX's TCP transport an idle prefill must keep progressing or the
decode's KV pull times out (seen: the pull failed after ~5 min). With a delay
the thread still wakes at once on every UCX event and otherwise re-polls
every ``delay`` (NIXL's guard against rare missed wake-ups).

(vLLM's engine-core/worker shared-memory queues also spin, for 1 s after
each message. Making them sleep instead was measured and rejected: decode
inter-token latency doubled, 138 → 260 ms per token.)

vLLM loads ``vllm.general_plugins`` entry points in every process it starts
(engine core, workers); that is how the setting reaches the worker that
creates the NIXL agent. The engine host sets ``TANDEM_NIXL_PROGRESS_DELAY_US``
from ``--nixl-progress-delay-us``; without it this plugin changes nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

NIXL_DELAY_ENV = "TANDEM_NIXL_PROGRESS_DELAY_US"


def register() -> None:
    delay_us = int(os.environ.get(NIXL_DELAY_ENV, "0"))
    if delay_us > 0:
        _set_nixl_progress_delay(delay_us)


class BindingsWithDelay:
    """nixl's native bindings module, except that new agents get a delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self.bindings = bindings
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (nixl's name)
        if config.useProgThread and config.pthrDelay == 0:
            config.pthrDelay = self.delay_us
        return self.bindings.nixlAgent(name, config)


def _set_nixl_progress_delay(delay_us: int) -> None:
    try:
        from vllm.distributed import nixl_utils

        agent_cls = nixl_utils.NixlWrapper
    except ImportError:
        return
    if agent_cls is None:  # NIXL not installed: nothing to tune
        return
    api = sys.modules[agent_cls.__module__]
    if isinstance(api.nixlBind, BindingsWithDelay):
        api.nixlBind.delay_us = delay_us
    else:
        api.nixlBind = BindingsWithDelay(api.nixlBind, delay_us)

