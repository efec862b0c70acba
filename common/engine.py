"""The engine host's command line, for every launcher: the embedded stack
(``services/stack.py``) and the Kubernetes operator render it from these
objects, and the engine host parses it (``services/engine/config.py``).

``EngineHostSettings`` holds the engine host's own settings, each once with
its default and help (its flag and its ``TANDEM_ENGINE_<FLAG>`` variable
derive from it, ``common/settings.py``); ``VllmSettings`` the vLLM engine
flags a launcher sets, under vLLM's own names (vLLM's parser reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.roles import Role
from common.settings import group, setting, to_argv
from common.tls import GrpcTlsSettings

# Flags every launcher gives, even at their defaults: where the engine listens.
ADDRESS = ("role", "host", "grpc_port", "metrics_port", "nixl_port")


@dataclass(frozen=True)
class EngineHostSettings:
    role: Role = setting(Role.BOTH, "what this engine does in the P/D split")
    host: str = setting("127.0.0.1", "address for the gRPC and metrics servers")
    grpc_port: int = setting(50061, "gRPC port")
    metrics_port: int = setting(9061, "Prometheus /metrics and /health HTTP port")
    nixl_port: int = setting(
        5600,
        "NIXL side-channel port used for the KV hand-off handshake (VLLM_NIXL_SIDE_CHANNEL_PORT)",
    )
    nixl_progress_delay_us: int | None = setting(
        None,
        "poll timeout of NIXL's progress thread; it still wakes at once on transfer "
        "events. 0 = NIXL's own busy spin. Default: 0 with GPUs, 10000 on CPU, where the "
        "spin burns a core per engine",
    )
    kv_lease_s: int = setting(
        10,
        "how long a prefill engine keeps KV for a decode that has "
        "not pulled it yet; waiting decodes renew it by heartbeat, so "
        "short is safe and frees KV of decodes that died",
    )
    kv_store_config: str | None = setting(
        None,
        "use the shared KV store (Mooncake, services/kvstore): path of the engine "
        "config file it writes (<state-dir>/mooncake-engine.json). Adds vLLM's "
        "MooncakeStoreConnector next to NIXL (default: no store)",
    )
    shutdown_grace_s: float = setting(
        30.0, "on SIGTERM, how long in-flight requests may finish before they are aborted"
    )
    stall_timeout_s: float = setting(
        120.0,
        "an engine with requests in flight that takes no engine step for this long "
        "is stuck (e.g. a worker hung inside a model step): the host then reports "
        "NOT_SERVING, fails those requests with UNAVAILABLE (the router retries them "
        "elsewhere) and exits with status 1 for its supervisor to restart it. Long enough "
        "for the slowest legitimate step (a 2K-token prefill chunk on a loaded CPU takes "
        "tens of seconds); lower it on GPUs. 0 = never",
    )
    tls: GrpcTlsSettings = group(GrpcTlsSettings, "mutual TLS on the gRPC link")


@dataclass(frozen=True)
class VllmSettings:
    """vLLM engine flags a launcher sets (vLLM's own parser reads them; these
    fields are never added to a parser, so they read no environment)."""

    model: str | None = setting(None, "model folder or name", env=False)
    served_model_name: str | None = setting(None, "model name clients send", env=False)
    dtype: str = setting("auto", "weights' and activations' dtype", env=False)
    tensor_parallel_size: int = setting(1, "tensor parallelism", env=False)
    pipeline_parallel_size: int = setting(1, "pipeline parallelism", env=False)
    data_parallel_size: int = setting(1, "data parallelism", env=False)
    prefill_context_parallel_size: int = setting(1, "prefill context parallelism (PCP)", env=False)
    decode_context_parallel_size: int = setting(1, "decode context parallelism (DCP)", env=False)
    kv_events_config: str | None = setting(None, "KV events publisher (JSON)", env=False)
    max_model_len: int | None = setting(None, "longest context", env=False)
    enable_expert_parallel: bool = setting(
        False, "expert parallelism for MoE layers", env=False, switch=True
    )
    enforce_eager: bool = setting(False, "no CUDA graphs / compilation", env=False, switch=True)
    distributed_executor_backend: str | None = setting(
        None, "ray for a replica spanning nodes", env=False
    )


def kv_events_config(pub_port: int, replay_port: int) -> str:
    """vLLM's --kv-events-config publishing KV events over ZMQ on these ports."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        },
        separators=(",", ":"),
    )


# The module each role runs as (its default --role).
MODULES = {
    Role.PREFILL: "services.prefill",
    Role.DECODE: "services.decode",
    Role.BOTH: "services.engine",
}


@dataclass(frozen=True)
class EngineCommand:
    """One engine host's command line: its own settings, vLLM's, then
    whatever else the user passes (vLLM tuning, scheduler flags)."""

    host: EngineHostSettings = field(default_factory=EngineHostSettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    extra: tuple[str, ...] = ()
    module: str = "services.engine"

    def argv(
        self, python: str = "python", *, joined: bool = False, always: tuple[str, ...] = ()
    ) -> list[str]:
        """``always``: flags given even at their defaults, besides ``ADDRESS``."""
        return [
            python,
            "-m",
            self.module,
            *to_argv(self.host, (*ADDRESS, *always), joined=joined),
            *to_argv(self.vllm, always, joined=joined),
            *self.extra,
        ]
