"""The embedded stack: every Tandem service as a local process on loopback.

`Stack.start()` launches the KV store (Mooncake, services/kvstore) and waits
for its /health, then the prefill and decode engines configured to use it,
waits until their gRPC health says SERVING, then launches the router and waits
for its /health. `Stack.stop()` stops the router first (no new work), then the
engines, then the store, each
with SIGTERM to its whole process group (vLLM forks engine-core and worker
processes) and SIGKILL after a grace period — no orphans. Used by
`tandem up`, by the benchmarks and by the integration tests (one stack per
test session); it sits with the services it composes, below both the launcher
and the benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.engine import EngineCommand, EngineHostSettings, VllmSettings, kv_events_config
from common.model import resolve_model
from common.ports import free_port
from common.procs import Proc, launch, stop_process_groups, wait_grpc_serving, wait_http_ok
from common.roles import Role
from common.router import RouterCommand, RouterLaunchSettings, parse_kv_event_source
from common.scheduler import POOLS, SchedulerSettings, scheduler_flag
from common.settings import to_argv
from services.kvstore.api import store_launch

# The pool of an engine, by the module it runs (services.prefill, .decode, .engine).
POOL_OF_ROLE = {"prefill": "prefill", "decode": "decode", "engine": "aggregated"}
ROLE_OF_MODULE = {"prefill": Role.PREFILL, "decode": Role.DECODE, "engine": Role.BOTH}


def engine_cores(engines: int) -> list[int | None]:
    """The core each of `engines` engines is bound to: one each while there
    are enough, else None for all, leaving them to the kernel's scheduler.
    Two engines bound to one core while another core idles starve each other:
    a busy vLLM worker spins on its queue from the engine core, and the NIXL
    threads that serve a decode's KV pull inherit the worker's core, so a pull
    from a prefill sharing a core with a busy decode took minutes."""
    cpus = sorted(os.sched_getaffinity(0))
    if engines > len(cpus):
        return [None] * engines
    return cpus[:engines]


@dataclass
class StackConfig:
    model: str | None = None  # None = the bundled SmolLM2 (prepared on first use)
    prefill: int = 1
    decode: int = 1
    aggregated: int = 0  # engines of role "both" (whole requests, no P/D split)
    router_port: int = 8000
    host: str = "127.0.0.1"
    kv_cache_gib: int = 2
    max_model_len: int = 8192
    dtype: str = "float32"
    ports_from: int | None = None  # None = pick free ports
    state_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "tandem" / "run")
    engine_args: list[str] = field(default_factory=list)  # passed to every engine
    # vLLM scheduler settings by pool ("prefill", "decode", "aggregated"); a
    # pool not named here keeps vLLM's defaults.
    scheduler: dict[str, SchedulerSettings] = field(default_factory=dict)
    # The shared KV store every engine reads and writes prefixes through.
    kv_store: bool = True
    kv_store_pool: str = "2GB"
    kv_store_disk: str = "8GB"
    kv_store_args: dict[str, object] = field(default_factory=dict)  # KvStoreSettings fields
    router_args: list[str] = field(default_factory=list)  # passed to the router
    # False: engines only (benchmarks that start their own routers in front of
    # them; an idle router would still poll the engines and use CPU).
    router: bool = True
    # Engines publish KV events (ZMQ) so the router's prefix index is exact;
    # without them the router predicts each pod's cache from its own choices.
    kv_events: bool = True
    # Seconds for every engine and the router to come up. Engines start in
    # under a minute on an idle 2-core machine; a busy one can take ten times that.
    startup_timeout_s: float = 1200.0

    def validate(self) -> None:
        """Raise ValueError naming every flag at fault."""
        problems = [
            f"{pool} pool: {p}"
            for pool, settings in self.scheduler.items()
            for p in settings.problems(self.max_model_len)
        ]
        problems += [
            f"unknown pool {pool!r} (pools: {', '.join(POOLS)})"
            for pool in self.scheduler
            if pool not in POOLS
        ]
        for arg in self.engine_args:
            if flag := scheduler_flag(arg):
                problems.append(
                    f"engine argument {arg}: a scheduler setting, set per pool "
                    f"with {flag} VALUE or {flag} POOL=VALUE instead"
                )
        if problems:
            raise ValueError("; ".join(problems))

    def pool_flags(self, role: str) -> list[str]:
        """The scheduler flags of the pool an engine of this role belongs to."""
        settings = self.scheduler.get(POOL_OF_ROLE[role], SchedulerSettings())
        return settings.vllm_flags()


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: list[Proc] = []
        self._popen: dict[str, subprocess.Popen] = {}
        self._env: dict[str, dict[str, str]] = {}
        self._next_port = config.ports_from

    # -- ports and commands --------------------------------------------------
    def _port(self) -> int:
        if self._next_port is None:
            return free_port()
        port, self._next_port = self._next_port, self._next_port + 1
        return port

    @property
    def router_url(self) -> str:
        return f"http://{self.config.host}:{self.config.router_port}"

    def _store(self):
        c = self.config
        launch = store_launch(
            c.state_dir / "kvstore",
            host=c.host,
            ports=[self._port() for _ in range(6)],
            pool_size=c.kv_store_pool,
            disk_size=c.kv_store_disk,
            **c.kv_store_args,
        )
        proc = Proc(
            name="kvstore",
            argv=launch.argv,
            log=str(c.state_dir / "kvstore.log"),
            url=launch.health_url.removesuffix("/health"),
        )
        return proc, launch

    def engine_proc(
        self,
        role: str,
        index: int,
        core: int | None,
        store_flags: list[str],
    ) -> tuple[Proc, dict[str, str]]:
        c = self.config
        grpc_port, metrics_port, nixl_port = self._port(), self._port(), self._port()
        kv_events = None
        vllm = vllm_settings(c)
        if c.kv_events:
            pub, replay = self._port(), self._port()
            vllm = replace(vllm, kv_events_config=kv_events_config(pub, replay))
            kv_events = f"tcp://{c.host}:{pub},tcp://{c.host}:{replay}"
        command = EngineCommand(
            EngineHostSettings(
                role=ROLE_OF_MODULE[role],
                host=c.host,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                nixl_port=nixl_port,
            ),
            vllm,
            (*c.pool_flags(role), *store_flags, *c.engine_args),
            f"services.{role}",
        )
        name = f"{role}-{index}"
        proc = Proc(
            name=name,
            argv=command.argv(sys.executable),
            log=str(self.config.state_dir / f"{name}.log"),
            grpc=f"{c.host}:{grpc_port}",
            url=f"http://{c.host}:{metrics_port}/metrics",
            kv_events=kv_events,
        )
        return proc, engine_env(c.kv_cache_gib, core)

    def _launch(self, proc: Proc, env: dict[str, str]) -> None:
        started, popen = launch(proc.name, proc.argv, Path(proc.log), env, append=True)
        proc.pid = started.pid
        self._popen[proc.name] = popen
        self._env[proc.name] = env
        self.procs.append(proc)

    def restart(self, proc: Proc) -> None:
        """Start one of this stack's services again, as a kubelet restarts a
        pod's container: whatever is left of its process group is killed,
        then the same command runs with the same ports and environment.
        Returns once launched; readiness is the caller's to wait for."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        old = self._popen.pop(proc.name, None)
        if old is not None:
            old.wait(timeout=10)
        started, popen = launch(
            proc.name, proc.argv, Path(proc.log), self._env.get(proc.name, {}), append=True
        )
        proc.pid = started.pid
        self._popen[proc.name] = popen

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        c = self.config
        c.validate()
        c.state_dir.mkdir(parents=True, exist_ok=True)
        resolve_model(c.model)  # convert the default model once, before engines race to

        deadline = time.monotonic() + c.startup_timeout_s
        try:
            store_flags = []
            if c.kv_store:
                # First: an engine given --kv-store-config refuses to start
                # without a reachable store.
                store, launch = self._store()
                self._launch(store, launch.env)
                self.write_state()
                wait_http_ok(f"{store.url}/health", store, deadline)
                store_flags = launch.engine_flags
            roles = [
                (role, i)
                for role, count in (
                    ("prefill", c.prefill),
                    ("decode", c.decode),
                    ("engine", c.aggregated),
                )
                for i in range(count)
            ]
            engines = [
                self.engine_proc(role, i, core, store_flags)
                for (role, i), core in zip(roles, engine_cores(len(roles)), strict=True)
            ]
            for proc, env in engines:
                self._launch(proc, env)
            self.write_state()
            for proc, _ in engines:
                self._wait_engine(proc, deadline)
            if not c.router:
                return
            router = Proc(
                name="router",
                log=str(c.state_dir / "router.log"),
                url=self.router_url,
                argv=self.router_argv(c.router_port, c.router_args),
            )
            self._launch(router, {})
            self.write_state()
            self._wait_router(router, deadline)
        except BaseException:
            self.stop()
            raise

    def router_argv(self, port: int, extra_args: list[str] = ()) -> list[str]:
        """The router's command line in front of this stack's engines (also
        used by benchmarks that put routers with other policies in front of
        the same engines)."""
        c = self.config
        engines = [p for p in self.procs if p.grpc]
        pods: dict[str, list[str]] = {"prefill": [], "decode": [], "engine": []}
        for p in engines:
            pods[p.name.split("-")[0]].append(p.grpc)
        launch = RouterLaunchSettings(
            host=c.host,
            port=port,
            prefill=pods["prefill"],
            decode=pods["decode"],
            engines=pods["engine"],
            model=c.model,
            kv_events=tuple(
                parse_kv_event_source(f"{p.grpc}={p.kv_events}") for p in engines if p.kv_events
            ),
        )
        return RouterCommand(launch, extra=tuple(extra_args)).argv(sys.executable)

    def _wait_engine(self, proc: Proc, deadline: float) -> None:
        wait_grpc_serving(proc.grpc, proc, deadline)

    def _wait_router(self, proc: Proc, deadline: float) -> None:
        wait_http_ok(f"{proc.url}/health", proc, deadline)

    def stop(self, grace_s: float = 20.0) -> None:
        for tier in stop_tiers(self.procs):
            stop_process_groups(tier, grace_s)
            for proc in tier:
                popen = self._popen.pop(proc.name, None)
                if popen is not None:
                    popen.wait(timeout=5)
        self.procs.clear()
        state = self.config.state_dir / "stack.json"
        state.unlink(missing_ok=True)

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if not p.alive()]

    # -- state file (for `tandem status` / `tandem down`) --------------------
    def write_state(self) -> None:
        state = {
            "supervisor_pid": os.getpid(),
            "router_url": self.router_url,
            "procs": [asdict(p) for p in self.procs],
        }
        (self.config.state_dir / "stack.json").write_text(json.dumps(state, indent=2))


