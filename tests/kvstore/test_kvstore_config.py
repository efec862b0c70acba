"""KV store settings, commands, engine connector config and metrics translation.

Pure logic: no Mooncake process, no engine, no mocks (the metrics input is a
sample of the real master's exposition text).
"""

from __future__ import annotations

import json
import socket

import pytest

from common.mooncake import (
    KvStoreSettings,
    client_command,
    engine_store_config,
    master_command,
    parse_size,
)
from common.ports import free_ports
from services.kvstore.engine import check_store, with_store
from services.kvstore.metrics import parse_master_metrics, translate
from services.kvstore.settings import SettingError, parse_settings, validate


def _settings(tmp_path, **kw) -> KvStoreSettings:
    kw.setdefault("disk_path", str(tmp_path / "disk"))
    return KvStoreSettings(state_dir=str(tmp_path / "state"), **kw)


def test_parse_size():
    assert parse_size("4GB") == 4 << 30
    assert parse_size("256 MB") == 256 << 20
    assert parse_size("1.5gb") == int(1.5 * (1 << 30))
    assert parse_size("1048576") == 1 << 20
    with pytest.raises(ValueError):
        parse_size("lots")


def test_env_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_KVSTORE_POOL_SIZE", "1GB")
    monkeypatch.setenv("TANDEM_KVSTORE_ENABLE_DISK", "false")
    s = parse_settings(["--master-port", "51190", "--retention", "soft-pin"])
    assert s.pool_size == "1GB" and s.enable_disk is False
    assert s.master_port == 51190 and s.retention == "soft-pin"


def test_bad_env_value_names_the_setting(monkeypatch):
    monkeypatch.setenv("TANDEM_KVSTORE_MASTER_PORT", "fifty")
    with pytest.raises(SettingError, match="--master-port.*TANDEM_KVSTORE_MASTER_PORT"):
        parse_settings([])


def test_duplicate_ports_are_refused(tmp_path):
    s = _settings(tmp_path, master_port=51190, metadata_port=51190)
    with pytest.raises(SettingError, match="--metadata-port.*already used by --master-port"):
        validate(s, check_ports=False)


def test_port_in_use_is_named(tmp_path):
    # Every other port is a free one, so a store running on the defaults
    # (a stack test elsewhere on this machine) cannot be named instead.
    names = ("master_port", "metadata_port", "master_metrics_port", "client_port", "http_port")
    others = dict(zip(names, free_ports(len(names)), strict=True))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = _settings(tmp_path, client_http_port=port, **others)
        with pytest.raises(SettingError, match=f"--client-http-port.*127.0.0.1:{port}"):
            validate(s)


def test_disk_path_blocked_by_a_file_is_named(tmp_path):
    # (CI runs as root, for whom permission bits do not block writes; a file
    # where the directory should be fails for every user.)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SettingError, match="--disk-path.*not a writable directory"):
        validate(_settings(tmp_path, disk_path=str(blocker / "disk")), check_ports=False)


def test_bad_sizes_and_ratios(tmp_path):
    with pytest.raises(SettingError, match="--pool-size"):
        validate(_settings(tmp_path, pool_size="1MB"), check_ports=False)
    with pytest.raises(SettingError, match="--disk-size"):
        validate(_settings(tmp_path, disk_size="huge"), check_ports=False)
    with pytest.raises(SettingError, match="--eviction-high-watermark"):
        validate(_settings(tmp_path, eviction_high_watermark=1.5), check_ports=False)
    # A staging buffer smaller than vLLM's disk-read batches fails those reads.
    with pytest.raises(SettingError, match="--disk-staging-size.*1280MB"):
        validate(_settings(tmp_path, disk_staging_size="128MB"), check_ports=False)
    validate(_settings(tmp_path, disk_staging_size="128MB", enable_disk=False), check_ports=False)
    with pytest.raises(SettingError, match="--disk-write-interval-s"):
        validate(_settings(tmp_path, disk_write_interval_s=0), check_ports=False)


