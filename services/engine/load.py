"""The engine's current load, as the router needs it to choose pods, and when
it last made progress, as the host's stall watch needs it.

vLLM reports scheduler figures to stat loggers after each step; this logger
keeps the latest ones. The host's own in-flight count is exact at all times
(the scheduler figures go stale once the engine idles).

Progress: vLLM's output handler calls the stat loggers once per engine-core
step, empty steps included (a step that only moves KV-connector metadata,
or waits for a remote KV pull, still reports its scheduler stats), so an
engine that makes no call for long while it has requests is stuck inside a
step. The clock starts again when work reaches an idle engine: an idle engine
does not step, and that is no stall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class LoadSnapshot:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


class LoadTracker:
    def __init__(self) -> None:
        self.latest = LoadSnapshot()
        self.in_flight = 0
        self.last_progress = 0.0  # read only while requests are in flight

    def request_started(self, now: float) -> None:
        if self.in_flight == 0:
            self.last_progress = now
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1

    def engine_stepped(self, now: float) -> None:
        self.last_progress = now

    def seconds_without_progress(self, now: float) -> float:
        """How long the engine has had requests in flight and taken no step; 0 when idle."""
        return max(0.0, now - self.last_progress) if self.in_flight else 0.0

    def stalled(self, now: float, timeout_s: float) -> bool:
        """No progress for ``timeout_s`` with requests in flight (``timeout_s`` 0: never)."""
        return timeout_s > 0 and self.seconds_without_progress(now) >= timeout_s

    def stat_logger_factory(self):
        """A vLLM `StatLoggerFactory` that feeds this tracker."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _LoadLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(
                self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
            ):
                tracker.engine_stepped(time.monotonic())
                if scheduler_stats is not None:
                    tracker.latest = LoadSnapshot(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs
                        + scheduler_stats.num_skipped_waiting_reqs,
                        kv_cache_usage=scheduler_stats.kv_cache_usage,
                    )

            def log_engine_initialized(self):
                pass

        return _LoadLogger
