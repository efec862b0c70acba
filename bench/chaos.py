"""The chaos suite's harness: the agentic replay through two router replicas
sharing Redis, on the real embedded stack, while scripted faults happen, one
at a time and then overlapping; one table of what each fault cost.

Per fault (a *phase*): fresh agentic sessions (sub-agent forks included) are
replayed at steady concurrency; after ``lead_s`` the fault is injected; a
supervisor restarts whatever died, as a kubelet or a Deployment would
(engines, the KV store, Redis, a router replica); once capacity is back the
replay goes on for ``tail_s``, then stops starting requests and the phase
waits for what is in flight. The client spreads requests over the two
replicas and, as a Service in front of them would, retries a refused
connection on the other one (nothing was sent yet).

Each phase then checks the promises (docs/operate.md, "Chaos suite"):

* every request ended with a response or an explicit error before its
  deadline: a request past it is ``hang``; a stream that ends without an
  error event and without a finish_reason and ``[DONE]`` is ``truncated``;
* failures are only of the kinds the fault may cause (``Fault.allowed``);
* capacity is back within the fault's bound: every service alive, both
  replicas healthy, every engine ``available`` on both, Redis shared state up;
* no KV is left held: once the traffic is over, every engine has nothing in
  flight and no KV block in use (a prefill's leased blocks count), within
  the KV lease plus a margin.

Error kinds (`kind_of`), as the client sees them: the replay's failure kinds
(``tandem.workload.replay.FAILURES``: ``http_<status>``, ``error_event``,
``connection_lost`` e.g. when its router replica died, ``connect_failed``
when neither replica accepted the connection, ``truncated``, ``no_output``),
a request past its deadline as ``hang``, and ``decode_lost``: an error event
naming a decode pod after output tokens streamed, what request migration
would save.

    make chaos                              # every fault, its own stack
    python -m bench.chaos --faults decode_kill,redis_restart
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import RedisServer
from common.ports import free_port
from common.procs import Proc, launch, stop_process_groups
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from tandem.workload import generate
from tandem.workload.content import PromptBuilder
from tandem.workload.endpoint import served_model
from tandem.workload.replay import ReplayConfig, Replayer, RequestRecord, build_prompts

MIGRATABLE = "decode_lost"
# The replay's failure kinds (tandem.workload.replay.FAILURES) by the table's names.
KIND_OF_FAILURE = {"timeout": "hang"}
HOST = "127.0.0.1"
# A client pauses this long after a failed call before its next one.
FAILURE_PAUSE_S = 1.0


# -- the load: the agentic replay, each request with a deadline ------------------


def kind_of(rec: RequestRecord) -> str:
    """A replayed request's end as the table counts it: ``ok``, the replay's
    failure kind, or ``decode_lost`` for an error event naming a decode pod
    after output streamed (what request migration would save)."""
    if rec.ok:
        return "ok"
    if rec.failure == "error_event" and rec.output_tokens and "decode pod" in (rec.error or ""):
        return MIGRATABLE
    return KIND_OF_FAILURE.get(rec.failure or "", rec.failure or "error")


class ChaosLoad(Replayer):
    """The replay client (its sessions, sub-agent forks, deadline per request
    and failover between replicas), backing off after a failed call as an
    agent's client would."""

    async def _call(self, client: Any, rec: RequestRecord, *args: Any, **kwargs: Any) -> None:
        await super()._call(client, rec, *args, **kwargs)
        if not rec.ok:
            await asyncio.sleep(FAILURE_PAUSE_S)


# -- processes the harness restarts ------------------------------------------------


@dataclass
class Service:
    """A process the supervisor keeps running: ``start`` launches it again."""

    name: str
    alive: Callable[[], bool]
    start: Callable[[], None]
    restarts: int = 0


