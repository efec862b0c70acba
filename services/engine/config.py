"""Engine host settings: this service's own flags plus every vLLM engine flag.

The engine's own flags (role, ports, KV hand-off tuning) come first; every
flag of vLLM's `AsyncEngineArgs` is accepted as well (``--dtype``,
``--max-model-len``, ``--block-size``, ``--kv-events-config``, …), so a GPU
deployment passes vLLM tuning straight through. Each own flag also reads an
environment variable ``TANDEM_ENGINE_<NAME>``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from services.engine import vllm_plugin

ROLES = ("prefill", "decode", "both")


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"TANDEM_ENGINE_{name.upper()}", default)


@dataclass(frozen=True)
class EngineSettings:
    role: str
    host: str
    grpc_port: int
    metrics_port: int
    nixl_port: int
    kv_lease_seconds: int
    shutdown_grace_seconds: float
    engine_args: Any  # vllm.engine.arg_utils.AsyncEngineArgs
    kv_store_config: str | None = None  # services/kvstore's engine config file
    nixl_progress_delay_us: int | None = None  # None = by device

    def plugin_env(self, device: str) -> dict[str, str]:
        """Settings for services/engine/vllm_plugin.py in the worker process:
        NIXL's own busy spin with GPUs (a core per engine is cheap there), a
        10 ms poll timeout on CPU, where every engine shares the same cores."""
        delay = self.nixl_progress_delay_us
        if delay is None:
            delay = 10_000 if device == "cpu" else 0
        return {vllm_plugin.NIXL_DELAY_ENV: str(delay)}

    def kv_transfer_config(self, device: str) -> dict[str, Any] | None:
        """The KV connector for this role, unless the user set one explicitly.

        Prefill produces KV and keeps it leased until a decode pulls it;
        decode consumes it and, when the pull fails (prefill gone), recomputes
        the prompt locally instead of failing the request.
        """
        nixl = None if self.role == "both" else {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "kv_buffer_device": device,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": self.kv_lease_seconds},
        }
        if self.kv_store_config is None:
            return nixl
        # With the shared KV store: NIXL for the hand-off plus the store for
        # the prefix pool (MultiConnector). The gRPC port is unique per host,
        # so it also names this engine's store lookup socket.
        from services.kvstore.engine import with_store

        return with_store(nixl, self.kv_store_config, lookup_port=self.grpc_port)


def build_parser(default_role: str | None = None) -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    prog = f"tandem-{default_role}" if default_role else "tandem-engine"
    parser = FlexibleArgumentParser(
        prog=prog,
        description=(
            "Tandem engine host: vLLM's AsyncLLM in-process behind the "
            "tandem.engine.v1.Engine gRPC service (plus grpc.health.v1), with "
            "Prometheus metrics on a separate HTTP port. Role 'prefill' computes "
            "prompt KV and hands it over NIXL; role 'decode' pulls it and "
            "generates; role 'both' serves whole requests (aggregated)."
        ),
    )
    own = parser.add_argument_group("engine host")
    own.add_argument("--role", choices=ROLES, default=_env("role", default_role or "both"),
                     help="what this engine does in the P/D split (default: %(default)s)")
    own.add_argument("--host", default=_env("host", "127.0.0.1"),
                     help="address for the gRPC and metrics servers (default: %(default)s)")
    own.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", 50061)),
                     help="gRPC port (default: %(default)s)")
    own.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 9061)),
                     help="Prometheus /metrics and /health HTTP port (default: %(default)s)")
    own.add_argument("--nixl-port", type=int, default=int(_env("nixl_port", 5600)),
                     help="NIXL side-channel port used for the KV hand-off handshake "
                     "(VLLM_NIXL_SIDE_CHANNEL_PORT; default: %(default)s)")
    own.add_argument("--nixl-progress-delay-us", type=int,
                     default=_env("nixl_progress_delay_us", None),
                     help="poll timeout of NIXL's progress thread; it still wakes at "
                     "once on transfer events. 0 = NIXL's own busy spin. Default: 0 "
                     "with GPUs, 10000 on CPU, where the spin burns a core per engine")
    own.add_argument("--kv-lease-seconds", type=int, default=int(_env("kv_lease_seconds", 10)),
                     help="how long a prefill engine keeps KV for a decode that has "
                     "not pulled it yet; waiting decodes renew it by heartbeat, so "
                     "short is safe and frees KV of decodes that died (default: %(default)s)")
    own.add_argument("--kv-store-config", default=_env("kv_store_config", None) or None,
                     help="use the shared KV store (Mooncake, services/kvstore): path of "
                     "the engine config file it writes (<state-dir>/mooncake-engine.json). "
                     "Adds vLLM's MooncakeStoreConnector next to NIXL (default: no store)")
    own.add_argument("--shutdown-grace-seconds", type=float,
                     default=float(_env("shutdown_grace_seconds", 30)),
                     help="on SIGTERM, how long in-flight requests may finish before "
                     "they are aborted (default: %(default)s)")
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def parse_settings(argv: list[str] | None = None, default_role: str | None = None,
                   ) -> EngineSettings:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from common.model import resolve_model

    parser = build_parser(default_role)
    args = parser.parse_args(argv)
    # vLLM's default model is a hub name; Tandem's is the bundled SmolLM2,
    # converted locally on first use (this machine reaches no model hub).
    explicit_model = any(a == "--model" or a.startswith("--model=") for a in (argv or []))
    if not explicit_model:
        args.model = str(resolve_model(None))
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if engine_args.served_model_name is None:
        engine_args.served_model_name = [os.path.basename(os.path.normpath(engine_args.model))]
    if args.role != "both" and engine_args.kv_transfer_config is not None:
        # An explicit --kv-transfer-config wins; it must still fit the role.
        role = engine_args.kv_transfer_config.kv_role
        if role not in ("kv_both", "kv_producer" if args.role == "prefill" else "kv_consumer"):
            parser.error(f"--kv-transfer-config kv_role={role!r} does not fit --role {args.role}")
    if args.kv_store_config is not None and engine_args.kv_transfer_config is None:
        from services.kvstore.engine import check_store

        try:
            check_store(args.kv_store_config)
        except ValueError as exc:
            parser.error(str(exc))
    return EngineSettings(
        role=args.role,
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        nixl_port=args.nixl_port,
        kv_lease_seconds=args.kv_lease_seconds,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        engine_args=engine_args,
        kv_store_config=args.kv_store_config,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
    )


def describe(settings: EngineSettings) -> str:
    ea = settings.engine_args
    return json.dumps({"role": settings.role, "grpc": f"{settings.host}:{settings.grpc_port}",
                       "metrics_port": settings.metrics_port, "model": ea.model})
