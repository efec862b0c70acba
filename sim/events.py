"""The discrete-event core: a heap of timed callbacks on a simulated clock.

Events at the same time run in the order they were scheduled (a sequence
number breaks ties), so a run is a function of its inputs and seed alone.
No I/O, no wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

# (time, sequence number, action): tuples compare fastest, and the sequence
# number, unique, keeps the comparison off the action.
_Event = tuple[float, int, Callable[[], None]]


INTERRUPT_EVERY = 1000


class Interrupted(Exception):
    """The run's ``interrupt`` said stop."""


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = 0
        self.processed = 0

    def at(self, time: float, action: Callable[[], None]) -> None:
        """Run ``action`` at simulated ``time`` (not before now)."""
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        heapq.heappush(self._heap, (time, self._seq, action))
        self._seq += 1

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, delay), action)

    def run(
        self,
        until: float | None = None,
        max_events: int | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> None:
        """Run events in time order until none is left (or ``until``, or
        ``max_events``); ``interrupt``, asked every ``INTERRUPT_EVERY`` events,
        stops the run with ``Interrupted`` when it says so (a caller's deadline)."""
        while self._heap:
            if interrupt is not None and self.processed % INTERRUPT_EVERY == 0 and interrupt():
                raise Interrupted(f"interrupted at {self.now:.1f} s after {self.processed} events")
            if until is not None and self._heap[0][0] > until:
                self.now = until
                return
            if max_events is not None and self.processed >= max_events:
                raise RuntimeError(f"simulation passed {max_events} events (a livelock?)")
            self.now, _, action = heapq.heappop(self._heap)
            self.processed += 1
            action()

    def __len__(self) -> int:
        return len(self._heap)