class KvEventsProxy:
    """A TCP relay between the routers' subscriber and one engine's KV-event
    PUB socket, so that the stream can be cut (every connection closed,
    new ones refused) and restored, as a network partition would."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


# -- the faults ----------------------------------------------------------------------


@dataclass
class Fault:
    name: str
    inject: Callable[[Any], Awaitable[None]]  # given the harness the phase runs on
    allowed: frozenset[str] = frozenset()  # error kinds this fault may cause
    recover_s: float = 60.0  # capacity must be back within this
    # More than `capacity_full` to wait for after this fault, if anything.
    recovered: Callable[[Any], Awaitable[bool]] | None = None
    # The fault's own promises, checked once the phase's traffic is over:
    # what broke, each in a few words.
    verify: Callable[[Any], Awaitable[list[str]]] | None = None


def _kill_group(proc: Proc, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.killpg(proc.pid, sig)  # type: ignore[arg-type]


async def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault not injected: {what} within {timeout_s:g}s")
        await asyncio.sleep(0.05)


async def decode_kill(h: Chaos) -> None:
    """SIGKILL the decode engine while output is streaming from it."""
    await _wait(lambda: h.load is not None and h.load.streaming > 0, 120, "a stream with tokens")
    _kill_group(h.engine("decode"))


async def prefill_kill(h: Chaos) -> None:
    """SIGKILL the prefill engine while it holds KV (computing, or leased to
    a decode that has not pulled it yet)."""
    address = h.engine("prefill").grpc
    await _wait_async(lambda: h.kv_usage(address), 120, "prefill KV in use")
    _kill_group(h.engine("prefill"))


async def _wait_async(probe: Callable[[], Awaitable[float]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault not injected: {what} within {timeout_s:g}s")
        await asyncio.sleep(0.02)


async def decode_stall(h: Chaos) -> None:
    """SIGSTOP the decode's vLLM engine core (its host stays up, sees no
    engine step, fails what is in flight at --stall-timeout-s and exits);
    SIGCONT once the host is gone, as a restarted container would."""
    await _wait(lambda: h.load is not None and h.load.streaming > 0, 120, "a stream with tokens")
    host = h.engine("decode")
    children = _children(host.pid)  # type: ignore[arg-type]
    if not children:
        raise RuntimeError("decode engine has no engine-core process to stop")
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    h.supervise_paused.add(host.name)  # the stall watcher's to notice, not the kubelet's
    try:
        await _wait(lambda: not host.alive(), h.stall_timeout_s + 60, "host exits on the stall")
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        h.supervise_paused.discard(host.name)


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


async def router_kill(h: Chaos) -> None:
    """SIGKILL router replica 1 with streams in flight."""
    await _wait(lambda: h.load is not None and h.load.streaming > 0, 120, "a stream with tokens")
    _kill_group(h.routers[0])


async def redis_restart(h: Chaos) -> None:
    """SIGKILL Redis; it comes back empty (no persistence)."""
    assert h.redis.proc is not None
    _kill_group(h.redis.proc)


async def kvstore_restart(h: Chaos) -> None:
    """SIGKILL the KV store: the Mooncake master and the client that owns
    the pool, together (the service supervises both)."""
    _kill_group(next(p for p in h.stack.procs if p.name == "kvstore"))


async def kv_events_drop(h: Chaos) -> None:
    """Cut the decode engine's KV-event stream for a few seconds."""
    assert h.proxy is not None
    h.batches_before = await h.kv_event_batches()
    await h.proxy.cut()
    await asyncio.sleep(5)
    await h.proxy.start()


async def kv_events_flowing(h: Chaos) -> bool:
    """Both replicas applied new KV-event batches from the cut engine."""
    now = await h.kv_event_batches()
    return all(now[i] > h.batches_before[i] for i in range(len(now)))


def overlap(name: str, *faults: Fault) -> Fault:
    async def inject(h: Chaos) -> None:
        await asyncio.gather(*(f.inject(h) for f in faults))

    async def recovered(h: Chaos) -> bool:
        results = [await f.recovered(h) for f in faults if f.recovered is not None]
        return all(results)

    return Fault(
        name,
        inject,
        frozenset().union(*(f.allowed for f in faults)),
        max(f.recover_s for f in faults),
        recovered if any(f.recovered for f in faults) else None,
    )


