"""What the KV store holds, block by block, for the KV store tests.

A Mooncake client of its own (segment size 0, like an engine) asks the store
about the keys vLLM's MooncakeStoreConnector writes for a prompt: the test
computes the prompt's block hashes as vLLM does (the router's BlockHasher)
and builds the connector's key format
(``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py``,
``PoolKey``; single rank, group 0). If that format changes, ``wait_written``
fails loudly: no block ever appears.

Every existence check or replica lookup grants the object a read lease
(the store's ``--lease-ttl-ms``), which keeps it from being evicted and makes
it recent in LRU order: check before and after pressure, not during it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from services.router.routing.hashing import BlockHasher


class StoreClient:
    def __init__(self, engine_config: str | Path, model: str, block_size: int = 128) -> None:
        from mooncake.store import MooncakeDistributedStore

        cfg = json.loads(Path(engine_config).read_text())
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", cfg["metadata_server"], 0, 16 << 20, "tcp", "",
                              cfg["master_server_address"])
        assert rc == 0, f"Mooncake client setup failed: {rc}"
        self.prefix = f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
        self.hasher = BlockHasher(block_size)

    def close(self) -> None:
        self.store.close()

    def keys(self, token_ids: list[int]) -> list[str]:
        """The store keys of the prompt's full blocks, in order."""
        return [self.prefix + h.hex() for h in self.hasher.block_hashes(token_ids)]

    def present(self, keys: list[str]) -> list[bool]:
        return [r == 1 for r in self.store.batch_is_exist(keys)]

    def tiers(self, keys: list[str]) -> list[set[str]]:
        """Per key, the tiers holding a replica: "memory", "disk" (empty: gone)."""
        descs = self.store.batch_get_replica_desc(keys)
        out = []
        for key in keys:
            tiers = set()
            for d in descs.get(key, []):
                if d.is_memory_replica():
                    tiers.add("memory")
                elif d.is_disk_replica() or d.is_local_disk_replica():
                    tiers.add("disk")
            out.append(tiers)
        return out

    def wait_written(self, keys: list[str], timeout: float = 120) -> None:
        """Puts are asynchronous to the request: wait until every key is there."""
        deadline = time.monotonic() + timeout
        while not all(present := self.present(keys)):
            assert time.monotonic() < deadline, (
                f"blocks never reached the store: {present} (if none did, the key "
                "format of vLLM's store connector changed)")
            time.sleep(0.5)
