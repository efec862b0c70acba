"""Engine host settings: this service's own flags plus every vLLM engine flag.

The engine's own settings (role, ports, KV hand-off tuning) come first, each
once in ``common.engine.EngineHostSettings`` with its default and help (every
launcher renders its command line from there); its flag and its
environment variable ``TANDEM_ENGINE_<FLAG>`` derive from it
(``common/settings.py``). Every flag of vLLM's `AsyncEngineArgs` is accepted
as well (``--dtype``, ``--max-model-len``, ``--block-size``,
``--kv-events-config``, …), so a GPU deployment passes vLLM tuning straight
through.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from common.engine import EngineHostSettings
from common.roles import Role
from common.settings import SettingError, add_arguments, from_arguments
from services.engine import vllm_plugin

ENV_PREFIX = "TANDEM_ENGINE_"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings(EngineHostSettings):
    """The engine host's settings (declared in common/engine.py, where every
    launcher renders them) with the vLLM engine arguments parsed beside them."""

    engine_args: Any = None  # vllm.engine.arg_utils.AsyncEngineArgs

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
        nixl = (
            None
            if self.role == Role.BOTH
            else {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if self.role == Role.PREFILL else "kv_consumer",
                "kv_buffer_device": device,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kv_lease_duration": self.kv_lease_s},
            }
        )
        if self.kv_store_config is None:
            return nixl
        # With the shared KV store: NIXL for the hand-off plus the store for
        # the prefix pool (MultiConnector). The gRPC port is unique per host,
        # so it also names this engine's store lookup socket.
        from services.kvstore.engine import with_store

        return with_store(nixl, self.kv_store_config, lookup_port=self.grpc_port)


def build_parser(default_role: Role | None = None) -> Any:
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
            "generates; role 'both' serves whole requests (aggregated). Each of the "
            f"engine host's own flags also reads an environment variable {ENV_PREFIX}<FLAG>."
        ),
    )
    own = parser.add_argument_group("engine host")
    # vLLM's help formatter prints every default itself.
    add_arguments(
        own,
        EngineSettings,
        ENV_PREFIX,
        defaults={"role": default_role} if default_role else None,
        show_defaults=False,
    )
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def parse_settings(
    argv: list[str] | None = None,
    default_role: Role | None = None,
) -> EngineSettings:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from common.model import resolve_model

    try:
        parser = build_parser(default_role)
    except SettingError as exc:  # a bad value in the environment
        raise SystemExit(f"tandem-engine: error: {exc}") from None
    args = parser.parse_args(argv)
    # vLLM's default model is a hub name; Tandem's is the bundled SmolLM2,
    # converted locally on first use (this machine reaches no model hub).
    explicit_model = any(a == "--model" or a.startswith("--model=") for a in (argv or []))
    if not explicit_model:
        args.model = str(resolve_model(None))
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if engine_args.served_model_name is None:
        engine_args.served_model_name = [os.path.basename(os.path.normpath(engine_args.model))]
    if args.stall_timeout_s < 0:
        parser.error(f"--stall-timeout-s {args.stall_timeout_s:g}: must be positive, or 0 (off)")
    role = Role(args.role)
    if role != Role.BOTH and engine_args.kv_transfer_config is not None:
        # An explicit --kv-transfer-config wins; it must still fit the role.
        kv_role = engine_args.kv_transfer_config.kv_role
        if kv_role not in ("kv_both", "kv_producer" if role == Role.PREFILL else "kv_consumer"):
            parser.error(f"--kv-transfer-config kv_role={kv_role!r} does not fit --role {role}")
    if engine_args.prefill_schedule_interval > 1 and engine_args.data_parallel_size <= 1:
        log.warning(
            "--prefill-schedule-interval %d has no effect: vLLM applies it only "
            "across the data-parallel ranks of a mixture-of-experts model "
            "(--data-parallel-size > 1)",
            engine_args.prefill_schedule_interval,
        )
    if args.kv_store_config is not None and engine_args.kv_transfer_config is None:
        from services.kvstore.engine import check_store

        try:
            check_store(args.kv_store_config)
        except ValueError as exc:
            parser.error(str(exc))
    settings: EngineSettings = from_arguments(EngineSettings, args, engine_args=engine_args)
    try:
        settings.tls.validate()
    except SettingError as exc:
        parser.error(str(exc))
    return settings


def describe(settings: EngineSettings) -> str:
    ea = settings.engine_args
    return json.dumps(
        {
            "role": settings.role,
            "grpc": f"{settings.host}:{settings.grpc_port}",
            "metrics_port": settings.metrics_port,
            "model": ea.model,
        }
    )
