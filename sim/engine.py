"""A simulated vLLM engine: a continuous-batching scheduler over a KV cache
with prefix caching, timed by a ``StepModel`` on the event loop.

What it keeps of vLLM's behaviour:

* Each step decodes one token for every running sequence and spends what is
  left of ``max_num_batched_tokens`` on prompt chunks, first-come first-served
  (chunked prefill); ``long_prefill_threshold`` caps one request's chunk in a
  step it shares with other work (vLLM lifts the cap for a lone request).
* Asynchronous scheduling (vLLM's default; ``async_scheduling``): the step
  after a busy one is planned as that one starts, so a request that arrives
  during a step of an engine with requests running is first scheduled in the
  step after the next; an engine with nothing running schedules it at once.
* ``shared_core_s``: core time the processes around an engine take from it
  per prompt it computes in a step, where they share its cores (on the
  validation machine: the router, the replay client, vLLM's scheduler and
  front-end processes); 0 where they have CPUs of their own.
* A request is admitted when the blocks of its whole prompt fit (vLLM's
  ``scheduler_reserve_full_isl``): the longest cached prefix of its
  full-block hashes is reused (capped at ``(n - 1) // block_size`` blocks)
  and blocks for its first chunk are allocated, evicting cached blocks no
  request uses, least recently freed first (vLLM's free-block queue). As vLLM's
  ``allocate_slots``, a chunk's full blocks are cached when the chunk is
  scheduled, not once computed: a request admitted after it, in the same
  step too, reuses them (one forward pass writes them before it reads).
  The engine publishes them (``BlockStored``) when the step ends, and an
  eviction publishes ``BlockRemoved``, as the engines' KV events do.
* With a store, a prefix the pod lacks but the store holds is loaded (its
  time from the RAM and disk tiers' bandwidth and latency, for the blocks
  each holds) instead of computed; every prompt's blocks are put to the
  store (``SharedStore``: tiers, pins, eviction).
* A P/D decode request's prompt KV arrives over the link; a P/D prefill
  request holds its blocks until the decode pod has pulled them.

* Blocks are allocated as a request's chunks and tokens need them; when a
  running request cannot grow, the newest running request is preempted
  (recompute: its blocks freed, it waits at the head of the queue), and
  that step admits no waiting request.

A batch of only decodes (nothing waiting, every request past its first
token) steps as a *decode run* (``decode_runs``): each step is still one
event at the time the step-by-step engine would end it, but planning it
costs the blocks it allocates, not a walk over the batch; the tokens each
request generated are counted once, when the run ends (a request's last
token, a request arriving, blocks that do not fit). A run changes no
figure: ``tests/sim/test_sim.py`` holds it equal to the step-by-step engine.

Simplifications, each a bias the README names: output blocks are not cached,
a preempted request recomputes its prompt but not its output tokens, and the
decode side's cost is the fitted step model.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sim.costs import Link, StepModel, StoreTier, blocks_for
from sim.events import EventLoop

BlockEvents = Callable[[str, Sequence[int]], None]


class KVCache:
    """A pod's KV blocks: in use (by hash, ref-counted, or anonymous) and
    cached-but-free (evictable, least recently freed first)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"KV capacity {capacity_blocks}: must be positive")
        self.capacity = capacity_blocks
        self.in_use: dict[int, int] = {}  # hash -> requests using it
        self.anonymous = 0  # blocks in use that hold no full prompt block
        self.free_cached: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int], cap: int) -> int:
        n = 0
        for h in hashes[:cap]:
            if h not in self.in_use and h not in self.free_cached:
                break
            n += 1
        return n

    def holds(self, h: int) -> bool:
        return h in self.in_use or h in self.free_cached

    def used(self) -> int:
        return len(self.in_use) + self.anonymous

    def can_allocate(self, hits: Sequence[int], blocks: int) -> bool:
        revived = sum(1 for h in hits if h in self.free_cached)
        return self.used() + revived + blocks <= self.capacity

    def acquire(self, hits: Sequence[int], blocks: int) -> list[int]:
        """Use the cached ``hits`` and ``blocks`` new blocks; returns the hashes evicted."""
        for h in hits:
            self.free_cached.pop(h, None)
            self.in_use[h] = self.in_use.get(h, 0) + 1
        evicted = []
        while self.used() + len(self.free_cached) + blocks > self.capacity:
            h, _ = self.free_cached.popitem(last=False)
            evicted.append(h)
        self.anonymous += blocks
        return evicted

    def register(self, hashes: Sequence[int], owned: int) -> list[int]:
        """A request's next ``hashes`` blocks are full: they become cached, in
        order, up to the ``owned`` anonymous blocks it holds; returns those
        cached. A hash already cached here (another request computed it
        meanwhile) keeps this copy anonymous; the blocks after it are cached
        (vLLM caches both copies; one by hash is what a lookup finds)."""
        stored = []
        for h in hashes[:owned]:
            if h in self.in_use or h in self.free_cached:
                continue
            self.anonymous -= 1
            self.in_use[h] = 1
            stored.append(h)
        return stored

    def release(self, hashes: Sequence[int], anonymous: int) -> None:
        # vLLM frees a request's blocks tail first: its last blocks are evicted first.
        for h in reversed(hashes):
            refs = self.in_use.get(h)
            if refs is None:
                continue
            if refs > 1:
                self.in_use[h] = refs - 1
            else:
                del self.in_use[h]
                self.free_cached[h] = None
        self.anonymous -= anonymous


