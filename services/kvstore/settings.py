"""KV store settings: one frozen model, each setting once with its default
and help; the flags and the ``TANDEM_KVSTORE_<FLAG>`` environment variables
derive from it (``common/settings.py``), so a Helm chart or ``tandem up`` can
configure the store without building a command line. :func:`validate` checks
what can be checked before any process starts and names the setting at fault.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from common.settings import SettingError, add_arguments, env_name, flag_of, from_arguments, setting

ENV_PREFIX = "TANDEM_KVSTORE_"

RETENTION_POLICIES = ("lru", "soft-pin")
# vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py:
# DEFAULT_MOONCAKE_DISK_STAGING_BUFFER_BYTES, the pool owner's staging buffer
# it assumes (Mooncake's default) when it splits disk-tier reads into batches.
VLLM_DISK_READ_BUDGET = 1280 << 20

_SIZE_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def _invalid(flag: str, message: str) -> SettingError:
    return SettingError(flag, message, env_name(ENV_PREFIX, flag))


def parse_size(value: str | int) -> int:
    """``"4GB"``, ``"256 MB"``, ``"1.5gb"`` or a byte count → bytes (binary units)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?b)?\s*", str(value).lower())
    if not match:
        raise ValueError(f"not a size: {value!r} (use e.g. 4GB, 512MB, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "b"])


def _default_state_dir() -> str:
    from common.model import cache_dir

    return str(cache_dir() / "kvstore")


@dataclass(frozen=True)
class KvStoreSettings:
    host: str = setting("127.0.0.1", "address every store process binds to (loopback for "
                        "the embedded stack)")
    # Mooncake master: RPC (engines and the pool owner talk to it), the HTTP
    # metadata server (transfer-engine segment descriptors), raw metrics.
    master_port: int = setting(51100, "Mooncake master RPC port (engines' "
                               "master_server_address)")
    metadata_port: int = setting(51101, "Mooncake HTTP metadata server port (engines' "
                                 "metadata_server)")
    master_metrics_port: int = setting(51102, "Mooncake master's own metrics HTTP port (raw; "
                                       "this service re-exports it on --http-port)")
    # The standalone pool owner (mooncake_client): RPC port and health HTTP.
    client_port: int = setting(51103, "RPC port of the standalone mooncake_client that owns "
                               "the pool")
    client_http_port: int = setting(51104, "health HTTP port of the standalone "
                                    "mooncake_client")
    http_port: int = setting(9100, "this service's HTTP port: /health, /metrics, "
                             "/v1/engine-config")
    pool_size: str = setting("4GB", "CPU-RAM pool owned by the store (e.g. 4GB)")
    disk_path: str = setting(None, "directory of the disk tier (must be writable)",
                             factory=lambda: os.path.join(_default_state_dir(), "disk"))
    disk_size: str = setting("16GB", "disk tier capacity (e.g. 16GB)")
    enable_disk: bool = setting(True, "spill KV from the RAM pool to --disk-path (true/false)")
    # Objects smaller than this bucket are batched before they are written to
    # disk: spill begins once a bucket holds this many keys or bytes.
    disk_bucket_keys: int = setting(500, "objects are written to disk in buckets of this "
                                    "many keys")
    disk_bucket_size: str = setting("256MB", "... or of this many bytes, whichever fills first")
    # vLLM's store connector sizes its disk-tier reads for Mooncake's default
    # staging buffer; a smaller one fails every larger read (BUFFER_OVERFLOW).
    disk_staging_size: str = setting("1280MB", "RAM staging buffer the pool owner reads and "
                                     "writes the disk tier through; vLLM's store connector "
                                     "batches disk reads up to 1280MB, so it must be at "
                                     "least that (a larger read fails)")
    disk_write_interval_s: int = setting(10, "seconds between the pool owner's rounds of "
                                         "writing new objects to the disk tier; an object "
                                         "leaves RAM only once it is on disk, so under fast "
                                         "writes puts fail until it is")
    lease_ttl_ms: int = setting(10_000, "lease on every object read: it cannot be evicted or "
                                "removed for this long after a get (Mooncake "
                                "default_kv_lease_ttl)")
    retention: str = setting("lru", "retention policy: 'lru' (evict least recently used "
                             "under pressure) or 'soft-pin' (KV written by engines is "
                             "soft-pinned for --session-ttl-s: evicted only after every "
                             "unpinned object)", choices=RETENTION_POLICIES)
    session_ttl_s: float = setting(1800.0, "soft-pin lifetime for the 'soft-pin' policy: how "
                                   "long an idle session's KV is preferred over other KV")
    allow_evict_pinned: bool = setting(True, "when only soft-pinned objects are left, may "
                                       "they be evicted (true) or do new puts fail (false)")
    eviction_high_watermark: float = setting(0.9, "fraction of the RAM pool at which "
                                             "eviction starts")
    eviction_ratio: float = setting(0.05, "fraction of objects evicted per eviction round")
    engine_buffer_size: str = setting("256MB", "staging buffer each engine registers with "
                                      "the store")
    pack_blocks: bool = setting(False, "engines move each KV block to and from the store as "
                                "one packed buffer (kernels.pack_blocks) instead of one "
                                "buffer per layer; the stored objects are the same bytes, so "
                                "packing and non-packing engines share them")
    pack_staging_size: str = setting("128MB", "with --pack-blocks: registered staging buffer "
                                     "per engine transfer thread that blocks are packed into "
                                     "(at least one block is used)")
    state_dir: str = setting(None, "where logs and the engines' Mooncake config file are "
                             "written", factory=_default_state_dir)
    client_ttl_s: int = setting(10, "seconds without a heartbeat after which the master "
                                "drops the pool owner's segment")
    restart_backoff_s: float = setting(1.0, "first delay before restarting a crashed "
                                       "Mooncake process (doubles per consecutive crash, up "
                                       "to 30 s)")
    start_timeout_s: float = setting(60.0, "how long each Mooncake process may take to "
                                     "become ready")

    # -- derived ----------------------------------------------------------
    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def engine_config_path(self) -> str:
        """The Mooncake config file engines read (``MOONCAKE_CONFIG_PATH``)."""
        return os.path.join(self.state_dir, "mooncake-engine.json")

    def as_dict(self) -> dict:
        return asdict(self)


_PORTS = ("master_port", "metadata_port", "master_metrics_port", "client_port",
          "client_http_port", "http_port")

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
            f"environment variable {ENV_PREFIX}<FLAG>."))
    add_arguments(parser, KvStoreSettings, ENV_PREFIX)
    return parser


