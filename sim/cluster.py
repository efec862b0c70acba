"""One simulated cluster run: engines on the event loop, the router's real
routing core deciding every placement, agentic traffic from the trace
generator, and the run's figures.

The routing core (``services/router/routing``) is used through its seam as
the router uses it: ``update_pod`` with each engine's load once per poll
interval, ``route`` per request with the session's binding, the engines' KV
events applied to ``core.index`` as they happen, ``report_prefill`` when the
prompt's KV is computed and ``release`` when the request ends. The simulator
supplies only time, load and KV state.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from common.roles import Role
from services.router.routing import PodSpec, RouteRequest, RoutingCore, RoutingSettings, SharedView
from services.router.routing.core import PodLoad, StateWrites
from services.router.routing.policy import Binding
from sim.costs import Link, StepModel, StoreTier
from sim.engine import Engine, EngineSettings, Job, KVCache, SharedStore
from sim.events import EventLoop
from tandem.workload.generate import generate as generate_trace
from tandem.workload.generate import params_for
from tandem.workload.metrics import percentile
from tandem.workload.trace import Request, Session, Subagent
from tandem.workload.trace import load as load_trace


@dataclass(frozen=True)
class Traffic:
    """The agentic trace (``tandem.workload.generate``, or AgentX files) and how it is played:
    ``concurrency`` session lanes (0: every session at once), think times
    scaled by ``think_scale``, as the replay client plays it."""

    profile: str = "small"
    sessions: int = 4
    turns_median: float = 4.0
    seed: int = 0
    think_scale: float = 0.2
    concurrency: int = 4
    overrides: tuple[tuple[str, Any], ...] = ()  # other generator parameters
    # AgentX-format trace files (a .json/.jsonl file or a folder of them):
    # replayed as they are instead of generated.
    trace_file: str | None = None
    # Sessions per second starting as a Poisson process (seeded), instead of
    # lanes: an open-loop arrival rate (0: lanes).
    session_rate: float = 0.0
    # Per session id, the index of the first output token with text of each of
    # its requests (``Session.iter_requests`` order; ``bench.first_visible``
    # finds them for a recorded run): the client's TTFT is that token's time.
    # A session not named: every request's first token shows.
    first_visible: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def visible_indices(self, sessions: Sequence[Session]) -> dict[int, int]:
        """``first_visible`` by ``id(request)``."""
        given = dict(self.first_visible)
        out: dict[int, int] = {}
        for s in sessions:
            indices = given.get(s.id)
            if indices is None:
                continue
            requests = [r for _, _, r in s.iter_requests()]
            if len(indices) != len(requests):
                raise ValueError(
                    f"first_visible of session {s.id}: {len(indices)} indices for "
                    f"{len(requests)} requests"
                )
            out.update((id(r), k) for r, k in zip(requests, indices))
        return out

    def generate(self) -> list[Session]:
        if self.trace_file:
            return load_trace(self.trace_file)
        return generate_trace(
            params_for(
                self.profile,
                sessions=self.sessions,
                turns_median=self.turns_median,
                seed=self.seed,
                **dict(self.overrides),
            )
        )


@dataclass(frozen=True)
class ClusterConfig:
    policy: str = "cost"
    aggregated: int = 2  # aggregated pods
    prefill: int = 0  # P/D pods (with decode > 0)
    decode: int = 0
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(kv_blocks=8192))
    model: StepModel = field(default_factory=StepModel)
    store: StoreTier | None = None  # the store's RAM tier (None: no store)
    store_disk: StoreTier | None = None  # its disk tier
    store_pin_ttl_s: float = 0.0  # sessions' blocks soft-pinned this long from their write
    link: Link = field(default_factory=lambda: Link(5e9, 1e-3))
    gpus_per_pod: int = 1
    poll_interval_s: float = 1.0
    remote_prefill_threshold: int = 256
    store_load_weight: float = 1.0  # the router's, PolicySettings.store_load_weight
    router_replicas: int = 1  # routing cores, requests spread over them in turn
    state_lag_s: float = 0.0  # until one replica's shared-state writes reach the others
    # The router's table bounds (RoutingSettings; None: the router's default).
    index_capacity: int | None = None
    live_max_blocks: int | None = None
    # Engines step batches of only decodes as runs (engine.py): the same
    # figures, faster; False: every step planned over the whole batch.
    decode_runs: bool = True
    # Count why prompt tokens were computed (MissLedger): a dict of every
    # block computed, so off unless asked for.
    miss_reasons: bool = False

    def validate(self) -> None:
        if self.aggregated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("pod counts must be >= 0")
        if self.aggregated + self.decode == 0:
            raise ValueError("need at least one aggregated or decode pod")
        if self.prefill and not self.decode:
            raise ValueError("prefill pods need decode pods")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive")
        if self.store_pin_ttl_s < 0:
            raise ValueError("store_pin_ttl_s must be >= 0")
        if self.store_disk and not self.store:
            raise ValueError("a disk tier needs the store's RAM tier")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if self.state_lag_s < 0:
            raise ValueError("state_lag_s must be >= 0")

    def routing_settings(self) -> RoutingSettings:
        router = RoutingSettings()
        return replace(
            router,
            policy=replace(
                router.policy,
                policy=self.policy,
                remote_prefill_threshold=self.remote_prefill_threshold,
                store_load_weight=self.store_load_weight,
            ),
            block_size=self.engine.block_size,
            index_capacity=router.index_capacity
            if self.index_capacity is None
            else self.index_capacity,
            live_max_blocks=(
                router.live_max_blocks if self.live_max_blocks is None else self.live_max_blocks
            ),
        )

    @property
    def pods(self) -> list[tuple[str, Role]]:
        return (
            [(f"agg-{i}", Role.BOTH) for i in range(self.aggregated)]
            + [(f"prefill-{i}", Role.PREFILL) for i in range(self.prefill)]
            + [(f"decode-{i}", Role.DECODE) for i in range(self.decode)]
        )


class LaggedState:
    """The router replicas' shared-state store (Redis in the router): session
    bindings and each replica's in-flight load per pod. A replica sees its own
    writes at once and the others' ``lag_s`` later; of two bindings of a
    session the later write wins, as in Redis."""

    def __init__(self, loop: EventLoop, replicas: int, lag_s: float) -> None:
        self.loop = loop
        self.lag_s = lag_s
        self.replicas = replicas
        # per reader: session -> (written at, binding), as far as it has seen
        self._bindings: list[dict[str, tuple[float, Binding]]] = [{} for _ in range(replicas)]
        # per reader: (writer, pod) -> load as last delivered; and their sums per pod
        self._loads: list[dict[tuple[int, str], PodLoad]] = [{} for _ in range(replicas)]
        self._sums: list[dict[str, PodLoad]] = [{} for _ in range(replicas)]

    def read(self, replica: int, session: str) -> SharedView:
        seen = self._bindings[replica].get(session)
        return SharedView(seen[1] if seen else None, self._sums[replica])

    def write(self, replica: int, writes: StateWrites) -> None:
        now = self.loop.now
        if writes.binding:
            self._bindings[replica][writes.binding[0]] = (now, writes.binding[1])
        if self.replicas == 1 or not (writes.binding or writes.loads):
            return
        for reader in range(self.replicas):
            if reader == replica:
                continue
            if self.lag_s:
                self.loop.after(self.lag_s, self._deliver(reader, replica, writes, now))
            else:
                self._deliver(reader, replica, writes, now)()

    def _deliver(
        self, reader: int, writer: int, writes: StateWrites, written_at: float
    ) -> Callable[[], None]:
        def apply() -> None:
            if writes.binding:
                session, binding = writes.binding
                seen = self._bindings[reader].get(session)
                if seen is None or seen[0] <= written_at:
                    self._bindings[reader][session] = (written_at, binding)
            loads, sums = self._loads[reader], self._sums[reader]
            for pod, load in writes.loads.items():
                old = loads.get((writer, pod), PodLoad())
                loads[(writer, pod)] = load
                total = sums.get(pod, PodLoad())
                sums[pod] = PodLoad(
                    total.in_flight + load.in_flight - old.in_flight,
                    total.pending_prefill_tokens
                    + load.pending_prefill_tokens
                    - old.pending_prefill_tokens,
                )

        return apply


MISS_REASONS = ("new", "evicted", "elsewhere", "tail")


class MissLedger:
    """Why a prompt's tokens were computed rather than reused, judged when the
    request is first admitted (the hits the client sees), block by block past
    the reused prefix:

    * ``new``: no pod had computed the block before (a first turn, a turn's
      new messages and the previous turn's output, which engines do not cache);
    * ``evicted``: computed before, cached on no pod now (or only here, behind
      a block that is not): KV capacity;
    * ``elsewhere``: another pod holds it: the placement (a session moved, or
      a prefix other sessions computed on other pods);
    * ``tail``: the tokens past the last full block the engine may reuse,
      computed on every request.

    Fed by the engines' KV events, as the prefix index is."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # block hash -> pods caching it now; 0: computed once, evicted from every pod
        self.holders: dict[int, int] = {}

    def stored(self, hashes: Sequence[int]) -> None:
        holders = self.holders
        for h in hashes:
            holders[h] = holders.get(h, 0) + 1

    def removed(self, hashes: Sequence[int]) -> None:
        holders = self.holders
        for h in hashes:
            holders[h] -= 1

    def reasons(
        self, hashes: Sequence[int], prompt_tokens: int, reused_blocks: int, here: KVCache
    ) -> dict[str, int]:
        """The prompt's computed tokens by reason; they sum to its tokens not reused."""
        bs = self.block_size
        full = min((prompt_tokens - 1) // bs, len(hashes))  # the engine's reuse cap
        missed = dict.fromkeys(MISS_REASONS, 0)
        missed["tail"] = prompt_tokens - full * bs
        for h in hashes[reused_blocks:full]:
            holders = self.holders.get(h)
            if holders is None:
                missed["new"] += bs
            elif holders - here.holds(h) > 0:
                missed["elsewhere"] += bs
            else:
                missed["evicted"] += bs
        return missed


@dataclass
class Record:
    session: str
    arrival: float
    prompt_tokens: int
    out_tokens: int
    cached_tokens: int = 0
    first_token: float | None = None  # when the client's first text came (its TTFT)
    end: float | None = None
    prefill_pod: str | None = None
    decode_pod: str = ""
    reason: str = ""
    missed: dict[str, int] | None = None  # computed tokens by reason (MissLedger)

    @property
    def pod(self) -> str:
        """Where the prompt was computed."""
        return self.prefill_pod or self.decode_pod


def prompt_blocks(
    session: Session, index: int, r: Request, block_size: int
) -> tuple[int, list[int]]:
    """The prompt's length and its full blocks' hashes, as the router's hasher
    tells the blocks apart: a prompt's tokens are the trace's blocks in order
    (the trace's id of each ``session.block_size`` tokens, local ids private
    to their session), so an engine block of ``block_size`` tokens is
    identified by the trace ids whose tokens it holds, chained on its parent
    as vLLM chains block hashes (which also fixes where in the first of those
    trace blocks it starts). The hashes
    go to the routing core through ``RoutingCore.route``'s ``block_hashes``
    (for callers that hashed the prompt): the simulator builds and
    hashes no token ids, which at tens of thousands of tokens a prompt were
    most of a large run's time."""
    tb = session.block_size
    scope = 0 if session.hash_id_scope == "global" else index + 1
    ids = r.hash_ids
    n = min(r.in_tokens, len(ids) * tb)
    hashes: list[int] = []
    parent = 0
    for start in range(0, n - block_size + 1, block_size):
        first, last = start // tb, (start + block_size - 1) // tb
        parent = hash((parent, scope, *ids[first : last + 1]))
        hashes.append(parent)
    return n, hashes


class Simulation:
    def __init__(self, config: ClusterConfig, traffic: Traffic) -> None:
        config.validate()
        self.config = config
        self.traffic = traffic
        self.loop = EventLoop()
        # One routing core per router replica, each with its own prefix index
        # fed by every engine's KV events (each replica subscribes to all pods).
        self.cores = [RoutingCore(config.routing_settings()) for _ in range(config.router_replicas)]
        self.core = self.cores[0]
        self.state = LaggedState(self.loop, config.router_replicas, config.state_lag_s)
        self._next_replica = 0
        self._visible: dict[int, int] = {}  # Traffic.visible_indices of the run's sessions
        self.misses = MissLedger(config.engine.block_size) if config.miss_reasons else None
        self.store = None
        if config.store:
            self.store = SharedStore(
                config.store, lambda: self.loop.now, config.store_disk, config.store_pin_ttl_s
            )
        self.engines: dict[str, Engine] = {}
        for name, role in config.pods:
            # "sim": the pod publishes KV events (the index's short prediction TTL)
            for core in self.cores:
                core.add_pod(PodSpec(name, role, kv_events="sim"))
            self.engines[name] = self._engine(name)
        self.records: list[Record] = []
        self.active_lanes = 0
        self.roles = dict(config.pods)
        self.draining: set[str] = set()
        self.gpu_seconds = 0.0  # pods × time, counted as pods come and go
        self._pods_since = 0.0

    # ----- pods coming and going (a controller resizing pools) ---------------
    def _count_gpus(self) -> None:
        now = self.loop.now
        self.gpu_seconds += (now - self._pods_since) * len(self.engines) * self.config.gpus_per_pod
        self._pods_since = now

    def pods_of(self, role: Role) -> list[str]:
        """The pods of a role that are not going away (starting ones included)."""
        return [n for n, r in self.roles.items() if r == role and n not in self.draining]

    def add_pod(self, role: Role, start_s: float) -> str:
        """A new pod of ``role``: it holds its GPUs at once and takes work
        after ``start_s`` (its engine's start)."""
        prefix = {Role.BOTH: "agg", Role.PREFILL: "prefill", Role.DECODE: "decode"}[role]
        i = sum(1 for n in self.roles if n.startswith(prefix + "-"))
        name = f"{prefix}-{i}"
        self._count_gpus()
        self.roles[name] = role
        self.engines[name] = self._engine(name)
        self.loop.after(start_s, lambda: self._started(name, role))
        return name

    def _started(self, name: str, role: Role) -> None:
        for core in self.cores:
            core.add_pod(PodSpec(name, role, kv_events="sim"))
            if name in self.draining:  # drained before it started
                core.set_draining(name)

    def drain_pod(self, name: str) -> None:
        """The pod takes no new work and goes once what it runs has finished."""
        self.draining.add(name)
        if name in self.core.pods:
            for core in self.cores:
                core.set_draining(name)
        self._remove_when_idle(name)

    def _remove_when_idle(self, name: str) -> None:
        engine = self.engines[name]
        if engine.running or engine.waiting or name not in self.core.pods:
            self.loop.after(self.config.poll_interval_s, lambda: self._remove_when_idle(name))
            return
        self._count_gpus()
        for core in self.cores:
            core.remove_pod(name)
        del self.engines[name]

    def _engine(self, name: str) -> Engine:
        c = self.config
        indexes = [core.index for core in self.cores]
        misses = self.misses

        def stored(pod: str, hashes: Sequence[int]) -> None:
            for index in indexes:
                index.stored(pod, hashes)
            if misses:
                misses.stored(hashes)

        def removed(pod: str, hashes: Sequence[int]) -> None:
            for index in indexes:
                index.removed(pod, hashes)
            if misses:
                misses.removed(hashes)

        return Engine(
            name, c.engine, c.model, self.loop, stored, removed, self.store, c.link, c.decode_runs
        )

    # ----- router side ------------------------------------------------------
    def _poll(self) -> None:
        now = self.loop.now
        for name, engine in self.engines.items():
            running, waiting, usage = engine.load
            for core in self.cores:
                core.update_pod(
                    name,
                    now,
                    healthy=True,
                    running=running,
                    waiting=waiting,
                    kv_cache_usage=usage,
                    kv_capacity_blocks=engine.kv.capacity,
                )
        if self.active_lanes:
            self.loop.after(self.config.poll_interval_s, self._poll)

    def _send(
        self, session: Session, index: int, key: str, r: Request, done: Callable[[], None]
    ) -> None:
        now = self.loop.now
        n, hashes = prompt_blocks(session, index, r, self.config.engine.block_size)
        # The replicas take requests in turn (a Service spreading connections).
        replica = self._next_replica
        self._next_replica = (replica + 1) % len(self.cores)
        core, state = self.cores[replica], self.state
        decision = core.route(
            RouteRequest(range(n), session=key), state.read(replica, key), now, hashes
        )
        state.write(replica, decision.writes)
        rec = Record(key, now, n, r.out_tokens, decode_pod=decision.decode_pod)
        rec.prefill_pod, rec.reason = decision.prefill_pod, decision.reason
        self.records.append(rec)
        out = max(1, r.out_tokens)
        visible = min(self._visible.get(id(r), 0), out - 1)

        def admitted(job: Job, reused_blocks: int) -> None:
            if self.misses is not None:
                here = self.engines[rec.pod].kv
                rec.missed = self.misses.reasons(job.hashes, n, reused_blocks, here)

        def first_token(job: Job) -> None:
            rec.first_token = self.loop.now

        def finished(job: Job) -> None:
            rec.end = self.loop.now
            state.write(replica, core.release(decision))
            done()

        decode = self.engines[decision.decode_pod]
        if decision.prefill_pod is None:

            def computed(job: Job) -> None:
                rec.cached_tokens = job.cached_tokens
                state.write(
                    replica, core.report_prefill(decision, self.loop.now, decision.decode_pod)
                )

            decode.submit(
                Job(
                    n,
                    decision.block_hashes,
                    out,
                    computed,
                    on_done=finished,
                    visible_index=visible,
                    on_visible=first_token,
                    on_admitted=admitted,
                )
            )
            return
        prefill = self.engines[decision.prefill_pod]

        def prefilled(job: Job) -> None:
            rec.cached_tokens = job.cached_tokens
            state.write(replica, core.report_prefill(decision, self.loop.now))

        def to_decode(pjob: Job) -> None:
            decode.submit(
                Job(
                    n,
                    decision.block_hashes,
                    out,
                    on_first_token=lambda job: prefill.release(pjob),
                    on_done=finished,
                    visible_index=visible,
                    on_visible=first_token,
                    remote_kv=True,
                )
            )

        prefill.submit(
            Job(
                n,
                decision.block_hashes,
                1,
                prefilled,
                on_done=to_decode,
                on_admitted=admitted,
                hold_kv=True,
            )
        )

    # ----- traffic: agents as the replay client plays them ------------------
    def _agent(
        self,
        session: Session,
        index: int,
        key: str,
        entries: list[Request | Subagent],
        done: Callable[[], None],
    ) -> None:
        i = 0

        def step() -> None:
            nonlocal i
            if i >= len(entries):
                done()
                return
            e = entries[i]
            if isinstance(e, Request):
                i += 1
                think = (e.think_time or 0.0) * self.traffic.think_scale
                self.loop.after(think, lambda: self._send(session, index, key, e, step))
                return
            group: list[Subagent] = []
            while i < len(entries):
                nxt = entries[i]
                if not isinstance(nxt, Subagent):
                    break
                group.append(nxt)
                i += 1
            pending = len(group)

            def joined() -> None:
                nonlocal pending
                pending -= 1
                if pending == 0:
                    step()

            for j, sub in enumerate(group):
                name = sub.agent_id or f"sa{j}"
                self._agent(session, index, f"{key}/{name}", sub.requests, joined)

        step()

    def run(self, interrupt: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Play the traffic to its end; ``interrupt`` (asked now and then) stops it."""
        wall = time.perf_counter()
        sessions = self.traffic.generate()
        self._visible = self.traffic.visible_indices(sessions)
        if self.traffic.session_rate > 0:
            self._arrivals(sessions, self.traffic.session_rate)
        else:
            self._lanes(sessions)
        self.loop.run(max_events=50_000_000, interrupt=interrupt)
        return self.summary(time.perf_counter() - wall)

    def _lanes(self, sessions: list[Session]) -> None:
        queue = list(enumerate(sessions))
        queue.reverse()
        lanes = self.traffic.concurrency or len(sessions)

        def lane() -> None:
            if not queue:
                self.active_lanes -= 1
                return
            index, s = queue.pop()
            self._agent(s, index, s.id, s.requests, lane)

        self._poll()
        self.active_lanes = min(lanes, len(sessions))
        for _ in range(self.active_lanes):
            lane()

    def _arrivals(self, sessions: list[Session], rate: float) -> None:
        """Each session starts at its Poisson arrival; ``active_lanes`` counts
        the sessions not yet done."""
        rng = random.Random(self.traffic.seed)

        def done() -> None:
            self.active_lanes -= 1

        def start(index: int, s: Session) -> Callable[[], None]:
            return lambda: self._agent(s, index, s.id, s.requests, done)

        self.active_lanes = len(sessions)
        self._poll()
        at = 0.0
        for index, s in enumerate(sessions):
            self.loop.at(at, start(index, s))
            at += rng.expovariate(rate)

    def summary(self, wall_s: float) -> dict[str, Any]:
        recs = [r for r in self.records if r.end is not None and r.first_token is not None]
        if len(recs) != len(self.records):
            raise RuntimeError(f"{len(self.records) - len(recs)} requests never finished")
        prompt = sum(r.prompt_tokens for r in recs)
        ttft = [r.first_token - r.arrival for r in recs]  # type: ignore[operator]
        per_token = [(r.end - r.arrival) / max(1, r.out_tokens) for r in recs]  # type: ignore[operator]
        span = max((r.end for r in recs), default=0.0)  # type: ignore[type-var]
        out = sum(r.out_tokens for r in recs)
        self._count_gpus()
        mean_gpus = self.gpu_seconds / self.loop.now if self.loop.now else 0.0
        p90_per_token = percentile(per_token, 90)
        busy = {n: e.busy_s for n, e in self.engines.items()}
        misses = self._miss_summary(recs) if self.misses is not None else {}
        return {
            "requests": len(recs),
            "hit_rate": sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "interactivity_p90": 1.0 / p90_per_token if p90_per_token else math.nan,
            "output_tok_s": out / span if span else 0.0,
            "output_tok_s_per_gpu": out / span / mean_gpus if span else 0.0,
            "requests_per_s": len(recs) / span if span else 0.0,
            "mean_gpus": mean_gpus,
            "local_prefills": sum(1 for r in recs if r.prefill_pod is None),
            "sim_time_s": span,
            "utilization": sum(busy.values()) / (span * len(busy)) if span else 0.0,
            "events": self.loop.processed,
            # what the router's bounded tables forgot (app.py's table metrics), all replicas
            "index_evictions": sum(c.index.evictions for c in self.cores),
            "live_session_evictions": sum(c.live.evictions for c in self.cores),
            "wall_s": wall_s,
            **misses,
        }

    @staticmethod
    def _miss_summary(recs: Sequence[Record]) -> dict[str, Any]:
        """Computed prompt tokens by reason (MissLedger), in all and on the
        requests placed on another pod than their session's (agent's) previous
        request: ``moved_requests``."""
        total = dict.fromkeys(MISS_REASONS, 0)
        moved = dict.fromkeys(MISS_REASONS, 0)
        moves = 0
        last_pod: dict[str, str] = {}
        for r in sorted(recs, key=lambda r: r.arrival):
            assert r.missed is not None
            previous = last_pod.get(r.session)
            last_pod[r.session] = r.pod
            is_move = previous is not None and previous != r.pod
            moves += is_move
            for reason, tokens in r.missed.items():
                total[reason] += tokens
                if is_move:
                    moved[reason] += tokens
        return {"miss_tokens": total, "moved_requests": moves, "miss_tokens_moved": moved}
