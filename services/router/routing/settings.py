"""Routing settings: one object, each setting once (its flag and environment
variable derive from it, ``common/settings.py``), validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.settings import SettingError, flag_of, group, setting
from services.router.routing.hashing import SUPPORTED_ALGOS
from services.router.routing.health import BreakerSettings
from services.router.routing.policy import PolicySettings
from services.router.routing.prefetch import PrefetchSettings

# The prefix index's least bound while it follows the pods' KV (the default):
# the KV of 14 pods of 71,150 blocks, before any pod reported its size.
INDEX_CAPACITY_FLOOR = 1_000_000


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
    index_capacity: int | None = setting(
        None,
        "most block hashes the prefix index keeps (the least recently stored or "
        "matched forgotten beyond: a missed prediction); default: the KV blocks "
        f"the pods report in all, at least {INDEX_CAPACITY_FLOOR:,}",
        flag="--routing-index-capacity",
        metavar="BLOCKS",
    )
    predicted_capacity: int = setting(
        200_000,
        "most predicted (pod, block) entries the prefix index keeps for pods whose "
        "KV events have not confirmed them (oldest forgotten beyond, and each after its TTL)",
        flag="--routing-predicted-capacity",
        metavar="ENTRIES",
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
    session_ttl_s: float = setting(
        3600.0,
        "a session's pod binding (stickiness) is forgotten after this long without a "
        "turn; also the TTL of its Redis key",
        flag="--session-binding-ttl-s",
    )
    max_session_bindings: int = setting(
        1_000_000,
        "most session bindings this replica keeps in memory (least recently routed "
        "forgotten beyond: that session's next turn is routed as a new one)",
        metavar="SESSIONS",
    )
    live_session_window_s: float = setting(
        300.0, "a session counts as live (its KV worth keeping) until idle this long"
    )
    live_max_sessions: int = setting(
        100_000,
        "most live sessions whose KV working set the router tracks (least recently "
        "seen forgotten beyond: their KV no longer priced as live)",
        metavar="SESSIONS",
    )
    live_max_blocks: int = setting(
        4_000_000,
        "most block hashes the live sessions' working sets hold in all (least recently "
        "seen sessions forgotten beyond)",
        metavar="BLOCKS",
    )
    live_max_tokens: int = setting(
        20_000_000,
        "most prompt tokens kept per live session to hash only each turn's new blocks, in all "
        "(4 bytes a token; least recently seen sessions forgotten beyond: their next turn "
        "is hashed in full)",
        metavar="TOKENS",
    )
    replica_id: str | None = None

    def validate(self) -> None:
        def bad(name: str, message: str) -> SettingError:
            return SettingError(flag_of(RoutingSettings, name), message)

        if self.block_size <= 0:
            raise bad("block_size", f"{self.block_size}: must be positive")
        if self.index_capacity is not None and self.index_capacity <= 0:
            raise bad("index_capacity", f"{self.index_capacity}: must be positive")
        for name in (
            "predicted_capacity",
            "max_session_bindings",
            "live_max_sessions",
            "live_max_blocks",
            "live_max_tokens",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise bad(name, f"{value}: must be positive")
        if self.session_ttl_s <= 0:
            raise bad("session_ttl_s", f"{self.session_ttl_s:g}: must be positive")
        if self.live_session_window_s <= 0:
            raise bad("live_session_window_s", f"{self.live_session_window_s:g}: must be positive")
        if self.redis_timeout_s <= 0:
            raise bad("redis_timeout_s", f"{self.redis_timeout_s:g}: must be positive")
        self.policy.validate()
        self.prefetch.validate()