def test_master_command_has_offload_and_ports(tmp_path):
    s = _settings(
        tmp_path,
        master_port=51190,
        metadata_port=51191,
        master_metrics_port=51192,
        lease_ttl_ms=500,
        session_ttl_s=60,
        allow_evict_pinned=False,
    )
    argv = master_command(s, "mooncake_master").argv
    assert "--rpc_port=51190" in argv and "--rpc_address=127.0.0.1" in argv
    assert "--http_metadata_server_port=51191" in argv
    assert "--enable_http_metadata_server=true" in argv
    assert "--metrics_port=51192" in argv
    # The pool owner's --enable_offload needs the master's, or it aborts.
    assert "--enable_offload=true" in argv
    assert "--default_kv_lease_ttl=500" in argv
    assert "--default_kv_soft_pin_ttl=60000" in argv
    assert "--allow_evict_soft_pinned_objects=false" in argv
    assert not any("50051" in a for a in argv)


def test_client_command_owns_pool_and_disk(tmp_path):
    s = _settings(tmp_path, pool_size="512MB", disk_size="2GB", disk_bucket_keys=8)
    cmd = client_command(s, "mooncake_client")
    assert f"--global_segment_size={512 << 20}" in cmd.argv
    assert f"--master_server_address=127.0.0.1:{s.master_port}" in cmd.argv
    assert f"--metadata_server=http://127.0.0.1:{s.metadata_port}/metadata" in cmd.argv
    assert "--enable_offload=true" in cmd.argv
    assert cmd.env["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] == s.disk_path
    assert cmd.env["MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] == str(2 << 30)
    assert cmd.env["MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"] == "8"
    # --disk-size is enforced by the bucket backend too, full tier drops LRU buckets.
    assert cmd.env["MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE"] == str(2 << 30)
    assert cmd.env["MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"] == "lru"
    assert cmd.env["MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS"] == "10"
    no_disk = client_command(_settings(tmp_path, enable_disk=False), "mooncake_client")
    assert "--enable_offload=false" in no_disk.argv and no_disk.env == {}


def test_engine_store_config_is_what_vllm_reads(tmp_path):
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    s = _settings(tmp_path, retention="soft-pin", session_ttl_s=90)
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(engine_store_config(s)))
    cfg = MooncakeStoreConfig.from_file(str(path))  # vLLM's own parser
    assert cfg.mode == "standalone-store" and cfg.global_segment_size == 0
    assert cfg.master_server_address == s.master_address
    assert cfg.metadata_server == s.metadata_url and cfg.enable_offload
    assert engine_store_config(s)["tandem"] == {
        "retention": "soft-pin",
        "session_ttl_ms": 90_000,
        "max_pin_ttl_ms": 86_400_000,
        "lease_ttl_ms": s.lease_ttl_ms,
        "pack_blocks": False,
        "pack_staging_bytes": 128 << 20,
        "transfer": "auto",
        "pool_owner_address": f"127.0.0.1:{s.client_port}",
        "kvstore_health_url": f"http://127.0.0.1:{s.http_port}/health",
    }


def test_pack_blocks_reaches_every_engine_of_the_store(tmp_path, monkeypatch):
    """One setting per deployment: the store's flag (or env var) goes into the
    config every engine's connector reads."""
    from services.kvstore.connector import packing_of

    assert packing_of(engine_store_config(_settings(tmp_path))) is None
    packed = _settings(tmp_path, pack_blocks=True, pack_staging_size="32MB")
    assert packing_of(engine_store_config(packed)) == 32 << 20
    monkeypatch.setenv("TANDEM_KVSTORE_PACK_BLOCKS", "true")
    assert parse_settings(["--state-dir", str(tmp_path)]).pack_blocks
    with pytest.raises(SettingError, match="--pack-staging-size"):
        validate(_settings(tmp_path, pack_staging_size="lots"), check_ports=False)


def test_transfer_setting_reaches_engines(tmp_path):
    from services.kvstore.connector import transfer_of

    # Shared memory needs no packing (the KV cache itself is shared).
    shm = _settings(tmp_path, transfer="shm", client_port=51234)
    validate(shm, check_ports=False)
    assert transfer_of(engine_store_config(shm)) == ("shm", "127.0.0.1:51234")
    assert transfer_of({}) == ("tcp", None)  # a config written before the setting
    with pytest.raises(SettingError, match="--transfer"):
        validate(_settings(tmp_path, transfer="rdma"), check_ports=False)


def test_auto_transfer_uses_shared_memory_only_with_a_local_pool_owner():
    from services.kvstore.shm import is_local_address, wants_shm

    assert wants_shm("auto", "127.0.0.1:51103") and wants_shm("auto", "localhost:51103")
    # TEST-NET-1 (RFC 5737): no interface here has it; an unknown name neither.
    assert not wants_shm("auto", "192.0.2.7:51103")
    assert not wants_shm("auto", "no-such-host.invalid:51103")
    assert wants_shm("shm", "192.0.2.7:51103") and not wants_shm("tcp", "127.0.0.1:51103")
    assert is_local_address(socket.gethostname())
    with pytest.raises(ValueError, match="transfer"):
        wants_shm("nvlink", "127.0.0.1:1")


def test_multiconnector_for_pd_roles():
    nixl = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 10},
    }
    cfg = with_store(nixl, "/x/engine.json", lookup_port=51010)
    assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == "kv_producer"
    assert cfg["kv_load_failure_policy"] == "recompute"
    first, store = cfg["kv_connector_extra_config"]["connectors"]
    assert first["kv_connector"] == "NixlConnector" and "kv_load_failure_policy" not in first
    assert store["kv_connector"] == "TandemStoreConnector"
    assert store["kv_connector_module_path"] == "services.kvstore.connector"
    assert store["kv_role"] == "kv_producer"
    assert store["kv_connector_extra_config"] == {
        "mooncake_config_path": "/x/engine.json",
        "lookup_rpc_port": 51010,
    }
    # vLLM accepts it (MultiConnector builds each child's KVTransferConfig).
    from vllm.config import KVTransferConfig

    KVTransferConfig(**cfg)
    KVTransferConfig(**store)