def parse_settings(argv: list[str] | None = None) -> KvStoreSettings:
    settings: KvStoreSettings = from_arguments(KvStoreSettings, build_parser().parse_args(argv))
    return settings


def validate(settings: KvStoreSettings, *, check_ports: bool = True) -> None:
    """Raise :class:`SettingError` naming the first setting that cannot work."""
    seen: dict[int, str] = {}
    for name in _PORTS:
        port = getattr(settings, name)
        flag = flag_of(KvStoreSettings, name)
        if not 0 < port < 65536:
            raise _invalid(flag, f"port {port} is out of range 1-65535")
        if port in seen:
            raise _invalid(flag, f"port {port} is already used by "
                                 f"{flag_of(KvStoreSettings, seen[port])}")
        seen[port] = name
    for name in ("pool_size", "disk_size", "disk_bucket_size", "disk_staging_size",
                 "engine_buffer_size", "pack_staging_size"):
        flag = flag_of(KvStoreSettings, name)
        try:
            size = parse_size(getattr(settings, name))
        except ValueError as exc:
            raise _invalid(flag, str(exc)) from None
        if size <= 0:
            raise _invalid(flag, "must be greater than zero")
    if settings.enable_disk and parse_size(settings.disk_staging_size) < VLLM_DISK_READ_BUDGET:
        raise _invalid("--disk-staging-size",
                           "must be at least 1280MB: vLLM's MooncakeStoreConnector batches "
                           "disk-tier reads up to that size, and a read larger than the "
                           "pool owner's staging buffer fails (BUFFER_OVERFLOW)")
    if parse_size(settings.pool_size) < 16 << 20:
        raise _invalid("--pool-size", "must be at least 16MB")
    if settings.retention not in RETENTION_POLICIES:
        raise _invalid("--retention", f"must be one of {', '.join(RETENTION_POLICIES)}")
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
            _check_port_free(flag_of(KvStoreSettings, name), settings.host,
                             getattr(settings, name))


def _check_writable(flag: str, path: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".tandem-write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise _invalid(flag, f"{path!r} is not a writable directory: "
                             f"{exc.strerror or exc}") from None


def _check_port_free(flag: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise _invalid(flag, f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                               "(another process holds it? pick another port)") from None
