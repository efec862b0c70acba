"""Engine side of the KV store: the connector config an engine uses with the store.

``services/engine/config.py`` calls :func:`with_store` when the engine runs
with ``--kv-store-config``: the role's NIXL config (P→D hand-off) and
Tandem's store connector (shared prefix pool) are combined in vLLM's
``MultiConnector``. An aggregated engine (role ``both``, no NIXL) gets the
store connector alone. :func:`check_store` fails fast, naming the setting,
when the store is not there.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlparse

STORE_CONNECTOR = "TandemStoreConnector"
STORE_CONNECTOR_MODULE = "services.kvstore.connector"
# Top-level keys that belong to the whole connector, not to one child.
_TOP_LEVEL = ("kv_load_failure_policy",)


def register_connector() -> None:
    """Make vLLM's connector registry know the store connector by name.

    The child config's ``kv_connector_module_path`` is enough to build the
    connector, but MultiConnector rebuilds each child's stats by name in the
    API process, so the name must be registered there too (idempotent).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            STORE_CONNECTOR, STORE_CONNECTOR_MODULE, STORE_CONNECTOR
        )
    except ValueError:  # already registered in this process
        pass


def store_connector(kv_role: str, config_path: str, lookup_port: int) -> dict[str, Any]:
    return {
        "kv_connector": STORE_CONNECTOR,
        "kv_connector_module_path": STORE_CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": {
            "mooncake_config_path": config_path,
            # Each engine on a host needs its own scheduler↔worker lookup
            # socket; a shared one hangs the survivor when one engine dies.
            "lookup_rpc_port": lookup_port,
        },
    }


def with_store(
    base: dict[str, Any] | None,
    config_path: str,
    lookup_port: int,
) -> dict[str, Any]:
    """``base`` (a NIXL role config, or None for an aggregated engine) plus the store."""
    register_connector()
    if base is None:
        return {
            **store_connector("kv_both", config_path, lookup_port),
            "kv_load_failure_policy": "recompute",
        }
    child = {k: v for k, v in base.items() if k not in _TOP_LEVEL}
    top = {k: base[k] for k in _TOP_LEVEL if k in base}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": base["kv_role"],
        **top,
        "kv_connector_extra_config": {
            "connectors": [child, store_connector(base["kv_role"], config_path, lookup_port)],
        },
    }


def check_store(config_path: str, timeout: float = 2.0) -> None:
    """Raise ValueError naming ``--kv-store-config`` if the store is unusable."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(
            f"--kv-store-config {config_path!r}: cannot read it ({exc.strerror}); "
            "start the KV store first (python -m services.kvstore)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-store-config {config_path!r}: not JSON ({exc})") from None
    for key in ("master_server_address", "metadata_server"):
        if not config.get(key):
            raise ValueError(f"--kv-store-config {config_path!r}: missing {key!r}")
    host, _, port = config["master_server_address"].rpartition(":")
    meta = urlparse(config["metadata_server"])
    for what, h, p in (
        ("master_server_address", host, port),
        ("metadata_server", meta.hostname, meta.port),
    ):
        try:
            with socket.create_connection((h, int(p)), timeout=timeout):
                pass
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"--kv-store-config {config_path!r}: KV store unreachable at {what}="
                f"{h}:{p} ({exc}); is the KV store running on those ports?"
            ) from None