@dataclass
class Job:
    """One request on one engine."""

    prompt_tokens: int
    hashes: list[int]  # full-block hashes of the prompt
    out_tokens: int  # 1 for a P/D prefill
    on_prompt_done: Callable[[Job], None] = lambda job: None
    on_first_token: Callable[[Job], None] = lambda job: None
    on_done: Callable[[Job], None] = lambda job: None
    # first admission of a prompt computed here: the blocks reused (the pod's and the store's)
    on_admitted: Callable[[Job, int], None] = lambda job, reused_blocks: None
    # The output token whose text the client sees first (0: the first); later
    # when the first tokens detokenize to nothing (special tokens skipped).
    visible_index: int = 0
    on_visible: Callable[[Job], None] = lambda job: None
    remote_kv: bool = False  # P/D decode: the prompt's KV is pulled, not computed
    hold_kv: bool = False  # P/D prefill: keep the blocks until ``Engine.release``
    # set by the engine
    cached_tokens: int = 0  # reused from the pod's cache or loaded from the store
    store_tokens: int = 0  # of which loaded from the store
    transferred_blocks: int = 0
    done_tokens: int = 0
    generated: int = 0
    ready_at: float = 0.0
    submitted_at: float = 0.0
    prompt_done: bool = False
    first_token_sent: bool = False
    visible_sent: bool = False
    finished: bool = False
    admitted: bool = False
    preemptions: int = 0
    held: list[int] = field(default_factory=list)  # hashes it uses
    anonymous: int = 0  # blocks it holds beyond ``held``
    # prompt blocks the engine has cached or found cached (vLLM's num_cached_block)
    cached_blocks: int = 0

    @property
    def todo(self) -> int:
        return 0 if self.remote_kv else self.prompt_tokens - self.done_tokens

    @property
    def blocks(self) -> int:
        return len(self.held) + self.anonymous

    def kv_tokens(self) -> int:
        """Tokens whose KV the job holds (or, remote, will hold once pulled)."""
        prompt = self.prompt_tokens if self.remote_kv else self.done_tokens
        return prompt + max(0, self.generated - 1)


@dataclass(frozen=True)
class EngineSettings:
    kv_blocks: int
    block_size: int = 128
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_threshold: int = 0  # 0: off
    block_bytes: int = 0  # bytes of one KV block (store loads, transfers)
    # vLLM's asynchronous scheduling (its default): a step is planned when the
    # one before it starts, so a request that arrives during a step waits for
    # the next one too.
    async_scheduling: bool = True
    # Core time other processes on the engine's cores take from a step, per
    # prompt it computes (see the module docstring).
    shared_core_s: float = 0.0


