"""Router-driven KV retention on the real stack (no mocks): the KV store
(128 MB RAM pool, no disk tier, so an evicted block is gone), a prefill and a
decode engine, and the router with `--kv-retention named-sessions`.

Which blocks the store holds is read exactly (`StoreClient` in tests/helpers.py: each
prompt's store keys from its block hashes, asked of the store by a Mooncake
client of the test's own). The master's metrics show the pins, evictions and
removals.

* A named session's blocks are soft-pinned; the same traffic without a
  session name is not. Unpinned traffic of 1.6 times the pool evicts the
  unnamed conversation and leaves the pinned session whole.
* A session's last request (`x-session-end: 1`) removes its blocks from the
  store, except the prefix another active session shares.
* A pin lapses after `--kv-retention-ttl-s` (a second router with 4 s): the
  same pressure then evicts that session's blocks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common.model import resolve_model
from common.ports import free_port
from common.procs import Proc, launch, stop_process_group, wait_http_ok
from services.router.tokenizer import ChatTokenizer
from services.stack import Stack, StackConfig
from tests.helpers import StoreClient

pytestmark = pytest.mark.stack

POOL = "128MB"  # 22 blocks of 5.6 MiB (SmolLM2 float32, 128 tokens per block)
BLOCK = 128
START_S = 1200
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "tool",
    "result",
    "file",
    "line",
    "error",
    "value",
    "session",
    "agent",
    "return",
    "config",
    "table",
    "index",
]


def text(seed: int, n_words: int) -> str:
    return " ".join(
        WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] + str(seed % 7) for i in range(n_words)
    )


class Cluster:
    """The stack, the model's tokenizer and a Mooncake client of the store."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.stack = Stack(
            StackConfig(
                router_port=free_port(),
                kv_cache_gib=1,
                max_model_len=4096,
                state_dir=tmp,
                kv_store_pool=POOL,
                # Eviction from 70% keeps room for a whole prompt (a put that does
                # not fit is refused, not waited for); short read leases.
                kv_store_args={
                    "enable_disk": False,
                    "lease_ttl_ms": 500,
                    "eviction_high_watermark": 0.7,
                    "eviction_ratio": 0.2,
                },
                # Every prompt is computed by the prefill engine, the one that
                # writes to the store, however much of it is cached elsewhere.
                router_args=[
                    "--remote-prefill-threshold",
                    "0",
                    "--kv-retention",
                    "named-sessions",
                    "--kv-retention-ttl-s",
                    "600",
                ],
                startup_timeout_s=START_S,
            )
        )
        self.routers: list[tuple[Proc, subprocess.Popen]] = []
        self.stack.start()
        try:
            self.model_dir = resolve_model(None)
            self.model = self.model_dir.name
            self.tok = ChatTokenizer(self.model_dir)
            self.store_url = next(p for p in self.stack.procs if p.name == "kvstore").url
            self.store = StoreClient(tmp / "kvstore" / "mooncake-engine.json", self.model, BLOCK)
        except BaseException:
            self.stack.stop()
            raise

    def second_router(self, *args: str) -> str:
        """Another router over the same engines (its own retention flags)."""
        port = free_port()
        prefill = next(p for p in self.stack.procs if p.name.startswith("prefill"))
        decode = next(p for p in self.stack.procs if p.name.startswith("decode"))
        log = self.tmp / f"router-{port}.log"
        argv = [
            sys.executable,
            "-m",
            "services.router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefill",
            prefill.grpc,
            "--decode",
            decode.grpc,
            "--remote-prefill-threshold",
            "0",
            *args,
        ]
        proc, popen = launch("router-b", argv, log, append=True)
        proc.url = f"http://127.0.0.1:{port}"
        self.routers.append((proc, popen))
        wait_http_ok(f"{proc.url}/health", proc, time.monotonic() + 300)
        return proc.url

    def close(self) -> None:
        for proc, popen in self.routers:
            stop_process_group(proc, grace_s=30)
            popen.wait(timeout=10)
        self.store.close()
        self.stack.stop()

    # -- requests and what the store holds ---------------------------------
    def chat(
        self,
        messages: list[dict],
        session: str | None = None,
        end: bool = False,
        url: str | None = None,
    ) -> list[int]:
        """One turn through the router; returns the prompt's token ids."""
        headers = {}
        if session:
            headers["x-session-id"] = session
        if end:
            headers["x-session-end"] = "1"
        r = httpx.post(
            f"{url or self.stack.router_url}/v1/chat/completions",
            headers=headers,
            timeout=600,
            json={"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        ids = self.tok.chat(messages)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        return ids

    def keys(self, ids: list[int]) -> list[str]:
        return self.store.keys(ids)

    def present(self, keys: list[str]) -> list[bool]:
        return self.store.present(keys)

    def wait_written(self, keys: list[str]) -> None:
        self.store.wait_written(keys)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        body = httpx.get(self.store_url + "/metrics", timeout=5).text
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                key = s.name + (
                    "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                    if s.labels
                    else ""
                )
                out[key] = s.value
        return out

    def pressure(self, seed: int, prompts: int = 9, words: int = 300) -> None:
        """Unpinned traffic (no session name) of about 1.6 times the pool. Some
        of its puts are refused when the pool is full; no lookups meanwhile."""
        for i in range(prompts):
            self.chat([{"role": "user", "content": text(seed + i, words)}])
        last, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:  # the last puts are asynchronous
            now = sum(
                v for k, v in self.metrics().items() if k.startswith("tandem_kvstore_puts_total")
            )
            if now == last:
                return
            last = now
            time.sleep(1.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("retention"))
    yield c
    c.close()


def _conversation(seed: int, first_words: int, shared: str = "") -> list[dict]:
    return [{"role": "user", "content": shared + text(seed, first_words)}]


def test_pinned_session_survives_pressure_that_evicts_unnamed_traffic(cluster):
    t0 = time.monotonic()
    shared = text(999, 160) + " "  # the opening two sessions share
    # A named session, two turns: every block either turn writes is pinned.
    pinned = _conversation(1, 90, shared)
    cluster.chat(pinned, session="pinned")
    pinned += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(2, 100)}]
    pinned_ids = cluster.chat(pinned, session="pinned")
    # The same conversation size without a session name: not pinned.
    control_ids = cluster.chat(
        _conversation(3, 250)
        + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(4, 100)}]
    )
    pinned_keys, control_keys = cluster.keys(pinned_ids), cluster.keys(control_ids)
    cluster.wait_written(pinned_keys + control_keys)
    m = cluster.metrics()
    assert m["tandem_kvstore_pinned_objects"] >= len(pinned_keys), m
    evicted_before = m.get("tandem_kvstore_evicted_objects_total", 0)

    cluster.pressure(seed=100)

    m = cluster.metrics()
    evicted = m.get("tandem_kvstore_evicted_objects_total", 0) - evicted_before
    kept, lost = cluster.present(pinned_keys), cluster.present(control_keys)
    print(
        f"\npinned session: {sum(kept)}/{len(kept)} blocks kept; unnamed control: "
        f"{sum(lost)}/{len(lost)} kept; {evicted:.0f} objects evicted by the pressure; "
        f"pinned objects {m['tandem_kvstore_pinned_objects']:.0f} "
        f"({time.monotonic() - t0:.0f}s)"
    )
    assert evicted >= len(control_keys), "the pressure did not fill the pool"
    assert all(kept), f"pinned session lost blocks under pressure: {kept}"
    assert not any(lost), f"unpinned control survived pressure (no eviction?): {lost}"
    cluster.pinned_keys = pinned_keys
    cluster.shared = shared


