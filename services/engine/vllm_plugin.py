"""vLLM plugin: keeps a CPU engine's model on the cores it was bound to, and
gives NIXL's progress thread a poll timeout instead of a spin.

On CPU, vLLM's NIXL connector pins the thread that creates it to the last core
of each NUMA node ("reserve different cores for start_load_kv() from
model_forward()", ``NixlBaseConnectorWorker.__init__``). That thread is the
worker's main thread, which also runs the model (OpenMP's master thread), so
every P/D engine's model ends up on the last core whatever
``VLLM_CPU_OMP_THREADS_BIND`` said: on this 2-core machine the prefill engine,
bound to core 0, ran on core 1 beside the decode engine and prefilled 3-5x
slower whenever the decode engine was busy (bench/long_prefill.py, P/D: a
1,364-token first turn took 40 s to prefill against 10 s aggregated). The
plugin gives the thread its affinity back once the connector is built; the
NIXL threads the connector starts keep the reserved core.

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

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

NIXL_DELAY_ENV = "TANDEM_NIXL_PROGRESS_DELAY_US"


def register() -> None:
    _keep_model_thread_binding()
    delay_us = int(os.environ.get(NIXL_DELAY_ENV, "0"))
    if delay_us > 0:
        _set_nixl_progress_delay(delay_us)


def keeping_thread_affinity(init: Callable[..., None]) -> Callable[..., None]:
    """`init` made to leave the calling thread's CPU affinity as it found it."""
    if getattr(init, "keeps_thread_affinity", False):
        return init

    @functools.wraps(init)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        cpus = os.sched_getaffinity(0)  # 0: the calling thread
        try:
            init(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, cpus)

    wrapper.keeps_thread_affinity = True  # type: ignore[attr-defined]
    return wrapper


def _keep_model_thread_binding() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    except ImportError:  # no NIXL connector in this vLLM
        return
    worker = base_worker.NixlBaseConnectorWorker
    worker.__init__ = keeping_thread_affinity(worker.__init__)  # type: ignore[method-assign]


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
