"""What a process supervisor (``tandem up``, tests, the bench) needs to run the store.

    launch = store_launch(state_dir, ports=[...6 free ports...])
    popen = subprocess.Popen(launch.argv, env={**os.environ, **launch.env})
    wait_ready(launch.health_url, timeout=120, alive=lambda: popen.poll() is None)
    engine_argv += launch.engine_flags          # every prefill/decode engine

Start the store before the engines: an engine started with
``--kv-store-config`` refuses to start when the store is not reachable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.mooncake import KvStoreSettings
from common.settings import to_argv

_PORT_FIELDS = (
    "master_port",
    "metadata_port",
    "master_metrics_port",
    "client_port",
    "client_http_port",
    "http_port",
)


@dataclass(frozen=True)
class StoreLaunch:
    settings: KvStoreSettings
    argv: list[str]
    env: dict[str, str]

    @property
    def health_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.http_port}/health"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.http_port}/metrics"

    @property
    def engine_flags(self) -> list[str]:
        """Flags for ``python -m services.prefill|decode|engine``."""
        return ["--kv-store-config", self.settings.engine_config_path]


def store_launch(
    state_dir: str | Path, host: str = "127.0.0.1", ports: list[int] | None = None, **overrides
) -> StoreLaunch:
    """The command line for ``python -m services.kvstore`` with these settings.

    ``ports``: six ports in the order master RPC, metadata HTTP, master
    metrics, pool-owner RPC, pool-owner health, service HTTP (default: the
    settings' defaults). ``overrides``: any other :class:`KvStoreSettings`
    field (``pool_size="8GB"``, ``retention="soft-pin"``, ...).
    """
    state = Path(state_dir)
    values = {"host": host, "state_dir": str(state), "disk_path": str(state / "disk")}
    if ports is not None:
        if len(ports) != len(_PORT_FIELDS):
            raise ValueError(f"ports: need {len(_PORT_FIELDS)} ({', '.join(_PORT_FIELDS)})")
        values.update(zip(_PORT_FIELDS, ports))
    values.update(overrides)
    settings = KvStoreSettings(**values)
    argv = [
        sys.executable,
        "-m",
        "services.kvstore",
        *to_argv(settings, always=("state_dir", "disk_path")),
    ]
    return StoreLaunch(settings, argv, {})


def wait_ready(
    health_url: str,
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
) -> dict:
    """Block until the store reports healthy; RuntimeError if it died first."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the KV store process exited during start-up (see its log)")
        try:
            resp = httpx.get(health_url, timeout=2)
            if resp.status_code == 200:
                return resp.json()
            last = resp.text
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.3)
    raise TimeoutError(f"KV store not healthy at {health_url} after {timeout:.0f}s: {last}")
