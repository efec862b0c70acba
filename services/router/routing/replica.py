"""One router replica's routing: the pure core with the shared-state store
around it, read before each decision and written after it.

The core decides synchronously; the store does the I/O (Redis, or nothing
for a replica alone). This is the whole of the sequence, so every caller
(the request path, tests, a simulator) runs it the same way.
"""

from __future__ import annotations

import time

from services.router.routing.core import RouteDecision, RouteRequest, RoutingCore
from services.router.routing.shared_state import LocalState


class Replica:
    def __init__(self, core: RoutingCore, state: LocalState) -> None:
        self.core = core
        self.state = state

    async def route(
        self, req: RouteRequest, now: float, stages: dict[str, float] | None = None
    ) -> RouteDecision:
        """Read the session's binding and the other replicas' load, decide,
        then publish this replica's new load and the binding. ``stages`` (if
        given) gets the seconds spent hashing the prompt's blocks, in the
        index and policy, and reading and writing the shared state."""
        start = time.perf_counter()
        shared = await self.state.read(req.session, now)
        read = time.perf_counter()
        hashes = self.core.block_hashes(req)
        hashed = time.perf_counter()
        decision = self.core.route(req, shared, now, hashes)
        decided = time.perf_counter()
        await self.state.write(decision.writes, now)
        if stages is not None:
            stages["hash"] = hashed - read
            stages["index"] = decided - hashed
            stages["state"] = (read - start) + (time.perf_counter() - decided)
        return decision

    async def report_prefill(
        self, decision: RouteDecision, now: float, pod: str | None = None
    ) -> None:
        await self.state.write(self.core.report_prefill(decision, now, pod), now)

    async def report_failure(
        self, decision: RouteDecision, pod: str, now: float, why: str = "a call failed"
    ) -> bool:
        """A call to ``pod`` failed before its first byte: count it and free
        what ``decision`` holds (route again without the pod). True: ejected."""
        ejected = self.core.report_failure(pod, now, why)
        await self.release(decision, now)
        return ejected

    async def release(self, decision: RouteDecision, now: float) -> None:
        await self.state.write(self.core.release(decision), now)
