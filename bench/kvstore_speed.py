"""KV store speed on this machine: Mooncake put/get GB/s beside memcpy and raw loopback TCP,
all measured in one run.

1. **memcpy**: ``torch`` copying one batch of objects (the bytes a put or a get moves).
2. **loopback TCP**: a plain socket pair on 127.0.0.1, one thread sending the same bytes
   (``sendall``), another receiving them into a buffer (``recv_into``): what any TCP
   transport can reach here.
3. **Mooncake store**: a real store (master + standalone pool owner, as ``tandem up``
   starts it), one requester process per variant (Mooncake reads its settings from the
   environment at set-up), put then get of fresh keys every round:

   * ``tcp``: Tandem's engine path (``protocol: tcp``, buffers registered as vLLM
     registers its KV cache, zero-copy ``batch_put_from`` / ``batch_get_into``);
   * ``tcp`` with ``MC_STORE_MEMCPY=1`` and with more TCP lanes per peer;
   * ``tcp x2 threads``: the batch split over two threads (vLLM has one sending and
     one receiving thread per engine);
   * ``tcp unregistered``: ``put_batch`` / ``get_batch`` of Python buffers;
   * ``shm``: Mooncake's dummy client (``setup_dummy``) attached to the pool owner over
     shared memory; its buffers must come from the shared pool (``alloc_from_mem_pool``,
     then ``register_buffer``), so ``shm + staging copy`` adds the copy from an ordinary
     buffer (an engine's KV cache) into that pool.

4. **KV blocks as engines move them** (SmolLM2-sized blocks only: 30 layer pages of
   192 KiB in a layer-outer CPU cache, as vLLM 0.32 lays it out), the same requester
   calls vLLM's transfer threads make, from one cache into another:

   * ``layers tcp``: vLLM's own path, one buffer per layer (30 descriptors a block);
   * ``packed tcp``: ``--pack-blocks`` over TCP (``PackingStore``: pack into a staging
     row, one buffer per block; a get unpacks);
   * ``layers shm``: ``--transfer shm`` (or ``auto`` on the pool owner's host): both
     caches allocated in shared memory the pool owner maps (``SharedKVCache``, as the
     engine's connector allocates vLLM's KV cache), vLLM's per-layer calls through a
     dummy client (``SharedMemoryStore``): the pool owner copies each block once;
     what a put or get costs an engine end to end.

   These rows time a ``memcpy`` of the same bytes inside each of their own rounds
   (``memcpy*`` in the table) and report the median of each round's ratio (the put or
   get against the copy just before it): on a loaded machine a ratio to a copy timed
   minutes apart says little, and this VM's memory bandwidth drifts by 2-5x between
   rounds.

The requesters run with ``OMP_WAIT_POLICY=PASSIVE``: torch's ``memcpy`` uses OpenMP
threads that otherwise spin for a while after each copy, on a core the pool owner
needs for the put that follows it (puts measured at half the gets' speed because of
that, with 2 cores; an engine's OpenMP team is its one bound thread, so nothing
spins there).

Bandwidth is payload bytes per second (one direction) for every figure.

    python -m bench.kvstore_speed [--rounds 5] [--sizes 4KB,1MB,5898240] [--batches 1,12] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# SmolLM2-135M on vLLM's CPU backend: one 128-token block of all 30 layers, float32.
SMOLLM2_BLOCK_BYTES = 30 * 3 * 128 * 2 * 64 * 4

# name -> (how the requester connects, extra environment, threads)
VARIANTS: dict[str, tuple[str, dict[str, str], int]] = {
    "tcp": ("tcp", {}, 1),
    "tcp MC_STORE_MEMCPY=1": ("tcp", {"MC_STORE_MEMCPY": "1"}, 1),
    "tcp MC_TCP_LANES_PER_PEER=4": ("tcp", {"MC_TCP_LANES_PER_PEER": "4"}, 1),
    "tcp x2 threads": ("tcp", {}, 2),
    "tcp unregistered": ("tcp-unregistered", {}, 1),
    "shm": ("shm", {}, 1),
    "layers tcp": ("layers-tcp", {}, 1),
    "packed tcp": ("packed-tcp", {}, 1),
    "layers shm": ("layers-shm", {}, 1),
}
BLOCK_VARIANTS = ("layers-tcp", "packed-tcp", "layers-shm")
SMOLLM2_LAYERS, SMOLLM2_PAGE_SHAPE = 30, (3, 128, 2 * 64)  # heads, tokens, K+V floats


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def paired_ratio(memcpy_s: list[float], store_s: list[float]) -> float:
    """Median over rounds of the store call's speed against the memcpy of the same
    bytes timed just before it in the same round."""
    return statistics.median(m / t for m, t in zip(memcpy_s, store_s, strict=True))


def bench_memcpy(nbytes: int, rounds: int) -> float:
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return median_gbps(src.numel() * 4, times)


def bench_loopback_tcp(nbytes: int, rounds: int) -> float:
    """One connection on 127.0.0.1; each round sends ``nbytes`` and waits for all of them."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    payload = memoryview(src.numpy()).cast("B")
    landing = memoryview(dst.numpy()).cast("B")
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    server.close()

    def receive_all() -> None:
        got = 0
        while got < len(landing):
            got += receiver.recv_into(landing[got:])

    times = []
    try:
        for r in range(rounds + 1):  # round 0 warms up
            reader = threading.Thread(target=receive_all)
            start = time.perf_counter()
            reader.start()
            sender.sendall(payload)
            reader.join()
            if r:
                times.append(time.perf_counter() - start)
        if not torch.equal(src, dst):
            raise RuntimeError("loopback TCP delivered other bytes")
    finally:
        sender.close()
        receiver.close()
    return median_gbps(len(payload), times)