@dataclass
class _DecodeRun:
    """The steps of a batch of only decodes, as a run (module docstring)."""

    batch: int  # requests decoding, every running one
    context: int  # KV tokens they hold at the planned step
    grows: dict[int, list[Job]]  # step % block size -> requests that need a block then
    last: int  # the step whose end finishes a request or shows one its first text
    step: int = 0  # the step in flight, counted from the run's start


class Engine:
    def __init__(
        self,
        name: str,
        settings: EngineSettings,
        model: StepModel,
        loop: EventLoop,
        stored: BlockEvents,
        removed: BlockEvents,
        store: SharedStore | None = None,
        link: Link | None = None,
        decode_runs: bool = True,
    ) -> None:
        self.name = name
        self.s = settings
        self.model = model
        self.loop = loop
        self.kv = KVCache(settings.kv_blocks)
        self._stored, self._removed = stored, removed
        self.store = store
        self.link = link
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._busy = False
        self._wake_at: float | None = None
        self.decode_runs = decode_runs
        self._run: _DecodeRun | None = None
        self._cached: list[int] = []  # blocks cached by the step being planned
        self._step_start = self._step_end = -1.0  # the last step's
        self.busy_s = 0.0
        self.steps = 0

    # ----- what the router polls -----------------------------------------
    @property
    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage)"""
        return len(self.running), len(self.waiting), self.kv.used() / self.kv.capacity

    # ----- work -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        need = blocks_for(job.prompt_tokens + job.out_tokens, self.s.block_size)
        if need > self.kv.capacity:
            raise ValueError(
                f"{self.name}: a request of {job.prompt_tokens}+{job.out_tokens} tokens needs "
                f"{need} KV blocks, more than the pod's {self.kv.capacity}"
            )
        job.submitted_at = self.loop.now
        self.waiting.append(job)
        self._kick()

    def release(self, job: Job) -> None:
        """A held P/D prefill's blocks are pulled: free them."""
        if job.hold_kv and job.finished:
            job.hold_kv = False
            self._free(job)
            self._kick()

    def _free(self, job: Job) -> None:
        self.kv.release(job.held, job.anonymous)
        job.held, job.anonymous, job.cached_blocks = [], 0, 0

    def _kick(self) -> None:
        if self._busy:
            return
        now = self.loop.now
        if self.decode_runs and self._start_run(now):
            return
        plan = self._plan(now)
        if plan is None:
            ready = [j.ready_at for j in self.running if j.ready_at > now]
            if ready and min(ready) != self._wake_at:
                self._wake_at = min(ready)
                self.loop.at(self._wake_at, self._kick)
            return
        chunks, decodes, dt = plan
        cached, self._cached = self._cached, []
        self._step_start = now
        self._busy = True
        self.busy_s += dt
        self.steps += 1
        self.loop.after(dt, lambda: self._finish_step(chunks, decodes, cached))

    # ----- decode runs ------------------------------------------------------
    def _start_run(self, now: float) -> bool:
        """Start a decode run if the batch is only decodes; plan its first step."""
        if self.waiting or not self.running or len(self.running) > self.s.max_num_batched_tokens:
            return False
        bs = self.s.block_size
        grows: dict[int, list[Job]] = {}
        context = 0
        last = None
        for job in self.running:
            if job.ready_at > now or job.todo or not job.prompt_done or not job.first_token_sent:
                return False
            tokens = job.kv_tokens()
            # Step k needs room for tokens + k + 1: the first new block at
            # this step, then one every block_size steps.
            first_grow = job.blocks * bs - tokens
            if not 0 <= first_grow < bs:
                return False  # more than one block short, or more than one ahead
            grows.setdefault(first_grow, []).append(job)
            context += tokens
            left = job.out_tokens - job.generated - 1
            if not job.visible_sent:
                left = min(left, job.visible_index - job.generated)
            last = left if last is None else min(last, left)
        assert last is not None
        run = _DecodeRun(len(self.running), context, grows, last)
        if not self._plan_run_step(run):
            return False
        self._run = run
        return True

    def _plan_run_step(self, run: _DecodeRun) -> bool:
        """Plan the run's step as ``_plan`` would: the same blocks allocated
        (in the batch's order, evicting as ``_grow`` does) and the same step
        time. False, with nothing changed, when the blocks do not fit: the
        step-by-step plan preempts."""
        grow = run.grows.get(run.step % self.s.block_size, ())
        if grow:
            if self.kv.used() + len(grow) > self.kv.capacity:
                return False
            for job in grow:
                evicted = self.kv.acquire([], 1)
                if evicted:
                    self._removed(self.name, evicted)
                job.anonymous += 1
        dt = self.model.step([], run.batch, run.context)
        self._step_start = self.loop.now
        self._busy = True
        self.busy_s += dt
        self.steps += 1
        self.loop.after(dt, self._finish_run_step)
        return True

    def _finish_run_step(self) -> None:
        self._busy = False
        self._step_end = self.loop.now
        run = self._run
        assert run is not None
        if run.step == run.last:  # a request's last token: the step-by-step finish
            self._end_run(run.step)
            self._finish_step([], list(self.running), [])
            return
        run.step += 1
        run.context += run.batch
        if self.waiting or not self._plan_run_step(run):
            self._end_run(run.step)
            self._kick()

    def _end_run(self, steps: int) -> None:
        """The run's tokens, counted: ``steps`` steps have ended."""
        for job in self.running:
            job.generated += steps
        self._run = None

    def _grow(self, job: Job, tokens: int) -> bool:
        """Blocks for ``tokens`` of KV in all; False when they do not fit."""
        more = blocks_for(tokens, self.s.block_size) - job.blocks
        if more <= 0:
            return True
        if not self.kv.can_allocate([], more):
            return False
        evicted = self.kv.acquire([], more)
        if evicted:
            self._removed(self.name, evicted)
        job.anonymous += more
        return True

    def _preempt(self, job: Job) -> None:
        """vLLM's recompute preemption: the job frees its blocks and waits at
        the head of the queue; its prompt is computed again (from the cache
        where its blocks survive)."""
        self.running.remove(job)
        self._free(job)
        job.preemptions += 1
        job.admitted = job.prompt_done = job.remote_kv = False
        job.done_tokens = 0
        self.waiting.appendleft(job)

    def _plan(self, now: float) -> tuple[list[tuple[Job, int]], list[Job], float] | None:
        budget = self.s.max_num_batched_tokens
        chunks: list[tuple[Job, int]] = []
        decodes: list[Job] = []
        busy = len(self.running) + len(self.waiting) > 1
        preempted = False
        # Running requests first, oldest first; a request that cannot grow
        # preempts the newest running one (itself, if it is the newest). So
        # a victim is never a request already in this step, as in vLLM's
        # first-come-first-served scheduler: what this step cached stays.
        i = 0
        while i < len(self.running) and budget > 0:
            job = self.running[i]
            if job.ready_at > now:
                i += 1
                continue
            decoding = job.todo == 0
            n = 1 if decoding else self._chunk(job, budget, busy)
            while not self._grow(job, job.kv_tokens() + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            else:
                if decoding:
                    decodes.append(job)
                else:
                    chunks.append((job, n))
                    self._cache(job, job.done_tokens + n)
                budget -= n
                i += 1
                continue
            break  # the job itself was preempted: the newest are gone
        # Asynchronous scheduling: a step that continues the work of the one
        # before it was planned as that one started, so only requests that had
        # come by then are in it (an engine with nothing running plans at once).
        arrived_by = now
        if self.s.async_scheduling and self.running and now == self._step_end:
            arrived_by = self._step_start
        # vLLM schedules no waiting request in a step that preempted one.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.s.max_num_seqs
        ):
            job = self.waiting[0]
            if job.submitted_at > arrived_by:
                break
            first = self._admit(job, now, budget, busy)
            if first is None:
                break  # first come, first served: the head waits for blocks
            self.waiting.popleft()
            self.running.append(job)
            if job.ready_at > now:
                continue
            if job.remote_kv:
                decodes.append(job)
                budget -= 1
            elif first:
                chunks.append((job, first))
                self._cache(job, job.done_tokens + first)
                budget -= first
        if not chunks and not decodes:
            return None
        context = sum(j.kv_tokens() for j in decodes)
        dt = self.model.step([(n, j.done_tokens) for j, n in chunks], len(decodes), context)
        return chunks, decodes, dt + len(chunks) * self.s.shared_core_s

    def _chunk(self, job: Job, budget: int, shared: bool) -> int:
        n = min(job.todo, budget)
        if shared and self.s.long_prefill_threshold > 0:
            n = min(n, self.s.long_prefill_threshold)
        return n

    def _admit(self, job: Job, now: float, budget: int, busy: bool) -> int | None:
        """Admit the head of the queue: its cached prefix, and blocks for its
        first chunk (a P/D decode: for the whole prompt it pulls). The chunk's
        tokens, or None when its blocks do not fit."""
        bs = self.s.block_size
        cap = (job.prompt_tokens - 1) // bs
        hit = self.kv.match(job.hashes, cap)
        from_ram = from_disk = 0
        if self.store is not None and not job.remote_kv:
            from_ram, from_disk = self.store.match(job.hashes[hit:cap])
        from_store = from_ram + from_disk
        cached = (hit + from_store) * bs
        if job.remote_kv:
            first = job.prompt_tokens + 1
        else:
            first = cached + min(job.prompt_tokens - cached, budget)
            if busy and self.s.long_prefill_threshold > 0:
                first = min(first, cached + self.s.long_prefill_threshold)
        # vLLM admits a request only if its whole sequence fits
        # (``scheduler_reserve_full_isl``), though it allocates the first chunk.
        whole = max(first, job.prompt_tokens + job.generated)
        if not self.kv.can_allocate(job.hashes[:hit], blocks_for(whole, bs) - hit):
            return None
        more = blocks_for(first, bs) - hit
        evicted = self.kv.acquire(job.hashes[:hit], more)
        if evicted:
            self._removed(self.name, evicted)
        job.held = list(job.hashes[:hit])
        job.anonymous = more
        job.cached_blocks = hit
        job.admitted = True
        if not job.preemptions:  # what the client sees: the first admission's hits
            job.cached_tokens = cached
            job.store_tokens = from_store * bs
            if not job.remote_kv:
                job.on_admitted(job, hit + from_store)
        if job.remote_kv:
            job.transferred_blocks = max(0, len(job.hashes) - hit)
            link = self.link or Link(float("inf"), 0.0)
            job.ready_at = now + link.transfer_s(job.transferred_blocks, self.s.block_bytes)
            return 0
        job.done_tokens = cached
        if from_store:
            assert self.store is not None
            job.ready_at = now + self.store.load_s(from_ram, from_disk, self.s.block_bytes)
            return 0
        return first - cached

    def _finish_step(
        self, chunks: list[tuple[Job, int]], decodes: list[Job], cached: list[int]
    ) -> None:
        """The step's end: its KV events (the blocks it cached), its tokens."""
        self._busy = False
        self._step_end = self.loop.now
        if cached:
            self._stored(self.name, cached)
        for job, n in chunks:
            if not job.admitted:
                continue  # preempted meanwhile
            job.done_tokens += n
            if job.todo == 0:
                self._prompt_done(job)
        for job in decodes:
            if not job.admitted:
                continue
            job.generated += 1
            if not job.prompt_done:  # a pulled prompt: its first token is the decode's
                job.prompt_done = True
                stored = self._register(job, len(job.hashes))
                if stored:
                    self._stored(self.name, stored)
            self._tokens_counted(job)
            if job.generated >= job.out_tokens:
                self._finish(job)
        self._kick()

    def _prompt_done(self, job: Job) -> None:
        job.prompt_done = True
        if self.store is not None:
            self.store.put(job.hashes)
        if job.generated == 0:
            job.on_prompt_done(job)
            job.generated = 1  # the step that ends a prompt samples its first token
        self._tokens_counted(job)
        if job.generated >= job.out_tokens:
            self._finish(job)

    def _tokens_counted(self, job: Job) -> None:
        """Tokens were counted: the first token's and the first text's callbacks, once."""
        if not job.first_token_sent:
            job.first_token_sent = True
            job.on_first_token(job)
        if not job.visible_sent and job.generated > job.visible_index:
            job.visible_sent = True
            job.on_visible(job)

    def _cache(self, job: Job, tokens: int) -> None:
        """A chunk scheduled up to ``tokens`` of the prompt: its full blocks
        are cached now, as vLLM's ``allocate_slots`` caches them, and
        published when the step ends."""
        self._cached.extend(self._register(job, tokens // self.s.block_size))

    def _register(self, job: Job, full_blocks: int) -> list[int]:
        """The prompt's first ``full_blocks`` blocks become cached; returns
        the hashes cached."""
        end = min(full_blocks, len(job.hashes))
        if end <= job.cached_blocks:
            return []
        stored = self.kv.register(job.hashes[job.cached_blocks : end], job.anonymous)
        job.cached_blocks = end
        job.held.extend(stored)
        job.anonymous -= len(stored)
        return stored

    def _finish(self, job: Job) -> None:
        job.finished = True
        self.running.remove(job)
        if not job.hold_kv:
            self._free(job)
        job.on_done(job)


class SharedStore:
    """The shared KV store (Mooncake, ``services/kvstore``): a RAM tier and an
    optional disk tier, blocks by hash.

    As the real store: a put writes a block not yet stored to RAM and, with
    the disk tier, to disk too ("offload at put"); a block already stored
    (in either tier) is not written again, only looked up, which refreshes
    its place in the LRU as a read does. With ``pin_ttl_s`` every block
    written is soft-pinned for that long from its write (reads do not renew
    it): RAM past capacity evicts its least recently used unpinned block,
    a pinned one only when none is left. A block evicted from RAM stays
    readable from disk; the disk drops its least recently used past capacity.
    A lookup reads the longest run of the chain found in either tier.
    """

    def __init__(
        self,
        ram: StoreTier,
        clock: Callable[[], float],
        disk: StoreTier | None = None,
        pin_ttl_s: float = 0.0,
    ) -> None:
        self.tier = ram
        self.disk_tier = disk
        self.pin_ttl_s = pin_ttl_s
        self._clock = clock
        self.blocks: OrderedDict[int, float] = OrderedDict()  # RAM: hash -> pinned until
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.loads = 0
        self.disk_hits = 0  # blocks read from disk

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        """The prefix of ``hashes`` the store holds: (blocks in RAM, blocks on disk only)."""
        ram = disk = 0
        for h in hashes:
            if h in self.blocks:
                ram += 1
            elif h in self.disk:
                disk += 1
            else:
                break
            self._touch(h)
        return ram, disk

    def _touch(self, h: int) -> None:
        """A read (lease) of a block: the most recently used in both tiers (one object)."""
        if h in self.blocks:
            self.blocks.move_to_end(h)
        if h in self.disk:
            self.disk.move_to_end(h)

    def put(self, hashes: Sequence[int]) -> None:
        pinned_until = self._clock() + self.pin_ttl_s if self.pin_ttl_s else 0.0
        for h in hashes:
            if h in self.blocks or h in self.disk:
                self._touch(h)
                continue
            self.blocks[h] = pinned_until
            if self.disk_tier is not None:
                self.disk[h] = None
        self._evict()

    def _evict(self) -> None:
        now = self._clock()
        while len(self.blocks) > self.tier.capacity_blocks:
            victim = next((h for h, until in self.blocks.items() if until <= now), None)
            if victim is None:  # all pinned: the least recently used goes
                self.blocks.popitem(last=False)
            else:
                del self.blocks[victim]
        if self.disk_tier is not None:
            while len(self.disk) > self.disk_tier.capacity_blocks:
                self.disk.popitem(last=False)

    def load_s(self, ram: int, disk: int, block_bytes: int) -> float:
        self.loads += 1
        self.disk_hits += disk
        seconds = self.tier.load_s(ram, block_bytes)
        if disk and self.disk_tier is not None:
            seconds += self.disk_tier.load_s(disk, block_bytes)
        return seconds