# An engine restart loads vLLM again: about a minute on an idle 2-core
# machine, several under this load.
ENGINE_RECOVER_S = 420.0
DECODE_LOSS = frozenset({MIGRATABLE, "http_503"})
FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("decode_kill", decode_kill, DECODE_LOSS, ENGINE_RECOVER_S),
        # A router restart imports vLLM's tokenizer stack and loads the
        # chat template: 75 s seen on a 2-core machine under heavy load.
        Fault("router_kill", router_kill, frozenset({"connection_lost"}), 180.0),
        Fault("redis_restart", redis_restart, frozenset(), 30.0),
        Fault("prefill_kill", prefill_kill, frozenset({"http_503"}), ENGINE_RECOVER_S),
        Fault("decode_stall", decode_stall, DECODE_LOSS, ENGINE_RECOVER_S),
        Fault("kvstore_restart", kvstore_restart, frozenset(), 120.0),
        Fault("kv_events_drop", kv_events_drop, frozenset(), 60.0, kv_events_flowing),
    )
}
FAULTS["decode_kill+redis_restart"] = overlap(
    "decode_kill+redis_restart", FAULTS["decode_kill"], FAULTS["redis_restart"]
)
FAULTS["router_kill+prefill_kill"] = overlap(
    "router_kill+prefill_kill", FAULTS["router_kill"], FAULTS["prefill_kill"]
)
# The short sequence (tests/chaos/, in `make test`): one phase, three faults
# at once, so that one engine restart bounds it.
SHORT = overlap(
    "decode_kill+router_kill+redis_restart",
    FAULTS["decode_kill"],
    FAULTS["router_kill"],
    FAULTS["redis_restart"],
)


# -- one phase's result --------------------------------------------------------------


@dataclass
class Row:
    fault: str
    requests: int
    failed: int
    migratable: int
    recover_s: float | None  # None: not within the bound
    kinds: Counter[str]
    violations: list[str] = field(default_factory=list)


def table(rows: list[Row]) -> str:
    head = (
        f"{'fault':<38} {'requests':>8} {'failed':>6} {'migratable':>10} "
        f"{'recover s':>9}  failures by kind / broken promises"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.kinds.items()) if k != "ok")
        recover = "NOT" if r.recover_s is None else f"{r.recover_s:.1f}"
        broken = ("; BROKEN: " + "; ".join(r.violations)) if r.violations else ""
        lines.append(
            f"{r.fault:<38} {r.requests:>8} {r.failed:>6} {r.migratable:>10} "
            f"{recover:>9}  {kinds or '-'}{broken}"
        )
    return "\n".join(lines)


def judge(fault: Fault, ends: list[str], recover_s: float | None) -> Row:
    """A phase's row from its requests' ends (`kind_of`)."""
    kinds = Counter(ends)
    failed = sum(n for k, n in kinds.items() if k != "ok")
    violations = [
        f"{n} {k}" for k, n in sorted(kinds.items()) if k != "ok" and k not in fault.allowed
    ]
    if recover_s is None:
        violations.append(f"capacity not back within {fault.recover_s:g}s")
    return Row(fault.name, len(ends), failed, kinds[MIGRATABLE], recover_s, kinds, violations)


# -- the harness ---------------------------------------------------------------------


@dataclass
class LoadShape:
    concurrency: int = 3
    sessions: int = 40  # per phase; more than the phase plays
    max_tokens: int = 48
    deadline_s: float = 180.0  # per request
    lead_s: float = 8.0  # traffic before the fault
    tail_s: float = 8.0  # traffic after recovery
    seed: int = 0