# -- the store ------------------------------------------------------------------


def start_store(tmp: Path, pool_bytes: int):
    from common.ports import free_ports
    from services.kvstore.api import store_launch, wait_ready

    launch = store_launch(
        tmp / "kvstore", ports=free_ports(6), pool_size=f"{pool_bytes >> 20}MB", enable_disk=False
    )
    with open(tmp / "kvstore.log", "wb") as log:
        proc = subprocess.Popen(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    launch_ok = False
    try:
        wait_ready(launch.health_url, 180, alive=lambda: proc.poll() is None)
        launch_ok = True
    finally:
        if not launch_ok:
            proc.kill()
    return launch, proc


def shared_tensor(address: int, nbytes: int) -> torch.Tensor:
    """A float32 tensor over memory Mooncake allocated (its shared pool)."""
    raw = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.float32)


def run_requester(
    mode: str, threads: int, store_args: dict, sizes: list[int], batches: list[int], rounds: int
) -> list[dict]:
    """In a requester process: put/get every (size, batch) and report GB/s."""
    from mooncake.store import MooncakeDistributedStore

    if mode in BLOCK_VARIANTS:
        return run_block_requester(mode, store_args, batches, rounds)

    store = MooncakeDistributedStore()
    largest = max(sizes) * max(batches)
    if mode == "shm":
        rc = store.setup_dummy(
            2 * largest + (64 << 20), 64 << 20, f"127.0.0.1:{store_args['client_port']}"
        )
    else:
        rc = store.setup(
            "127.0.0.1",
            store_args["metadata_url"],
            0,
            largest + (64 << 20),
            "tcp",
            "",
            store_args["master_address"],
        )
    if rc != 0:
        raise RuntimeError(f"Mooncake requester set-up ({mode}) returned {rc}")
    try:
        if mode == "shm":
            src = shared_tensor(store.alloc_from_mem_pool(largest), largest)
            dst = shared_tensor(store.alloc_from_mem_pool(largest), largest)
            src.copy_(torch.rand(largest // 4))
        else:
            src, dst = torch.rand(largest // 4), torch.zeros(largest // 4)
        if mode != "tcp-unregistered":
            for t in (src, dst):
                if store.register_buffer(t.data_ptr(), t.numel() * 4) != 0:
                    raise RuntimeError(f"register_buffer failed ({mode})")
        staging_src = torch.rand(largest // 4)  # an engine's own (unshared) KV cache
        rows = []
        for size in sizes:
            for batch in batches:
                rows.append(
                    _put_get(store, mode, threads, src, dst, staging_src, size, batch, rounds)
                )
        return rows
    finally:
        store.close()


def _put_get(
    store,
    mode: str,
    threads: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    staging_src: torch.Tensor,
    size: int,
    batch: int,
    rounds: int,
) -> dict:
    src_bytes = memoryview(src.numpy()).cast("B")
    addrs = [src.data_ptr() + i * size for i in range(batch)]
    dst_addrs = [dst.data_ptr() + i * size for i in range(batch)]
    nbytes = size * batch
    times: dict[str, list[float]] = {"put": [], "get": [], "staging": []}

    def in_threads(call, keys: list[str], ptrs: list[int]) -> list[int]:
        if threads == 1:
            return list(call(keys, ptrs, [size] * len(keys)))
        share = -(-len(keys) // threads)
        results: list[list[int]] = [[] for _ in range(threads)]

        def part(i: int) -> None:
            ks, ps = keys[i * share : (i + 1) * share], ptrs[i * share : (i + 1) * share]
            results[i] = list(call(ks, ps, [size] * len(ks))) if ks else []

        workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return [r for rs in results for r in rs]

    for r in range(rounds + 1):  # round 0 warms up
        keys = [f"speed-{mode}-{threads}-{size}-{batch}-{r}-{i}" for i in range(batch)]
        start = time.perf_counter()
        if mode == "shm":  # what an engine whose KV is not in the shared pool pays first
            src[: nbytes // 4].copy_(staging_src[: nbytes // 4])
        staged = time.perf_counter()
        if mode == "tcp-unregistered":
            put_rc = store.put_batch(
                keys, [src_bytes[i * size : (i + 1) * size] for i in range(batch)]
            )
            put_ok = put_rc == 0
        else:
            put_ok = all(x == 0 for x in in_threads(store.batch_put_from, keys, addrs))
        put_done = time.perf_counter()
        if mode == "tcp-unregistered":
            got = store.get_batch(keys)
            get_ok = [len(g) for g in got] == [size] * batch
            get_done = time.perf_counter()
            landed = b"".join(got) == bytes(src_bytes[:nbytes])
        else:
            get_ok = all(x == size for x in in_threads(store.batch_get_into, keys, dst_addrs))
            get_done = time.perf_counter()
            landed = torch.equal(src[: nbytes // 4], dst[: nbytes // 4])
            dst[: nbytes // 4].zero_()
        if not (put_ok and get_ok and landed):
            raise RuntimeError(
                f"{mode}: put ok={put_ok} get ok={get_ok} "
                f"bytes intact={landed} ({size} B x {batch})"
            )
        store.batch_remove(keys, True)  # free the pool (reads lease the objects)
        if r:
            times["staging"].append(staged - start)
            times["put"].append(put_done - staged)
            times["get"].append(get_done - put_done)
    row = {
        "object_bytes": size,
        "batch": batch,
        "put_ms": statistics.median(times["put"]) * 1e3,
        "get_ms": statistics.median(times["get"]) * 1e3,
        "put_gbps": median_gbps(nbytes, times["put"]),
        "get_gbps": median_gbps(nbytes, times["get"]),
    }
    if mode == "shm":
        row["put_with_staging_gbps"] = median_gbps(
            nbytes, [a + b for a, b in zip(times["staging"], times["put"])]
        )
    return row


def kv_cache(blocks: int, seed: int | None, shared=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A SmolLM2 KV cache as vLLM's CPU backend allocates it: one buffer, one
    ``[blocks, heads, tokens, 2 * head_size]`` float32 view per layer; in the
    shared memory of ``shared`` (a ``SharedKVCache``) when given."""
    page = SMOLLM2_BLOCK_BYTES // SMOLLM2_LAYERS // 4
    with shared or contextlib.nullcontext():
        raw = torch.zeros(SMOLLM2_LAYERS * blocks * page)
    if seed is not None:
        raw.copy_(torch.rand(raw.numel(), generator=torch.Generator().manual_seed(seed)))
    layers = [
        raw[i * blocks * page : (i + 1) * blocks * page].view(blocks, *SMOLLM2_PAGE_SHAPE)
        for i in range(SMOLLM2_LAYERS)
    ]
    return raw, layers


def run_block_requester(mode: str, store_args: dict, batches: list[int], rounds: int) -> list[dict]:
    """Whole KV blocks from one cache into another, through vLLM's TCP client and
    Tandem's ``PackingStore`` or ``SharedMemoryStore`` around it."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    from services.kvstore.packing import BlockPacker, PackingStore
    from services.kvstore.shm import SharedKVCache, SharedMemoryStore, attach

    blocks = max(batches)
    tcp = MooncakeDistributedStore()
    if tcp.setup(
        "127.0.0.1",
        store_args["metadata_url"],
        0,
        64 << 20,
        "tcp",
        "",
        store_args["master_address"],
    ):
        raise RuntimeError("Mooncake requester set-up (tcp) failed")
    shared = (
        SharedKVCache(attach(store_args["pool_owner_address"])) if mode == "layers-shm" else None
    )
    (src_raw, src), (dst_raw, dst) = kv_cache(blocks, 1, shared), kv_cache(blocks, None, shared)
    for raw in (src_raw, dst_raw):  # vLLM registers its KV cache with the store
        if tcp.register_buffer(raw.data_ptr(), raw.numel() * 4) != 0:
            raise RuntimeError("register_buffer failed for the KV cache")
    packers = BlockPacker(src), BlockPacker(dst)
    staging = 128 << 20  # the store's default --pack-staging-size
    if mode == "layers-tcp":
        stores = (tcp, tcp)
    elif mode == "packed-tcp":
        stores = tuple(PackingStore(tcp, p, staging) for p in packers)
    else:  # one sending and one receiving thread, as in an engine
        stores = (SharedMemoryStore(tcp, shared), SharedMemoryStore(tcp, shared))
    rows = []
    try:
        for batch in batches:
            times: dict[str, list[float]] = {"put": [], "get": [], "memcpy": []}
            ids = list(range(batch))
            nbytes = SMOLLM2_BLOCK_BYTES * batch
            copy_src, copy_dst = torch.rand(nbytes // 4), torch.zeros(nbytes // 4)
            for r in range(rounds + 1):  # round 0 warms up
                keys = [f"speed-{mode}-{batch}-{r}-{i}" for i in ids]
                put_args = _block_descriptors(packers[0], ids)
                get_args = _block_descriptors(packers[1], ids)
                # memcpy of the same bytes in the same round: under load, a
                # ratio to a memcpy timed minutes apart says little.
                copy_start = time.perf_counter()
                copy_dst.copy_(copy_src)
                start = time.perf_counter()
                put = stores[0].batch_put_from_multi_buffers(keys, *put_args, ReplicateConfig())
                put_done = time.perf_counter()
                got = stores[1].batch_get_into_multi_buffers(keys, *get_args)
                get_done = time.perf_counter()
                intact = all(torch.equal(a[:batch], b[:batch]) for a, b in zip(src, dst))
                if put != [0] * batch or got != [SMOLLM2_BLOCK_BYTES] * batch or not intact:
                    raise RuntimeError(f"{mode}: put {put} get {got} bytes intact={intact}")
                dst_raw.zero_()
                tcp.batch_remove(keys, True)
                if r:
                    times["memcpy"].append(start - copy_start)
                    times["put"].append(put_done - start)
                    times["get"].append(get_done - put_done)
            rows.append(
                {
                    "object_bytes": SMOLLM2_BLOCK_BYTES,
                    "batch": batch,
                    "put_ms": statistics.median(times["put"]) * 1e3,
                    "get_ms": statistics.median(times["get"]) * 1e3,
                    "put_gbps": median_gbps(nbytes, times["put"]),
                    "get_gbps": median_gbps(nbytes, times["get"]),
                    "memcpy_gbps": median_gbps(nbytes, times["memcpy"]),
                    "put_over_memcpy": paired_ratio(times["memcpy"], times["put"]),
                    "get_over_memcpy": paired_ratio(times["memcpy"], times["get"]),
                }
            )
        if shared is not None and any(s.passed_through_calls for s in stores):
            raise RuntimeError("layers-shm: some calls went over TCP, not shared memory")
        return rows
    finally:
        for store in stores:
            if isinstance(store, PackingStore):
                store.close()
        if shared is not None:
            shared.client.close()
        tcp.close()


def _block_descriptors(packer, ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """vLLM's per-block descriptors: one ``(address, length)`` per layer region."""
    addrs = [
        [int(base + b * length) for base, length in zip(packer.bases, packer.block_lens)]
        for b in ids
    ]
    return addrs, [[int(x) for x in packer.block_lens]] * len(ids)


def bench_variant(
    name: str, store_args: dict, sizes: list[int], batches: list[int], rounds: int, log: Path
) -> dict:
    mode, env, threads = VARIANTS[name]
    request = json.dumps(
        {
            "mode": mode,
            "threads": threads,
            "store": store_args,
            "sizes": sizes,
            "batches": batches,
            "rounds": rounds,
        }
    )
    with open(log, "ab") as err:
        done = subprocess.run(
            [sys.executable, "-m", "bench.kvstore_speed", "--requester", request],
            env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=600,
        )
    lines = done.stdout.decode().strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"variant": name, "error": f"requester exited {done.returncode}; see {log}"}
    return {"variant": name, "env": env, "rows": json.loads(lines[-1])}


def run(rounds: int, sizes: list[int], batches: list[int], variants: list[str]) -> dict:
    largest = max(sizes) * max(batches)
    report: dict = {
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "memcpy_gbps": {},
        "loopback_tcp_gbps": {},
        "store": [],
    }
    for size in sizes:
        for batch in batches:
            key = f"{size}x{batch}"
            report["memcpy_gbps"][key] = bench_memcpy(size * batch, rounds)
            report["loopback_tcp_gbps"][key] = bench_loopback_tcp(size * batch, rounds)
    with tempfile.TemporaryDirectory(prefix="tandem-kvstore-speed-") as d:
        launch, proc = start_store(Path(d), 4 * largest + (256 << 20))
        s = launch.settings
        store_args = {
            "metadata_url": s.metadata_url,
            "master_address": s.master_address,
            "client_port": s.client_port,
            "pool_owner_address": s.pool_owner_address,
        }
        try:
            for name in variants:
                report["store"].append(
                    bench_variant(
                        name, store_args, sizes, batches, rounds, Path(d) / "requesters.log"
                    )
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            errors = [v for v in report["store"] if "error" in v]
            if errors:  # the log dies with the temporary directory
                sys.stderr.write((Path(d) / "requesters.log").read_text()[-4000:])
    report["load_average_after"] = os.getloadavg()
    return report


def print_report(report: dict) -> None:
    load = ", ".join(f"{x:.2f}" for x in report["load_average"])
    print(
        f"KV store speed, {report['cpus']} CPUs, load average before {load}; GB/s of "
        "payload, medians; ratios against memcpy and loopback TCP of the same bytes"
    )
    print(
        f"  {'variant':<30} {'object':>9} {'batch':>5} {'put':>6} {'get':>6} "
        f"{'memcpy':>7} {'tcp':>6} {'put/mc':>6} {'get/mc':>6} {'put/tcp':>7} {'get/tcp':>7} "
        f"{'put ms':>7} {'get ms':>7}"
    )
    for variant in report["store"]:
        if "error" in variant:
            print(f"  {variant['variant']:<30} FAILED: {variant['error']}")
            continue
        for row in variant["rows"]:
            key = f"{row['object_bytes']}x{row['batch']}"
            tcp = report["loopback_tcp_gbps"][key]
            # The block variants time memcpy in their own rounds (marked *) and
            # pair each put and get with it.
            mc = row.get("memcpy_gbps", report["memcpy_gbps"][key])
            put_mc = row.get("put_over_memcpy", row["put_gbps"] / mc)
            get_mc = row.get("get_over_memcpy", row["get_gbps"] / mc)
            size = (
                f"{row['object_bytes'] / (1 << 20):.2f}MiB"
                if row["object_bytes"] >= 1 << 20
                else f"{row['object_bytes'] >> 10}KiB"
            )
            print(
                f"  {variant['variant']:<30} {size:>9} {row['batch']:>5} "
                f"{row['put_gbps']:6.2f} {row['get_gbps']:6.2f} "
                f"{mc:6.2f}{'*' if 'memcpy_gbps' in row else ' '} {tcp:6.2f} "
                f"{put_mc:6.2f} {get_mc:6.2f} "
                f"{row['put_gbps'] / tcp:7.2f} {row['get_gbps'] / tcp:7.2f} "
                f"{row['put_ms']:7.2f} {row['get_ms']:7.2f}"
            )
            if "put_with_staging_gbps" in row:
                staged = row["put_with_staging_gbps"]
                print(
                    f"  {'  shm + staging copy':<30} {'':>9} {'':>5} {staged:6.2f} "
                    f"{'':>6} {'':>7} {'':>6} {staged / mc:6.2f}"
                )
    load = ", ".join(f"{x:.2f}" for x in report["load_average_after"])
    print(
        f"load average after {load}; memcpy*: timed in the variant's own rounds, "
        "put/mc and get/mc the medians of each round's ratio"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per figure")
    parser.add_argument(
        "--sizes",
        default=f"4KB,1MB,{SMOLLM2_BLOCK_BYTES}",
        help="object sizes, comma-separated (default: 4 KiB, whose time is "
        "the per-call cost, 1 MiB and one SmolLM2 KV block, 5.6 MiB)",
    )
    parser.add_argument(
        "--batches", default="1,12", help="objects per put/get call, comma-separated"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"store variants, comma-separated, of: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requester", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requester:  # one variant, in its own process (see bench_variant)
        job = json.loads(args.requester)
        print(
            json.dumps(
                run_requester(
                    job["mode"],
                    job["threads"],
                    job["store"],
                    job["sizes"],
                    job["batches"],
                    job["rounds"],
                )
            )
        )
        return 0
    from common.mooncake import parse_size

    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if SMOLLM2_BLOCK_BYTES not in sizes and any(VARIANTS[v][0] in BLOCK_VARIANTS for v in variants):
        parser.error(f"--variants: the KV block variants need {SMOLLM2_BLOCK_BYTES} in --sizes")
    report = run(
        args.rounds,
        sizes,
        [int(b) for b in args.batches.split(",")],
        variants,
    )
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
