"""The KV leases a prefill engine holds: prompts whose KV it computed for a
decode engine and keeps until that decode pulls it over NIXL, the router
releases it, or the lease (``--kv-lease-s``, renewed by a waiting decode's
heartbeats) runs out.

The leases live in vLLM's NIXL worker (``_reqs_to_send``: request id → expiry;
an entry leaves when every reader pulled it or it expired), in the engine's
worker process. ``KvLeaseWorkerExtension`` is given to vLLM as
``--worker-extension-cls``, so the host can ask each worker for its count over
``collective_rpc``. On SIGTERM a prefill engine waits until none is left
(services/engine/server.py): exiting earlier would strand the KV a decode is
about to pull.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

EXTENSION = "services.engine.leases.KvLeaseWorkerExtension"
_METHOD = "tandem_held_kv_leases"


class KvLeaseWorkerExtension:
    """Mixed into vLLM's worker class; runs in the worker process."""

    def tandem_held_kv_leases(self) -> int:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return 0
        connector = get_kv_transfer_group()
        # A MultiConnector (NIXL beside the KV store) holds its connectors.
        connectors = [connector, *getattr(connector, "sub_connectors", [])]
        return sum(
            len(getattr(getattr(c, "connector_worker", None), "_reqs_to_send", ()))
            for c in connectors
        )


async def held_kv_leases(engine: Any) -> int:
    """Leases held by all of the engine's workers."""
    return sum(await engine.collective_rpc(_METHOD, timeout=10))


async def wait_kv_leases(engine: Any, timeout_s: float, poll_s: float = 0.2) -> int | None:
    """Wait until the engine holds no KV lease, at most ``timeout_s``; returns
    how many are still held (0: all pulled, released or expired), None when
    the engine did not answer in time or died (its KV is gone with it)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    held = None
    try:
        # The bound covers the calls too: an engine stuck inside a step never answers them.
        async with asyncio.timeout(timeout_s):
            held = await held_kv_leases(engine)
            if held:
                log.info(
                    "waiting for %d KV lease(s) to be pulled or released (up to %.0fs)",
                    held,
                    timeout_s,
                )
            while held:
                await asyncio.sleep(poll_s)
                held = await held_kv_leases(engine)
    except TimeoutError:
        if held is None:
            log.warning("the engine did not say which KV leases it holds within %.1fs", timeout_s)
        else:
            log.warning("grace period over with %d KV lease(s) held: their KV is dropped", held)
        return held
    except EngineDeadError:
        log.warning("the engine died: the KV leases it held are gone")
        return None
    return held
