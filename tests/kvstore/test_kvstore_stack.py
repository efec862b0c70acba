"""The KV store with real Mooncake processes and real vLLM engines (no mocks).

One store and two engines for the whole module (a prefill and a decode engine,
both using the store through MultiConnector[NIXL + Mooncake store]); the
prefill engine is restarted once. Prompts are ~1.5K tokens, outputs a few
tokens, so the module stays within a few minutes on 2 cores. Timings are
printed for the closing note, never asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.engine_client import EngineClient, long_prompt
from common.ports import free_ports
from services.stack import engine_cores, engine_env
from tests.helpers import StoreClient

pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENGINE_START_S = 600


class Store:
    def __init__(self, tmp: Path, pool_size: str = "256MB") -> None:
        (
            self.master,
            self.metadata,
            self.master_metrics,
            self.client,
            self.client_http,
            self.http,
        ) = free_ports(6)
        self.state = tmp / "kvstore"
        self.disk = tmp / "kvstore-disk"
        self.args = [
            "--state-dir",
            str(self.state),
            "--disk-path",
            str(self.disk),
            "--master-port",
            str(self.master),
            "--metadata-port",
            str(self.metadata),
            "--master-metrics-port",
            str(self.master_metrics),
            "--client-port",
            str(self.client),
            "--client-http-port",
            str(self.client_http),
            "--http-port",
            str(self.http),
            "--pool-size",
            pool_size,
            # Every object its own disk bucket, written within a second (a
            # bucket is written only once full: a prompt's odd last block would
            # wait for the next prompt); short lease so eviction is not blocked
            # by the reads the test just made.
            "--disk-bucket-keys",
            "1",
            "--disk-bucket-size",
            "16MB",
            "--disk-write-interval-s",
            "1",
            "--lease-ttl-ms",
            "500",
            "--client-ttl-s",
            "3",
            "--restart-backoff-s",
            "0.5",
            # Eviction keeps room for a whole 11-block prompt: at the default 0.9
            # watermark a put that does not fit is refused (the master evicts 5%
            # only after the failed put, and vLLM does not retry), so a prompt
            # reaching a nearly full pool is stored only in part.
            "--eviction-high-watermark",
            "0.6",
            "--eviction-ratio",
            "0.2",
        ]
        with open(tmp / "kvstore.log", "wb") as log:
            self.proc = subprocess.Popen(
                [PY, "-m", "services.kvstore", *self.args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.http}"
        self.wait_healthy(120)

    @property
    def engine_config(self) -> str:
        return str(self.state / "mooncake-engine.json")

    def health(self) -> tuple[int, dict]:
        try:
            r = httpx.get(self.url + "/health", timeout=3)
            return r.status_code, r.json()
        except httpx.HTTPError:
            return 0, {}

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore exited with {self.proc.returncode}")
            code, body = self.health()
            if code == 200:
                return body
            time.sleep(0.5)
        raise TimeoutError(f"kvstore not healthy after {timeout}s: {self.health()}")

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for s in fam.samples:
                key = s.name + (
                    "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                    if s.labels
                    else ""
                )
                out[key] = s.value
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


class Engine:
    def __init__(self, module: str, tmp: Path, store: Store, cpu: int | None, name: str) -> None:
        self.grpc, self.metrics_port = free_ports(2)
        self.nixl = free_ports(1)[0]
        self.module, self.tmp, self.store, self.cpu, self.name = module, tmp, store, cpu, name
        self.repicked_ports = False
        self.start()

    def start(self) -> None:
        env = {**os.environ, **engine_env(1, self.cpu)}
        with open(self.tmp / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    PY,
                    "-m",
                    self.module,
                    "--grpc-port",
                    str(self.grpc),
                    "--metrics-port",
                    str(self.metrics_port),
                    "--nixl-port",
                    str(self.nixl),
                    "--dtype",
                    "float32",
                    "--enforce-eager",
                    "--max-model-len",
                    "4096",
                    "--shutdown-grace-s",
                    "2",
                    "--kv-store-config",
                    self.store.engine_config,
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.client = EngineClient(self.grpc, self.metrics_port)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not self.repicked_ports and self._port_was_taken():
                    # The ports were free when picked, but the engine binds them
                    # only once vLLM is up (minutes later, on a busy machine):
                    # another process (the other engine's vLLM) took one. Once.
                    self.repicked_ports = True
                    self.client.close()
                    self.grpc, self.metrics_port = free_ports(2)
                    self.nixl = free_ports(1)[0]
                    self.start()
                    continue
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; "
                    f"see {self.tmp / (self.name + '.log')}"
                )
            try:
                self.client.wait_ready(5)
                return
            except Exception:
                continue
        raise TimeoutError(f"{self.name} not ready after {ENGINE_START_S}s")

    def _port_was_taken(self) -> bool:
        tail = (self.tmp / f"{self.name}.log").read_bytes()[-20000:]
        return b"Failed to bind to address" in tail or b"Address already in use" in tail

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvstore-stack")


@pytest.fixture(scope="module")
def store(tmp):
    s = Store(tmp)
    yield s
    assert s.stop() == 0, "kvstore did not exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def engines(tmp, store):
    prefill_core, decode_core = engine_cores(2)
    prefill = Engine("services.prefill", tmp, store, cpu=prefill_core, name="prefill")
    decode = Engine("services.decode", tmp, store, cpu=decode_core, name="decode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:  # side by side: each takes seconds to shut down
        for engine in (prefill, decode):
            engine.terminate()
        for engine in (prefill, decode):
            engine.wait_stopped()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from common.model import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


def settle(store: Store, timeout: float = 60) -> float:
    """Wait until the store's object count stops changing (puts are asynchronous
    to the request that computed the KV)."""
    deadline = time.monotonic() + timeout
    last = -1.0
    while time.monotonic() < deadline:
        now = store.metrics().get("tandem_kvstore_objects", 0.0)
        if now == last and now > 0:
            return now
        last = now
        time.sleep(1.5)
    return last


def external_hits(client: EngineClient) -> float:
    return client.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def store_loads(client: EngineClient) -> float:
    m = client.metrics()
    return m.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)


# -- tests, in the order they run -----------------------------------------


def test_store_health_and_metrics(store):
    code, body = store.health()
    assert code == 200 and body["processes"]["master"]["ready"]
    m = store.metrics()
    assert m["tandem_kvstore_process_up{process=client}"] == 1
    assert m["tandem_kvstore_capacity_bytes{tier=memory}"] == 256 << 20
    assert m["tandem_kvstore_clients"] >= 1


def test_pd_transfer_under_multiconnector_is_token_identical(engines, tokenizer, store):
    prefill, decode = engines
    ids = long_prompt(tokenizer, 1400, seed=1)
    kv_json, _, prefill_s = prefill.client.prefill(ids)
    params = json.loads(kv_json)
    assert params.get("do_remote_prefill") is True, params
    before = external_hits(decode.client)
    pd = decode.client.generate(ids, max_tokens=12, kv_params=kv_json)
    pulled = external_hits(decode.client) - before
    # The reference is the same prompt computed locally: a unique cache salt
    # keeps it away from both the local prefix cache and the store.
    ref = decode.client.generate(ids, max_tokens=12, cache_salt="reference-1")
    print(
        f"\nP->D: prefill {prefill_s:.2f}s, decode pulled {pulled:.0f} tokens; "
        f"reference local prefill TTFT {ref.seconds:.2f}s"
    )
    assert pulled >= 1280, "decode did not receive the prompt KV (NIXL or store)"
    assert pd.token_ids == ref.token_ids
    # The prefill engine also wrote the prompt's blocks to the store.
    assert settle(store) >= 10


def test_cross_engine_reuse_through_store(engines, tokenizer, store):
    """A prompt prefilled on engine A is served on engine B from the store."""
    prefill, decode = engines
    ids = long_prompt(tokenizer, 1500, seed=2)
    kv_json, _, cold_s = prefill.client.prefill(ids)  # A computes it and puts it
    # B (decode engine) gets the prompt alone, without the NIXL hand-off: its
    # only source is the shared store.
    settle(store)
    before = external_hits(decode.client)
    warm = decode.client.generate(ids, max_tokens=4)
    from_store = external_hits(decode.client) - before
    cold = decode.client.generate(ids, max_tokens=4, cache_salt="cold-2")
    print(
        f"\ncross-engine: B from store {warm.seconds:.2f}s vs cold {cold.seconds:.2f}s "
        f"(ratio {cold.seconds / max(warm.seconds, 1e-6):.1f}x), {from_store:.0f} tokens "
        f"from the store, cached_tokens={warm.cached_tokens}"
    )
    assert from_store >= 1408  # 11 full blocks of 128
    assert warm.token_ids == cold.token_ids
    # Release the KV the prefill engine holds for a decode that never pulled it.
    decode.client.stub.ReleaseKv(
        __import__("common.proto.engine_pb2", fromlist=["x"]).ReleaseKvRequest(
            request_id="rel-2", kv_transfer_params_json=kv_json
        )
    )


def test_prefill_restart_served_from_store(engines, tokenizer, store):
    prefill, _ = engines
    ids = long_prompt(tokenizer, 1500, seed=3)
    _, _, first_s = prefill.client.prefill(ids)
    settle(store)
    prefill.stop()
    # The restarted engine also switches to the soft-pin retention policy
    # (read from the store's engine config when its connector starts).
    config_path = Path(store.engine_config)
    config = json.loads(config_path.read_text())
    config["tandem"]["retention"] = "soft-pin"
    config_path.write_text(json.dumps(config))
    prefill.start()
    prefill.wait_ready()
    before = external_hits(prefill.client)
    _, _, again_s = prefill.client.prefill(ids)
    loaded = external_hits(prefill.client) - before
    print(
        f"\nprefill restart: first {first_s:.2f}s, after restart {again_s:.2f}s, "
        f"{loaded:.0f} tokens loaded from the store"
    )
    assert loaded >= 1408
    # New KV from the restarted engine is soft-pinned.
    pinned = store.metrics().get("tandem_kvstore_pinned_objects", 0)
    prefill.client.prefill(long_prompt(tokenizer, 600, seed=4))
    deadline = time.monotonic() + 30
    while store.metrics().get("tandem_kvstore_pinned_objects", 0) <= pinned:
        assert time.monotonic() < deadline, "soft-pin policy did not pin the engine's puts"
        time.sleep(0.5)


def test_pool_overflow_spills_to_disk_and_reads_back(engines, tokenizer, store):
    """256 MB pool (43 blocks of 5.9 MB; eviction above 60%), each 1.5K-token
    prompt 11 blocks: a prompt is written, copied to the disk tier, pushed out
    of RAM by six more, and read back from disk by the decode engine.

    Mooncake's disk tier (offload at put, its default) writes every object to
    disk in buckets shortly after the put, and a RAM eviction waits for that
    copy; the RAM replica is what eviction drops. The prefill engine pins its
    puts since the restart test (soft-pin policy), so the oldest pinned
    prompt, this one, goes once the unpinned blocks are gone.
    """
    from common.model import resolve_model

    prefill, decode = engines
    client = StoreClient(store.engine_config, resolve_model(None).name)
    try:
        first = long_prompt(tokenizer, 1500, seed=100)
        keys = client.keys(first)
        prefill.client.prefill(first)
        client.wait_written(keys)
        deadline = time.monotonic() + 120
        while not all("disk" in t for t in client.tiers(keys)):
            assert time.monotonic() < deadline, f"never copied to disk: {client.tiers(keys)}"
            time.sleep(2)
        # Pressure: no lookups of `first` meanwhile (a read lease blocks eviction).
        for i in range(1, 7):
            prefill.client.prefill(long_prompt(tokenizer, 1500, seed=100 + i))
            settle(store, timeout=20)
        tiers = client.tiers(keys)
        m = store.metrics()
        print(
            f"\noverflow: memory objects {m.get('tandem_kvstore_tier_objects{tier=memory}')}, "
            f"disk objects {m.get('tandem_kvstore_tier_objects{tier=disk}')}, evicted "
            f"{m.get('tandem_kvstore_evicted_objects_total')}; first prompt's blocks: "
            f"{sum(t == {'disk'} for t in tiers)}/{len(keys)} on disk only"
        )
        assert all(t == {"disk"} for t in tiers), f"not (only) on disk: {tiers}"
        assert any(store.disk.rglob("*.bucket")), "disk tier directory holds no bucket"
        disk_hits_before = m.get("tandem_kvstore_hits_total{tier=disk}", 0)
        before = external_hits(decode.client)
        out = decode.client.generate(first, max_tokens=6)
        loaded = external_hits(decode.client) - before
        disk_hits = (
            store.metrics().get("tandem_kvstore_hits_total{tier=disk}", 0) - disk_hits_before
        )
        ref = decode.client.generate(first, max_tokens=6, cache_salt="overflow-ref")
        print(
            f"overflow read-back: {loaded:.0f} tokens from the store, disk hits "
            f"{disk_hits:.0f}, {out.seconds:.2f}s vs recompute {ref.seconds:.2f}s"
        )
        assert loaded >= 1408, "the prompt did not come back from the store"
        assert disk_hits >= len(keys), "the master counted no disk-tier reads"
        assert out.token_ids == ref.token_ids
        assert store.health()[0] == 200
    finally:
        client.close()


def test_pool_owner_killed_mid_traffic(engines, tokenizer, store):
    """Kill mooncake_client while requests run: none fails, errors are counted,
    the supervisor restarts it and the store serves again."""
    prefill, decode = engines
    pid = store.health()[1]["processes"]["client"]["pid"]
    restarts = store.metrics()["tandem_kvstore_process_restarts_total{process=client}"]
    import concurrent.futures as cf

    def pd_request(i: int):
        ids = long_prompt(tokenizer, 1000, seed=200 + i)
        kv_json, _, _ = prefill.client.prefill(ids)
        return decode.client.generate(ids, max_tokens=2, kv_params=kv_json)

    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(pd_request, i) for i in range(4)]
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        results = [f.result(timeout=600) for f in futures]  # raises if any failed
    assert all(len(r.token_ids) == 2 for r in results)
    # Errors are counted: failed store operations show in the engines' metrics.
    errors = sum(
        v
        for k, v in {**prefill.client.metrics(), **decode.client.metrics()}.items()
        if k.startswith("vllm:mooncake_store_operation_total{status=") and "status=ok" not in k
    )
    body = store.wait_healthy(120)
    assert body["processes"]["client"]["pid"] != pid
    m = store.metrics()
    assert m["tandem_kvstore_process_restarts_total{process=client}"] == restarts + 1
    restarts_now = m["tandem_kvstore_process_restarts_total{process=client}"]
    print(
        f"\nclient killed: {len(results)} requests all answered; engine-side store "
        f"errors counted: {errors:.0f}; restarts={restarts_now:.0f}"
    )
    # Recovery: a new prompt goes into the restarted pool and is found again.
    # Healthy means puts and gets work at once: the supervisor restarts the
    # pool owner only once the master dropped its segment and the engines'
    # shared-memory clients saw it gone (they move blocks over TCP until the
    # new one maps their KV cache).
    ids = long_prompt(tokenizer, 1000, seed=300)
    objects = store.metrics().get("tandem_kvstore_objects", 0.0)
    prefill.client.prefill(ids)
    assert settle(store) >= objects + 7  # the prompt's 7 full blocks, put asynchronously
    before = external_hits(decode.client)
    decode.client.generate(ids, max_tokens=1)
    assert external_hits(decode.client) - before >= 896


def test_bad_configuration_names_the_setting(tmp, store):
    blocker = tmp / "a-file"
    blocker.write_text("x")
    run = subprocess.run(
        [
            PY,
            "-m",
            "services.kvstore",
            "--disk-path",
            str(blocker / "disk"),
            "--state-dir",
            str(tmp / "bad"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--disk-path" in run.stderr, run.stderr
    run = subprocess.run(
        [
            PY,
            "-m",
            "services.kvstore",
            "--master-port",
            str(store.master),
            "--state-dir",
            str(tmp / "bad"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--master-port" in run.stderr, run.stderr
    # An engine pointed at a store that is not running refuses to start.
    dead = tmp / "dead.json"
    cfg = json.loads(Path(store.engine_config).read_text())
    port = free_ports(1)[0]
    cfg["master_server_address"] = f"127.0.0.1:{port}"
    dead.write_text(json.dumps(cfg))
    run = subprocess.run(
        [PY, "-m", "services.prefill", "--kv-store-config", str(dead)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "--kv-store-config" in run.stderr and "unreachable" in run.stderr, run.stderr[-2000:]
