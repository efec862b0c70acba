"""vLLM's MooncakeStoreConnector with Tandem's store config and retention policy.

Loaded inside the engine through ``kv_connector_module_path``. It adds two
things to vLLM's connector and changes nothing else:

* the path of the store's config file travels in the connector's own
  ``kv_connector_extra_config["mooncake_config_path"]`` (set as
  ``MOONCAKE_CONFIG_PATH`` before vLLM reads it), so an engine needs no extra
  environment and two engines in one process tree cannot mix their configs;
* the ``tandem.retention`` block of that file picks the ``ReplicateConfig``
  used for every put: ``soft-pin`` sets Mooncake's soft pin with the session
  TTL (pinned objects are evicted only after all unpinned ones, and only if
  the master allows evicting pinned objects at all), ``lru`` leaves
  Mooncake's default (lease, then least-recently-used eviction).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)

log = logging.getLogger("tandem.kvstore.connector")

CONFIG_PATH_KEY = "mooncake_config_path"


def retention_of(config: dict[str, Any]) -> dict[str, Any]:
    block = config.get("tandem") or {}
    return {"retention": block.get("retention", "lru"),
            "session_ttl_ms": int(block.get("session_ttl_ms", 1_800_000))}


def apply_retention(replicate_config: Any, retention: dict[str, Any]) -> bool:
    """Set soft pin on ``replicate_config`` for the soft-pin policy; True if set."""
    if retention["retention"] != "soft-pin":
        return False
    from mooncake.store import SoftPinAction

    replicate_config.soft_pin_action = SoftPinAction.ENABLE
    replicate_config.soft_pin_ttl_ms = retention["session_ttl_ms"]
    return True


class TandemStoreConnector(MooncakeStoreConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        path = extra.get(CONFIG_PATH_KEY)
        if path:
            os.environ["MOONCAKE_CONFIG_PATH"] = path
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path or not os.path.exists(path):
            raise ValueError(
                f"KV store config {path!r} not found: start the KV store "
                "(python -m services.kvstore) before the engine, or fix --kv-store-config")
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self.connector_worker
        if worker is not None:
            with open(path) as f:
                retention = retention_of(json.load(f))
            if apply_retention(worker.store_replicate_config, retention):
                log.info("KV store retention: soft-pin every put for %d ms",
                         retention["session_ttl_ms"])


def _register() -> None:
    from services.kvstore.engine import register_connector

    register_connector()


_register()
