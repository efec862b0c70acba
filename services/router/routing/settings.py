"""Routing settings: one object, each setting once (its flag and environment
variable derive from it, ``common/settings.py``), validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.settings import SettingError, flag_of, group, setting
from services.router.routing.hashing import SUPPORTED_ALGOS
from services.router.routing.health import BreakerSettings
from services.router.routing.policy import PolicySettings
from services.router.routing.prefetch import PrefetchSettings


@dataclass(frozen=True)
class RoutingSettings:
    policy: PolicySettings = group(PolicySettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    prefetch: PrefetchSettings = group(PrefetchSettings)
    block_size: int = setting(
        128,
        "engines' KV block size (must match the engines' "
        "--block-size; the engines' own wins if they differ)",
    )
    hash_algo: str = setting(
        "sha256",
        "engines' --prefix-caching-hash-algo",
        flag="--prefix-caching-hash-algo",
        choices=SUPPORTED_ALGOS,
    )
    hash_seed: str | None = None  # None: PYTHONHASHSEED, else vLLM's fixed seed
    index_capacity: int = setting(
        1_000_000,
        "most block hashes the prefix index keeps (LRU beyond)",
        flag="--routing-index-capacity",
    )
    # Predicted entries: long-lived for pods without events, short for pods with
    # events (only bridging the time until the engine's own events arrive).
    predicted_ttl_s: float = 300.0
    predicted_ttl_with_events_s: float = 5.0
    session_header: str = setting(
        "x-session-id", "request header naming the session (else `user`, else derived)"
    )
    redis_url: str | None = setting(
        None, "share session bindings and load with other router replicas"
    )
    redis_timeout_s: float = setting(
        0.25,
        "a Redis call slower than this counts as Redis "
        "lost: the router serves on local state and re-syncs "
        "when Redis answers again",
    )
    session_ttl_s: float = 3600.0
    live_session_window_s: float = setting(
        300.0, "a session counts as live (its KV worth keeping) until idle this long"
    )
    replica_id: str | None = None

    def validate(self) -> None:
        def bad(name: str, message: str) -> SettingError:
            return SettingError(flag_of(RoutingSettings, name), message)

        if self.block_size <= 0:
            raise bad("block_size", f"{self.block_size}: must be positive")
        if self.index_capacity <= 0:
            raise bad("index_capacity", f"{self.index_capacity}: must be positive")
        if self.live_session_window_s <= 0:
            raise bad("live_session_window_s", f"{self.live_session_window_s:g}: must be positive")
        if self.redis_timeout_s <= 0:
            raise bad("redis_timeout_s", f"{self.redis_timeout_s:g}: must be positive")
        self.policy.validate()
        self.prefetch.validate()
