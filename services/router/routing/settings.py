"""Routing settings: one object, flags to build it, validated once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.router.routing.health import BreakerSettings
from services.router.routing.policy import POLICIES, PolicySettings


@dataclass(frozen=True)
class RoutingSettings:
    policy: PolicySettings = field(default_factory=PolicySettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    block_size: int = 128
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # None: PYTHONHASHSEED, else vLLM's fixed seed
    index_capacity: int = 1_000_000
    # Predicted entries: long-lived for pods without events, short for pods with
    # events (only bridging the time until the engine's own events arrive).
    predicted_ttl_s: float = 300.0
    predicted_ttl_with_events_s: float = 5.0
    session_header: str = "x-session-id"
    redis_url: str | None = None
    # A Redis call slower than this counts as Redis lost (serve on local state).
    redis_timeout_s: float = 0.25
    session_ttl_s: float = 3600.0
    # A session idle this long stops counting as needing its KV (live.py).
    live_session_window_s: float = 300.0
    replica_id: str | None = None

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"--block-size {self.block_size}: must be positive")
        if self.index_capacity <= 0:
            raise ValueError("--routing-index-capacity must be positive")
        if self.live_session_window_s <= 0:
            raise ValueError(f"--live-session-window {self.live_session_window_s:g}: "
                             "must be positive")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"--redis-timeout {self.redis_timeout_s:g}: must be positive")


def _env(name: str, default):
    return os.environ.get(f"TANDEM_ROUTER_{name.upper()}", default)


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("routing")
    g.add_argument("--routing-policy", "--policy", dest="routing_policy", choices=POLICIES,
                   default=_env("routing_policy", "cost"),
                   help="how pods are chosen: cost (prefix hits vs load, sticky sessions), "
                        "round-robin, least-load, prefix (most cached), session (always sticky)")
    g.add_argument("--block-size", dest="routing_block_size", type=int,
                   default=int(_env("block_size", 128)),
                   help="engines' KV block size (must match --block-size of the engines)")
    g.add_argument("--prefix-caching-hash-algo", dest="routing_hash_algo",
                   choices=("sha256", "sha256_cbor"), default=_env("hash_algo", "sha256"),
                   help="engines' --prefix-caching-hash-algo")
    g.add_argument("--routing-index-capacity", type=int,
                   default=int(_env("routing_index_capacity", 1_000_000)),
                   help="most block hashes the prefix index keeps (LRU beyond)")
    g.add_argument("--session-header", default=_env("session_header", "x-session-id"),
                   help="request header naming the session (else `user`, else derived)")
    g.add_argument("--redis-url", default=_env("redis_url", None),
                   help="share session bindings and load with other router replicas")
    g.add_argument("--redis-timeout", dest="redis_timeout_s", type=float,
                   default=float(_env("redis_timeout", 0.25)), metavar="SECONDS",
                   help="a Redis call slower than this counts as Redis lost: the router "
                        "serves on local state and re-syncs when Redis answers again")
    g.add_argument("--remote-prefill-threshold", type=int,
                   default=int(_env("remote_prefill_threshold", PolicySettings.remote_prefill_threshold)),
                   help="P/D: below this many uncached tokens the decode pod prefills locally")
    g.add_argument("--eviction-cost-factor", type=float,
                   default=float(_env("eviction_cost_factor", PolicySettings.eviction_cost_factor)),
                   help="cost policy: weight of live sessions' cached tokens a placement "
                        "would evict (recomputed on their next turn); 0 ignores KV capacity")
    g.add_argument("--move-cost-factor", type=float,
                   default=float(_env("move_cost_factor", PolicySettings.move_cost_factor)),
                   help="cost policy: how strongly a session (or a sub-agent fork) stays "
                        "with the pod holding its context: the cost of moving, per token "
                        "of that context the other pod lacks")
    g.add_argument("--kv-pressure-tokens", type=float,
                   default=float(_env("kv_pressure_tokens", PolicySettings.kv_pressure_tokens)),
                   help="cost policy: the load, in prompt tokens, of a pod whose KV usage is "
                        "full (scaled from the 90%% watermark, and by the share of the request "
                        "the pod must allocate)")
    g.add_argument("--live-session-window", dest="live_session_window_s", type=float,
                   default=float(_env("live_session_window", 300.0)), metavar="SECONDS",
                   help="a session counts as live (its KV worth keeping) until idle this long")
    g.add_argument("--prefill-tokens-per-s", type=float,
                   default=float(_env("prefill_tokens_per_s", PolicySettings.prefill_tokens_per_s)),
                   help="a pod's prefill speed, to turn costs into predicted TTFT")


def routing_settings_from_args(args: argparse.Namespace) -> RoutingSettings:
    settings = RoutingSettings(
        policy=PolicySettings(policy=args.routing_policy,
                              remote_prefill_threshold=args.remote_prefill_threshold,
                              prefill_tokens_per_s=args.prefill_tokens_per_s,
                              eviction_cost_factor=args.eviction_cost_factor,
                              move_cost_factor=args.move_cost_factor,
                              kv_pressure_tokens=args.kv_pressure_tokens),
        block_size=args.routing_block_size,
        hash_algo=args.routing_hash_algo,
        index_capacity=args.routing_index_capacity,
        session_header=args.session_header,
        redis_url=args.redis_url,
        redis_timeout_s=args.redis_timeout_s,
        live_session_window_s=args.live_session_window_s,
    )
    settings.validate()
    return settings
