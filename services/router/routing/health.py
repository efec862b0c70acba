"""Per-pod circuit breakers: passive ejection on failures, recovery by probes.

State machine, time passed in (no clocks, no I/O):

* ``closed``: the pod gets traffic; ``failure_threshold`` consecutive failures
  open the circuit (the pod is ejected).
* ``open``: no traffic until ``open_until``; the wait doubles on each failed
  recovery, up to ``max_open_s``.
* ``half-open``: after the wait the pod is due a probe (the router's next
  health poll of it); success closes the circuit, failure opens it again for
  longer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True)
class BreakerSettings:
    failure_threshold: int = 3
    open_s: float = 5.0
    max_open_s: float = 60.0


@dataclass
class CircuitBreaker:
    settings: BreakerSettings
    state: CircuitState = CircuitState.CLOSED
    consecutive_failures: int = 0
    open_until: float = 0.0
    ejections: int = 0
    _current_open_s: float = 0.0

    def allows_traffic(self, now: float) -> bool:
        """True while closed; an open circuit turns half-open (probe due) once its time is up."""
        if self.state is CircuitState.OPEN and now >= self.open_until:
            self.state = CircuitState.HALF_OPEN
        return self.state is CircuitState.CLOSED

    def probe_due(self, now: float) -> bool:
        self.allows_traffic(now)
        return self.state is CircuitState.HALF_OPEN

    def record_success(self, now: float) -> None:
        self.state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self._current_open_s = 0.0

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when this failure opened the circuit (an ejection)."""
        self.consecutive_failures += 1
        if self.state is CircuitState.HALF_OPEN or (
            self.state is CircuitState.CLOSED
            and self.consecutive_failures >= self.settings.failure_threshold
        ):
            self._current_open_s = (
                self.settings.open_s
                if not self._current_open_s
                else min(self.settings.max_open_s, 2 * self._current_open_s)
            )
            self.state = CircuitState.OPEN
            self.open_until = now + self._current_open_s
            self.ejections += 1
            return True
        return False


class PodHealth:
    """One breaker per pod."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.settings = settings or BreakerSettings()
        self._breakers: dict[str, CircuitBreaker] = {}

    def breaker(self, pod: str) -> CircuitBreaker:
        b = self._breakers.get(pod)
        if b is None:
            b = self._breakers[pod] = CircuitBreaker(self.settings)
        return b

    def allows_traffic(self, pod: str, now: float) -> bool:
        return self.breaker(pod).allows_traffic(now)

    def remove(self, pod: str) -> None:
        self._breakers.pop(pod, None)

    def record_success(self, pod: str, now: float) -> None:
        self.breaker(pod).record_success(now)

    def record_failure(self, pod: str, now: float) -> bool:
        return self.breaker(pod).record_failure(now)