def test_aggregated_engine_gets_store_alone():
    cfg = with_store(None, "/x/engine.json", lookup_port=7)
    assert cfg["kv_connector"] == "TandemStoreConnector" and cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"


def test_engine_settings_use_the_store():
    from services.engine.config import EngineSettings

    def settings(role, store):
        return EngineSettings(role=role, grpc_port=51010, kv_store_config=store)

    assert settings("prefill", None).kv_transfer_config("cpu")["kv_connector"] == "NixlConnector"
    assert settings("both", None).kv_transfer_config("cpu") is None
    assert (
        settings("decode", "/s.json").kv_transfer_config("cpu")["kv_connector"] == "MultiConnector"
    )
    assert (
        settings("both", "/s.json").kv_transfer_config("cpu")["kv_connector"]
        == "TandemStoreConnector"
    )


def test_check_store_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="--kv-store-config.*cannot read"):
        check_store(str(tmp_path / "missing.json"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, not listening: connection refused
        path = tmp_path / "engine.json"
        path.write_text(
            json.dumps(
                {
                    "master_server_address": f"127.0.0.1:{dead}",
                    "metadata_server": f"http://127.0.0.1:{dead}/metadata",
                }
            )
        )
        with pytest.raises(ValueError, match="KV store unreachable at master_server_address"):
            check_store(str(path), timeout=0.5)


def test_retention_applies_soft_pin():
    from mooncake.store import ReplicateConfig, SoftPinAction

    from services.kvstore.connector import apply_retention, retention_of

    rc = ReplicateConfig()
    assert not apply_retention(rc, retention_of({}))
    assert apply_retention(
        rc, retention_of({"tandem": {"retention": "soft-pin", "session_ttl_ms": 5000}})
    )
    assert rc.soft_pin_action == SoftPinAction.ENABLE and rc.soft_pin_ttl_ms == 5000


# A trimmed sample of mooncake_master 0.3.13's /metrics text.
MASTER_TEXT = """\
# HELP master_key_count Total number of keys managed by the master
# TYPE master_key_count gauge
master_key_count 12
# HELP master_soft_pin_key_count Total number of soft-pinned keys managed by the master
# TYPE master_soft_pin_key_count gauge
master_soft_pin_key_count 3
# HELP master_allocated_bytes Total memory bytes currently allocated across all segments
# TYPE master_allocated_bytes gauge
master_allocated_bytes 70778880
# HELP master_total_capacity_bytes Total memory capacity across all mounted segments
# TYPE master_total_capacity_bytes gauge
master_total_capacity_bytes 268435456
# HELP segment_allocated_bytes Total memory bytes currently allocated of the segment
# TYPE segment_allocated_bytes gauge
segment_allocated_bytes{segment="127.0.0.1:12817"} 70778880
# HELP mem_cache_hit_nums_ Total number of GetReplicaList results served from the memory pool
# TYPE mem_cache_hit_nums_ counter
mem_cache_hit_nums_ 24
# HELP file_cache_hit_nums_ Total number of GetReplicaList results served from the SSD cache
# TYPE file_cache_hit_nums_ counter
file_cache_hit_nums_ 5
# HELP mem_cache_hit_bytes_total Total bytes of GetReplicaList results served from the memory pool
# TYPE mem_cache_hit_bytes_total counter
mem_cache_hit_bytes_total 1000
# HELP mem_cache_nums_ Current number of cached values in the memory pool
# TYPE mem_cache_nums_ gauge
mem_cache_nums_ 9
# HELP file_cache_nums_ Current number of cached values in SSD cache
# TYPE file_cache_nums_ gauge
file_cache_nums_ 7
# HELP total_get_nums_ Total number of GetReplicaList operations
# TYPE total_get_nums_ counter
total_get_nums_ 31
# HELP valid_get_nums_ Total number of valid GetReplicaList operations
# TYPE valid_get_nums_ counter
valid_get_nums_ 29
# HELP master_evicted_key_count Total number of keys evicted
# TYPE master_evicted_key_count counter
master_evicted_key_count 4
# HELP master_put_start_alloc_failures_total Total number of PutStart failures caused by replica allocation failure
# TYPE master_put_start_alloc_failures_total counter
master_put_start_alloc_failures_total 2
"""  # noqa: E501 (the master's own HELP line)


def _samples(families) -> dict[str, float]:
    out = {}
    for fam in families:
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_translate_master_metrics():
    raw = parse_master_metrics(MASTER_TEXT)
    # Names the master wrote without _total survive the parser's renaming.
    assert raw["mem_cache_hit_nums_"] == 24 and raw["master_evicted_key_count"] == 4
    got = _samples(translate(raw))
    assert got["tandem_kvstore_objects"] == 12
    assert got["tandem_kvstore_pinned_objects"] == 3
    assert got["tandem_kvstore_tier_objects{tier=memory}"] == 9
    assert got["tandem_kvstore_tier_objects{tier=disk}"] == 7
    assert got["tandem_kvstore_used_bytes{tier=memory}"] == 70778880
    assert got["tandem_kvstore_capacity_bytes{tier=memory}"] == 268435456
    assert got["tandem_kvstore_hits_total{tier=memory}"] == 24
    assert got["tandem_kvstore_hits_total{tier=disk}"] == 5
    assert got["tandem_kvstore_hit_bytes_total{tier=memory}"] == 1000
    assert got["tandem_kvstore_misses_total"] == 2
    assert got["tandem_kvstore_evicted_objects_total"] == 4
    assert got["tandem_kvstore_alloc_failures_total"] == 2
    # Absent sources are skipped, not reported as zero.
    assert "tandem_kvstore_promotions_total" not in got


def test_translated_names_are_valid_exposition():
    from prometheus_client import CollectorRegistry, generate_latest

    class Fixed:
        def collect(self):
            return translate(parse_master_metrics(MASTER_TEXT))

    registry = CollectorRegistry()
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    assert 'tandem_kvstore_hits_total{tier="disk"} 5.0' in text
    assert "# TYPE tandem_kvstore_objects gauge" in text


def test_store_launch_for_tandem_up(tmp_path):
    from services.kvstore.api import store_launch
    from services.kvstore.settings import parse_settings

    launch = store_launch(
        tmp_path,
        ports=[51190, 51191, 51192, 51193, 51194, 9190],
        pool_size="1GB",
        retention="soft-pin",
        enable_disk=False,
    )
    assert launch.argv[1:3] == ["-m", "services.kvstore"]
    # The argv parses back to the same settings (what the child will run with).
    assert parse_settings(launch.argv[3:]) == launch.settings
    assert launch.engine_flags == ["--kv-store-config", str(tmp_path / "mooncake-engine.json")]
    assert launch.health_url == "http://127.0.0.1:9190/health"
    with pytest.raises(ValueError, match="ports"):
        store_launch(tmp_path, ports=[1, 2])


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    """Mooncake aborts on a relative disk path; the engines run from another cwd."""
    monkeypatch.chdir(tmp_path)
    s = parse_settings(["--state-dir", "state", "--disk-path", "state/disk"])
    assert s.state_dir == str(tmp_path / "state")
    assert s.disk_path == str(tmp_path / "state" / "disk")