class ChaosHarness:
    """The phases over some deployment: `capacity_full`, `engine_addresses`
    and `urls` (where the load goes) say what it is; `Chaos` runs them on the
    embedded stack, tests/chaos/test_operator_chaos.py on the local cluster."""

    def __init__(self, model_dir: str, shape: LoadShape | None, kv_lease_s: float) -> None:
        self.model_dir = model_dir
        self.shape = shape or LoadShape()
        self.kv_lease_s = kv_lease_s
        self.urls: list[str] = []
        self.model = ""
        self.load: ChaosLoad | None = None
        self._seed = itertools.count(self.shape.seed)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    async def capacity_full(self) -> bool:
        raise NotImplementedError

    async def engine_addresses(self) -> dict[str, str]:
        """Every engine now: name → gRPC address."""
        raise NotImplementedError

    async def engines_idle(self) -> tuple[bool, str]:
        """Whether every engine has nothing in flight and no KV block in use."""
        held = []
        for name, address in (await self.engine_addresses()).items():
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    load = await pb_grpc.EngineStub(channel).GetLoad(pb.GetLoadRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                held.append(f"{name} unreachable ({exc.code().name})")
                continue
            if load.in_flight or load.kv_cache_usage:
                held.append(f"{name} in_flight={load.in_flight} kv_usage={load.kv_cache_usage:.4f}")
        return not held, "; ".join(held)

    async def _until(self, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await probe():
                return True
            await asyncio.sleep(0.25)
        return False

    # -- one phase -------------------------------------------------------------------
    async def _new_load(self) -> ChaosLoad:
        s = self.shape
        params = generate.params_for(
            "small",
            sessions=s.sessions,
            seed=next(self._seed),
            turns_median=4,
            shared_prefix=128,
            first_in_median=384,
            max_context=1536,
            out_median=24,
            out_max=s.max_tokens,
            subagent_share=0.5,
            subagent_turns_median=2,
            subagent_task_median=64,
            think_median=0.2,
        )
        sessions = generate.generate(params)
        builder = PromptBuilder(self.tokenizer, salt=os.urandom(6).hex())
        # In a thread: the KV-event relay runs on this event loop.
        prompts = await asyncio.to_thread(build_prompts, sessions, builder)
        cfg = ReplayConfig(
            url=",".join(self.urls),
            model=self.model,
            concurrency=s.concurrency,
            think_max=1.0,
            max_tokens_cap=s.max_tokens,
            timeout_s=s.deadline_s,
            session_end_header="x-session-end",
            progress=False,
        )
        return ChaosLoad(cfg, sessions, prompts, builder.salt)

    async def phase(self, fault: Fault) -> Row:
        s = self.shape
        # Each fault starts from full capacity, whatever the previous left.
        if not await self._until(self.capacity_full, ENGINE_RECOVER_S):
            raise RuntimeError(f"{fault.name}: no full capacity to start from")
        self.load = load = await self._new_load()
        runner = asyncio.create_task(load.run())
        recover_s: float | None = None
        extra: list[str] = []
        try:
            await asyncio.sleep(s.lead_s)
            try:
                await fault.inject(self)
            except RuntimeError as exc:  # e.g. no stream to kill the decode under
                extra.append(str(exc))
            injected = time.monotonic()

            async def recovered() -> bool:
                if not await self.capacity_full():
                    return False
                return fault.recovered is None or await fault.recovered(self)

            if await self._until(recovered, fault.recover_s):
                recover_s = time.monotonic() - injected
            await asyncio.sleep(s.tail_s)
        finally:
            load.stopping.set()
            try:
                # Every request has its own deadline: the load ends by then.
                await asyncio.wait_for(runner, s.deadline_s + 30)
            except TimeoutError:
                extra.append("replay did not end after the last deadline")
        row = judge(fault, [kind_of(r) for r in load.records], recover_s)
        row.violations += extra
        idle_by = self.kv_lease_s + 30

        async def idle() -> bool:
            return (await self.engines_idle())[0]

        if not await self._until(idle, idle_by):
            row.violations.append(f"KV held {idle_by:g}s after traffic: {await self._why()}")
        if fault.verify is not None:
            row.violations += await fault.verify(self)
        return row

    async def _why(self) -> str:
        return (await self.engines_idle())[1]

    async def run(self, faults: list[Fault]) -> list[Row]:
        rows = []
        for fault in faults:
            print(f"chaos: {fault.name} ...", file=sys.stderr, flush=True)
            rows.append(await self.phase(fault))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        return rows


class Chaos(ChaosHarness):
    """Two router replicas and Redis in front of `stack`'s engines (started
    here, stopped by `close`), a supervisor restarting what dies, and the
    phases."""

    def __init__(
        self,
        stack: Any,  # services.stack.Stack, started (with or without its own router)
        model_dir: str,
        log_dir: Path,
        shape: LoadShape | None = None,
        kv_lease_s: float = 10.0,
        stall_timeout_s: float = 120.0,
        kv_events_proxy: bool = False,
    ) -> None:
        super().__init__(model_dir, shape, kv_lease_s)
        self.stack = stack
        self.log_dir = log_dir
        self.stall_timeout_s = stall_timeout_s
        self.redis = RedisServer(log_dir)
        self.routers: list[Proc] = []
        self.proxy: KvEventsProxy | None = None
        self.use_proxy = kv_events_proxy
        self.batches_before: list[float] = []
        self.supervise_paused: set[str] = set()
        self.services: list[Service] = []
        self._supervisor: asyncio.Task[None] | None = None
        self._popen: dict[str, Any] = {}

    def engine(self, role: str) -> Proc:
        return next(p for p in self.stack.procs if p.name.startswith(role))

    @property
    def engines(self) -> list[Proc]:
        return [p for p in self.stack.procs if p.grpc]

    # -- set-up ----------------------------------------------------------------
    async def start(self) -> None:
        """Redis, the two replicas, and the supervisor (from here on, until
        `close`, whatever dies is restarted); returns at full capacity."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        await asyncio.to_thread(self._start_redis)
        argv_extra = [*self.stack.config.router_args, "--redis-url", self.redis.url]
        argv_extra += ["--redis-timeout-s", "2", "--poll-interval-s", "0.5"]
        pub = ""
        if self.use_proxy:
            # The decode's PUB endpoint (then its replay endpoint, after a comma).
            pub = (self.engine("decode").kv_events or "").split(",")[0]
            self.proxy = KvEventsProxy(pub)
            await self.proxy.start()
        for i in (1, 2):
            port = free_port()
            argv = self.stack.router_argv(port, argv_extra)
            if self.proxy is not None:
                argv = [a.replace(f"{pub},", f"{self.proxy.endpoint},") for a in argv]
            proc = Proc(f"chaos-router-{i}", argv, str(self.log_dir / f"chaos-router-{i}.log"))
            proc.url = f"http://{HOST}:{port}"
            self.routers.append(proc)
            self.urls.append(proc.url)
            self._launch_router(proc)
        for p in self.stack.procs:
            self.services.append(Service(p.name, p.alive, _bound(self.stack.restart, p)))
        for r in self.routers:
            self.services.append(Service(r.name, r.alive, _bound(self._launch_router, r)))
        self.services.append(Service("redis", self._redis_alive, self._start_redis))
        self._supervisor = asyncio.create_task(self.supervise())
        # Routers load the tokenizer stack: as slow as engines on a loaded machine.
        if not await self._until(self.capacity_full, self.stack.config.startup_timeout_s):
            raise RuntimeError(f"the chaos routers did not come up; logs in {self.log_dir}")
        self.model = await asyncio.to_thread(served_model, self.urls[0])

    def _launch_router(self, proc: Proc) -> None:
        old = self._popen.pop(proc.name, None)
        if old is not None:
            _kill_group(proc)
            old.wait(timeout=10)
        started, popen = launch(
            proc.name,
            proc.argv,
            Path(proc.log),
            {"TANDEM_LOG_LEVEL": "INFO"},
            append=True,
        )
        proc.pid = started.pid
        self._popen[proc.name] = popen

    def _start_redis(self) -> None:
        # A loaded machine answers Redis's first PING late, not never.
        self.redis.start(timeout_s=60)

    def _redis_alive(self) -> bool:
        return self.redis.proc is not None and self.redis.proc.alive()

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        stop_process_groups(self.routers, 10)
        for popen in self._popen.values():
            popen.wait(timeout=10)
        self.redis.kill()
        if self.proxy is not None:
            await self.proxy.cut()

    # -- the supervisor (a kubelet) -------------------------------------------------
    async def supervise(self) -> None:
        backoff: dict[str, float] = {}
        while True:
            for s in self.services:
                if s.name in self.supervise_paused or s.alive():
                    continue
                if time.monotonic() < backoff.get(s.name, 0.0):
                    continue
                s.restarts += 1
                backoff[s.name] = time.monotonic() + 2.0
                try:
                    await asyncio.to_thread(s.start)
                except RuntimeError as exc:  # e.g. Redis not answering yet
                    print(f"restart of {s.name} failed: {exc}", file=sys.stderr)
            await asyncio.sleep(0.25)

    # -- observations ------------------------------------------------------------
    async def kv_usage(self, address: str) -> float:
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                load = await pb_grpc.EngineStub(channel).GetLoad(pb.GetLoadRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return 0.0
        return load.kv_cache_usage

    async def engine_addresses(self) -> dict[str, str]:
        return {p.name: p.grpc for p in self.engines if p.grpc}

    async def capacity_full(self) -> bool:
        """Every service up, every engine SERVING, both replicas healthy with
        every engine `available` and the shared state up."""
        if any(not s.alive() for s in self.services):
            return False
        addresses = list((await self.engine_addresses()).values())
        return await engines_serving(addresses) and await routers_see(self.urls, addresses)

    async def kv_event_batches(self) -> list[float]:
        pod = self.engine("decode").grpc
        return [
            (await router_samples(url)).get(
                ("tandem_routing_kv_event_batches_total", pod, None), 0.0
            )
            for url in self.urls
        ]


async def engines_serving(addresses: list[str]) -> bool:
    return all([await _serving(a) for a in addresses])


async def routers_see(urls: list[str], addresses: list[str]) -> bool:
    """Every router healthy, with every engine `available` and the shared state up."""
    for url in urls:
        try:
            async with httpx.AsyncClient(timeout=2) as c:
                if (await c.get(f"{url}/health")).status_code != 200:
                    return False
        except httpx.HTTPError:
            return False
        samples = await router_samples(url)
        for address in addresses:
            if samples.get(("tandem_router_pod_state", address, "available")) != 1.0:
                return False
        if samples.get(("tandem_routing_shared_state_up", None, None)) != 1.0:
            return False
    return True


async def router_samples(url: str) -> dict[tuple[str, str | None, str | None], float]:
    """A router's metrics by (sample name, pod label, state label); none when it does not answer."""
    try:
        async with httpx.AsyncClient(timeout=2) as c:
            text = (await c.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("pod"), sample.labels.get("state"))
            out[key] = sample.value
    return out


async def _serving(address: str) -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _bound(fn: Callable[[Proc], None], proc: Proc) -> Callable[[], None]:
    return lambda: fn(proc)


# -- `make chaos` ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated, in order (default: all: {', '.join(FAULTS)})",
    )
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--stall-timeout-s", type=float, default=20.0)
    parser.add_argument("--kv-lease-s", type=int, default=10)
    args = parser.parse_args(argv)
    unknown = [f for f in args.faults.split(",") if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    faults = [FAULTS[f] for f in args.faults.split(",")]

    from common.model import resolve_model
    from services.stack import Stack, StackConfig

    state = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    stack = Stack(
        StackConfig(
            router=False,
            kv_cache_gib=1,
            max_model_len=4096,
            state_dir=state,
            engine_args=[
                "--kv-lease-s",
                str(args.kv_lease_s),
                "--stall-timeout-s",
                str(args.stall_timeout_s),
            ],
            router_args=["--remote-prefill-threshold", "0"],
        )
    )
    stack.start()

    async def go() -> list[Row]:
        h = Chaos(
            stack,
            str(resolve_model(None)),
            state,
            LoadShape(concurrency=args.concurrency),
            kv_lease_s=args.kv_lease_s,
            stall_timeout_s=args.stall_timeout_s,
            kv_events_proxy=True,
        )
        await h.start()
        try:
            return await h.run(faults)
        finally:
            await h.close()

    try:
        rows = asyncio.run(go())
    finally:
        stack.stop()
    print(table(rows))
    print(f"\nlogs in {state}")
    return 1 if any(r.violations for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
