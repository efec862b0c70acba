"""The Mooncake store's settings and what to run: its command lines and the
engines' store config (pure, no I/O but :func:`find_binary`'s lookup).

Shared by the KV store service (``tandem up``; its flags and
``TANDEM_KVSTORE_*`` variables derive from :class:`KvStoreSettings`) and the
Kubernetes operator, so both start the same processes with the same flags;
tests check every flag without starting anything.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass

from common.settings import setting

RETENTION_POLICIES = ("lru", "soft-pin")
# How engines move KV blocks to and from the pool owner.
TRANSFERS = ("auto", "tcp", "shm")

_SIZE_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


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
    host: str = setting(
        "127.0.0.1", "address every store process binds to (loopback for the embedded stack)"
    )
    # Mooncake master: RPC (engines and the pool owner talk to it), the HTTP
    # metadata server (transfer-engine segment descriptors), raw metrics.
    master_port: int = setting(51100, "Mooncake master RPC port (engines' master_server_address)")
    metadata_port: int = setting(
        51101, "Mooncake HTTP metadata server port (engines' metadata_server)"
    )
    master_metrics_port: int = setting(
        51102,
        "Mooncake master's own metrics HTTP port (raw; this service re-exports it on --http-port)",
    )
    # The standalone pool owner (mooncake_client): RPC port and health HTTP.
    client_port: int = setting(
        51103, "RPC port of the standalone mooncake_client that owns the pool"
    )
    client_http_port: int = setting(51104, "health HTTP port of the standalone mooncake_client")
    http_port: int = setting(9100, "this service's HTTP port: /health, /metrics, /v1/engine-config")
    pool_size: str = setting("4GB", "CPU-RAM pool owned by the store (e.g. 4GB)")
    disk_path: str = setting(
        None,
        "directory of the disk tier (must be writable)",
        factory=lambda: os.path.join(_default_state_dir(), "disk"),
    )
    disk_size: str = setting("16GB", "disk tier capacity (e.g. 16GB)")
    enable_disk: bool = setting(True, "spill KV from the RAM pool to --disk-path (true/false)")
    # Objects smaller than this bucket are batched before they are written to
    # disk: spill begins once a bucket holds this many keys or bytes.
    disk_bucket_keys: int = setting(500, "objects are written to disk in buckets of this many keys")
    disk_bucket_size: str = setting("256MB", "... or of this many bytes, whichever fills first")
    # vLLM's store connector sizes its disk-tier reads for Mooncake's default
    # staging buffer; a smaller one fails every larger read (BUFFER_OVERFLOW).
    disk_staging_size: str = setting(
        "1280MB",
        "RAM staging buffer the pool owner reads and "
        "writes the disk tier through; vLLM's store connector "
        "batches disk reads up to 1280MB, so it must be at "
        "least that (a larger read fails)",
    )
    disk_write_interval_s: int = setting(
        10,
        "seconds between the pool owner's rounds of "
        "writing new objects to the disk tier; an object "
        "leaves RAM only once it is on disk, so under fast "
        "writes puts fail until it is",
    )
    lease_ttl_ms: int = setting(
        10_000,
        "lease on every object read: it cannot be evicted or "
        "removed for this long after a get (Mooncake "
        "default_kv_lease_ttl)",
    )
    retention: str = setting(
        "lru",
        "retention policy: 'lru' (evict least recently used "
        "under pressure) or 'soft-pin' (KV written by engines is "
        "soft-pinned for --session-ttl-s: evicted only after every "
        "unpinned object)",
        choices=RETENTION_POLICIES,
    )
    session_ttl_s: float = setting(
        1800.0,
        "soft-pin lifetime for the 'soft-pin' policy: how "
        "long an idle session's KV is preferred over other KV",
    )
    allow_evict_pinned: bool = setting(
        True,
        "when only soft-pinned objects are left, may "
        "they be evicted (true) or do new puts fail (false)",
    )
    eviction_high_watermark: float = setting(
        0.9, "fraction of the RAM pool at which eviction starts"
    )
    eviction_ratio: float = setting(0.05, "fraction of objects evicted per eviction round")
    engine_buffer_size: str = setting(
        "256MB", "staging buffer each engine registers with the store"
    )
    pack_blocks: bool = setting(
        False,
        "engines moving KV blocks over TCP move each as "
        "one packed buffer (kernels.pack_blocks) instead of one "
        "buffer per layer; the stored objects are the same bytes, so "
        "packing and non-packing engines share them",
    )
    pack_staging_size: str = setting(
        "128MB",
        "with --pack-blocks: registered staging buffer "
        "per engine transfer thread that blocks are packed into "
        "(at least one block is used)",
    )
    transfer: str = setting(
        "auto",
        "how engines move KV blocks to and from the pool owner. 'shm': the "
        "engine's KV cache lives in shared memory the pool owner maps and "
        "the pool owner copies each block once (engines on its host with a "
        "host-memory KV cache only; an engine that cannot attach refuses to "
        "start), 'tcp': over Mooncake's transfer engine (packed with "
        "--pack-blocks), 'auto': shm when the pool owner is on the engine's "
        "host and the KV cache in host memory, else tcp",
        choices=TRANSFERS,
    )
    state_dir: str = setting(
        None,
        "where logs and the engines' Mooncake config file are written",
        factory=_default_state_dir,
    )
    client_ttl_s: int = setting(
        10, "seconds without a heartbeat after which the master drops the pool owner's segment"
    )
    restart_backoff_s: float = setting(
        1.0,
        "first delay before restarting a crashed "
        "Mooncake process (doubles per consecutive crash, up "
        "to 30 s)",
    )
    start_timeout_s: float = setting(
        60.0, "how long each Mooncake process may take to become ready"
    )

    # -- derived ----------------------------------------------------------
    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def pool_owner_address(self) -> str:
        """The pool owner's RPC address, where a shared-memory client attaches."""
        return f"{self.host}:{self.client_port}"

    @property
    def engine_config_path(self) -> str:
        """The Mooncake config file engines read (``MOONCAKE_CONFIG_PATH``)."""
        return os.path.join(self.state_dir, "mooncake-engine.json")

    def as_dict(self) -> dict:
        return asdict(self)