def vllm_settings(c: StackConfig, model: str | None = None) -> VllmSettings:
    """The vLLM settings every engine of a stack shares. `model` overrides
    the config's model."""
    return VllmSettings(
        model=model or c.model, dtype=c.dtype, enforce_eager=True, max_model_len=c.max_model_len
    )


def vllm_flags(c: StackConfig, model: str | None = None) -> list[str]:
    """Those settings as flags, for Tandem's engine hosts and, in tests and
    benchmarks, vLLM's own OpenAI server beside them, so both run the same
    engine."""
    return to_argv(vllm_settings(c, model), always=("dtype",))


def kv_events_flags(host: str, pub_port: int, replay_port: int) -> tuple[list[str], str]:
    """vLLM flags that publish KV events over ZMQ, and the endpoints as the
    router's --kv-events takes them (PUB,REPLAY)."""
    return (
        to_argv(VllmSettings(kv_events_config=kv_events_config(pub_port, replay_port))),
        f"tcp://{host}:{pub_port},tcp://{host}:{replay_port}",
    )


def engine_env(kv_cache_gib: int, core: int | None) -> dict[str, str]:
    """vLLM CPU settings of one engine: its KV cache size and the core its
    OpenMP threads run on (engines on different cores do not contend), or,
    with `core` None, one unbound OpenMP thread (engine_cores)."""
    if core is None:
        bind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    else:
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **bind}


def stop_tiers(procs: Iterable[Proc]) -> list[list[Proc]]:
    """`procs` in the order they stop, grouped: the router first, so nothing
    new reaches engines that are going away; then the engines, together; the
    store last, so engines shut down with their store still there."""
    tiers: dict[int, list[Proc]] = {}
    for proc in procs:
        tiers.setdefault({"router": 0, "kvstore": 2}.get(proc.name, 1), []).append(proc)
    return [tiers[order] for order in sorted(tiers)]


def read_state(state_dir: Path) -> dict | None:
    path = state_dir / "stack.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())
