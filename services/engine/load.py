"""The engine's current load, as the router needs it to choose pods.

vLLM reports scheduler figures to stat loggers after each step; this logger
keeps the latest ones. The host's own in-flight count is exact at all times
(the scheduler figures go stale once the engine idles).
"""

from __future__ import annotations

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

    def stat_logger_factory(self):
        """A vLLM `StatLoggerFactory` that feeds this tracker."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _LoadLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0):
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
