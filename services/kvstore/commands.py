"""What to run: Mooncake command lines and the engines' store config (pure, no I/O).

Kept apart from the supervisor so tests check every flag without starting
anything, and so ``tandem up`` and the Helm chart build the same commands.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from services.kvstore.settings import KvStoreSettings, parse_size

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
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU)")
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
            "kvstore_health_url": f"http://{s.host}:{s.http_port}/health",
        },
    }