# Keys of the engine-side config file that vLLM's MooncakeStoreConfig reads
# (vllm/distributed/mooncake_store.py); Tandem's own keys sit under "tandem".
ENGINE_CONFIG_TANDEM_KEY = "tandem"


@dataclass(frozen=True)
class Command:
    name: str
    argv: list[str]
    env: dict[str, str]


def find_binary(name: str) -> str:
    """A Mooncake binary: the one inside the installed ``mooncake`` package (the
    console scripts are Python wrappers that only exec it), else PATH."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin is not None:
        packaged = os.path.join(os.path.dirname(spec.origin), name)
        if os.access(packaged, os.X_OK):
            return packaged
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found in the mooncake package or on PATH: install "
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU)"
        )
    return found


def _duration_ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def max_pin_ttl_ms(s: KvStoreSettings) -> int:
    """The longest soft pin the master accepts: the session TTL, at least a day
    (router hints may pin longer than the engine-wide session TTL)."""
    return int(max(s.session_ttl_s, 86400) * 1000)


def master_command(s: KvStoreSettings, binary: str = "mooncake_master") -> Command:
    argv = [
        binary,
        f"--rpc_address={s.host}",
        f"--rpc_port={s.master_port}",
        f"--metrics_host={s.host}",
        f"--metrics_port={s.master_metrics_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={s.host}",
        f"--http_metadata_server_port={s.metadata_port}",
        # The pool owner offloads to disk only if the master allows it.
        f"--enable_offload={'true' if s.enable_disk else 'false'}",
        f"--default_kv_lease_ttl={s.lease_ttl_ms}",
        f"--default_kv_soft_pin_ttl={_duration_ms(s.session_ttl_s)}",
        f"--max_kv_soft_pin_ttl={max_pin_ttl_ms(s)}",
        f"--allow_evict_soft_pinned_objects={'true' if s.allow_evict_pinned else 'false'}",
        f"--eviction_high_watermark_ratio={s.eviction_high_watermark}",
        f"--eviction_ratio={s.eviction_ratio}",
        f"--client_ttl={s.client_ttl_s}",
        "--logtostderr=true",
    ]
    return Command("master", argv, {})


def client_command(s: KvStoreSettings, binary: str = "mooncake_client") -> Command:
    argv = [
        binary,
        f"--host={s.host}",
        f"--port={s.client_port}",
        f"--global_segment_size={parse_size(s.pool_size)}",
        f"--master_server_address={s.master_address}",
        f"--metadata_server={s.metadata_url}",
        "--protocol=tcp",
        f"--enable_offload={'true' if s.enable_disk else 'false'}",
        "--enable_http_server=true",
        f"--http_port={s.client_http_port}",
        "--logtostderr=true",
    ]
    env: dict[str, str] = {}
    if s.enable_disk:
        env = {
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": s.disk_path,
            # What the pool owner reports to the master as the tier's size ...
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(parse_size(s.disk_size)),
            # ... and what its bucket backend enforces: unset, that is 90% of
            # the physical disk, and a full tier refuses writes instead of
            # dropping its least recently used buckets.
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(parse_size(s.disk_size)),
            "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru",
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(s.disk_write_interval_s),
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(s.disk_bucket_keys),
            "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(parse_size(s.disk_bucket_size)),
            "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(parse_size(s.disk_staging_size)),
        }
    return Command("client", argv, env)


def engine_store_config(s: KvStoreSettings) -> dict:
    """The JSON an engine's MooncakeStoreConnector reads (MOONCAKE_CONFIG_PATH).

    ``standalone-store``: the engine contributes no memory; the pool owner
    holds every object. The ``tandem`` block carries the retention policy
    and whether engines pack blocks, read by :mod:`services.kvstore.connector`
    inside the engine.
    """
    return {
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": s.engine_buffer_size,
        "protocol": "tcp",
        "device_name": "",
        "metadata_server": s.metadata_url,
        "master_server_address": s.master_address,
        "enable_offload": s.enable_disk,
        ENGINE_CONFIG_TANDEM_KEY: {
            "retention": s.retention,
            "session_ttl_ms": int(s.session_ttl_s * 1000),
            # Router hints: pins are capped at what the master accepts, and a
            # released session's blocks are removed once their lease is over.
            "max_pin_ttl_ms": max_pin_ttl_ms(s),
            "lease_ttl_ms": s.lease_ttl_ms,
            "pack_blocks": s.pack_blocks,
            "pack_staging_bytes": parse_size(s.pack_staging_size),
            "transfer": s.transfer,
            "pool_owner_address": s.pool_owner_address,
            "kvstore_health_url": f"http://{s.host}:{s.http_port}/health",
        },
    }
