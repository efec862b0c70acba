"""KV store settings: the frozen model (:class:`common.mooncake.KvStoreSettings`)
holds each setting once with its default and help; the flags and the
``TANDEM_KVSTORE_<FLAG>`` environment variables derive from it
(``common/settings.py``), so a Helm chart or ``tandem up`` can
configure the store without building a command line. :func:`validate` checks
what can be checked before any process starts and names the setting at fault.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import replace
from pathlib import Path

from common.mooncake import RETENTION_POLICIES, TRANSFERS, KvStoreSettings, parse_size
from common.settings import (
    SettingError,
    add_arguments,
    env_name,
    flag_of,
    from_arguments,
)

ENV_PREFIX = "TANDEM_KVSTORE_"

# vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py:
# DEFAULT_MOONCAKE_DISK_STAGING_BUFFER_BYTES, the pool owner's staging buffer
# it assumes (Mooncake's default) when it splits disk-tier reads into batches.
VLLM_DISK_READ_BUDGET = 1280 << 20


def _invalid(flag: str, message: str) -> SettingError:
    return SettingError(flag, message, env_name(ENV_PREFIX, flag))


_PORTS = (
    "master_port",
    "metadata_port",
    "master_metrics_port",
    "client_port",
    "client_http_port",
    "http_port",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem-kvstore",
        description=(
            "Tandem KV store: launches and supervises Mooncake's master (with its "
            "HTTP metadata server) and the standalone mooncake_client that owns "
            "the shared CPU-RAM pool and disk tier. Engines are pure requesters "
            "(vLLM MooncakeStoreConnector, standalone-store mode) and read the "
            "config file this service writes (see --state-dir). Either Mooncake "
            "process is restarted when it dies. Every flag also reads the "
            f"environment variable {ENV_PREFIX}<FLAG>."
        ),
    )
    add_arguments(parser, KvStoreSettings, ENV_PREFIX)
    return parser


def parse_settings(argv: list[str] | None = None) -> KvStoreSettings:
    settings: KvStoreSettings = from_arguments(KvStoreSettings, build_parser().parse_args(argv))
    # Absolute: Mooncake's file storage refuses a relative disk path (it
    # aborts the pool owner), and the engines read both from another cwd.
    return replace(
        settings,
        state_dir=os.path.abspath(settings.state_dir),
        disk_path=os.path.abspath(settings.disk_path),
    )


def validate(settings: KvStoreSettings, *, check_ports: bool = True) -> None:
    """Raise :class:`SettingError` naming the first setting that cannot work."""
    seen: dict[int, str] = {}
    for name in _PORTS:
        port = getattr(settings, name)
        flag = flag_of(KvStoreSettings, name)
        if not 0 < port < 65536:
            raise _invalid(flag, f"port {port} is out of range 1-65535")
        if port in seen:
            raise _invalid(
                flag, f"port {port} is already used by {flag_of(KvStoreSettings, seen[port])}"
            )
        seen[port] = name
    for name in (
        "pool_size",
        "disk_size",
        "disk_bucket_size",
        "disk_staging_size",
        "engine_buffer_size",
        "pack_staging_size",
    ):
        flag = flag_of(KvStoreSettings, name)
        try:
            size = parse_size(getattr(settings, name))
        except ValueError as exc:
            raise _invalid(flag, str(exc)) from None
        if size <= 0:
            raise _invalid(flag, "must be greater than zero")
    if settings.enable_disk and parse_size(settings.disk_staging_size) < VLLM_DISK_READ_BUDGET:
        raise _invalid(
            "--disk-staging-size",
            "must be at least 1280MB: vLLM's MooncakeStoreConnector batches "
            "disk-tier reads up to that size, and a read larger than the "
            "pool owner's staging buffer fails (BUFFER_OVERFLOW)",
        )
    if parse_size(settings.pool_size) < 16 << 20:
        raise _invalid("--pool-size", "must be at least 16MB")
    if settings.retention not in RETENTION_POLICIES:
        raise _invalid("--retention", f"must be one of {', '.join(RETENTION_POLICIES)}")
    if settings.transfer not in TRANSFERS:
        raise _invalid("--transfer", f"must be one of {', '.join(TRANSFERS)}")
    if not 0 < settings.eviction_high_watermark <= 1:
        raise _invalid("--eviction-high-watermark", "must be in (0, 1]")
    if not 0 < settings.eviction_ratio <= 1:
        raise _invalid("--eviction-ratio", "must be in (0, 1]")
    if settings.lease_ttl_ms <= 0:
        raise _invalid("--lease-ttl-ms", "must be greater than zero")
    if settings.disk_write_interval_s <= 0:
        raise _invalid("--disk-write-interval-s", "must be greater than zero")
    if settings.session_ttl_s <= 0:
        raise _invalid("--session-ttl-s", "must be greater than zero")
    _check_writable("--state-dir", settings.state_dir)
    if settings.enable_disk:
        _check_writable("--disk-path", settings.disk_path)
    if check_ports:
        for name in _PORTS:
            _check_port_free(flag_of(KvStoreSettings, name), settings.host, getattr(settings, name))


def _check_writable(flag: str, path: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".tandem-write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise _invalid(
            flag, f"{path!r} is not a writable directory: {exc.strerror or exc}"
        ) from None


def _check_port_free(flag: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise _invalid(
                flag,
                f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(another process holds it? pick another port)",
            ) from None