def test_session_end_removes_its_own_blocks_and_keeps_the_shared_prefix(cluster):
    # Shares its opening (2 full blocks) with the still-active pinned session.
    conv = _conversation(5, 150, cluster.shared)
    cluster.wait_written(cluster.keys(cluster.chat(conv, session="ending")))
    conv += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(6, 75)}]
    removes_before = cluster.metrics().get("tandem_kvstore_removes_total", 0)
    ids = cluster.chat(conv, session="ending", end=True)
    keys = cluster.keys(ids)
    shared_blocks = 0
    for a, b in zip(keys, cluster.pinned_keys):
        if a != b:
            break
        shared_blocks += 1
    assert shared_blocks >= 2, "the two sessions were meant to share their opening"
    own = keys[shared_blocks:]
    # The engine removes them once the read leases are over; look rarely (a
    # look is a read: it leases them again for 0.5 s).
    for _ in range(12):
        time.sleep(5)
        if not any(gone := cluster.present(own)):
            break
    assert not any(gone), f"released blocks still there: {gone}"
    m = cluster.metrics()
    print(
        f"\nsession end: {len(own)} own blocks removed, {shared_blocks} shared kept; "
        f"removes counted by the master: "
        f"{m.get('tandem_kvstore_removes_total', 0) - removes_before:.0f}"
    )
    assert all(cluster.present(keys[:shared_blocks])), "the shared prefix was removed"
    assert all(cluster.present(cluster.pinned_keys)), "the other session lost blocks"


def test_pin_lapses_after_the_ttl(cluster):
    short = cluster.second_router("--kv-retention", "named-sessions", "--kv-retention-ttl-s", "4")
    ids = cluster.chat(_conversation(7, 300), session="short-lived", url=short)
    written = time.monotonic()
    keys = cluster.keys(ids)
    cluster.wait_written(keys)
    time.sleep(max(0.0, written + 5 - time.monotonic()))  # the 4 s pins have lapsed
    cluster.pressure(seed=200)
    expired, pinned = cluster.present(keys), cluster.present(cluster.pinned_keys)
    print(
        f"\nexpired session: {sum(expired)}/{len(expired)} blocks kept; 600 s session: "
        f"{sum(pinned)}/{len(pinned)} kept"
    )
    assert not any(expired), f"blocks whose pin lapsed survived pressure: {expired}"
    assert all(pinned), f"the still-pinned session lost blocks: {pinned}"
