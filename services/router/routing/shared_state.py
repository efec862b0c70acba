"""The shared-state store: session bindings and in-flight load, shared by
router replicas through Redis.

The routing core decides over a ``SharedView`` read from the store before a
decision (``read``) and returns ``StateWrites`` the store takes after it
(``write``). Two stores, one interface:

* ``LocalState``: this replica alone (no Redis configured): bindings in an
  LRU with an idle TTL, nobody else's load.
* ``RedisState``: bindings live in Redis (``<prefix>:sess:<key>``, idle TTL), so
  any replica routes a session's next turn to the same pod. Each replica
  mirrors its own in-flight load (exact in its routing core) into its own
  hash (``<prefix>:load:<replica>``, fields ``POD|r`` and ``POD|t`` plus an
  ``alive`` marker, expiring unless refreshed, so a crashed replica's load
  disappears); a background task sums the other replicas' hashes every
  ``refresh_s``, so their load is seen up to ``refresh_s`` late.

  When Redis fails (or is unreachable at start) the replica logs it, keeps
  serving on local state, probes every ``retry_s``, and when Redis is back
  (on fresh connections) re-writes its own load, re-reads the others', and
  writes back every binding it holds: those it made meanwhile overwrite, the
  others are written only where Redis has none, so a Redis that came back
  empty (restarted without persistence) gets them back and a binding another
  replica made meanwhile is kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from services.router.routing.core import PodLoad, SharedView, StateWrites
from services.router.routing.policy import Binding
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Field of every replica's load hash, so that a replica with no load yet is not
# taken for one that is gone (whose hash expired).
_ALIVE = "alive"


def _encode_binding(b: Binding) -> str:
    return f"{b.pod}|{b.prefill_pod or ''}"


def _decode_binding(raw: str | bytes | None) -> Binding | None:
    if not raw:
        return None
    if isinstance(raw, bytes):
        raw = raw.decode()
    pod, _, prefill = raw.partition("|")
    return Binding(pod, prefill or None)


class LocalState:
    """Session bindings of this replica (LRU with idle TTL); nothing shared."""

    up = False  # whether Redis is reachable (RedisState); nothing to reach here

    def __init__(self, binding_ttl_s: float = 3600.0, max_sessions: int = 1_000_000) -> None:
        if binding_ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("binding TTL and bound must be positive")
        self.binding_ttl_s = binding_ttl_s
        self.max_sessions = max_sessions
        # session -> (binding, expiry); least recently written first, which with
        # one TTL for all is also soonest to expire.
        self._bindings: OrderedDict[str, tuple[Binding, float]] = OrderedDict()
        self.evictions = 0  # bindings dropped by the bound before their TTL

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @property
    def shared(self) -> bool:
        return False

    async def read(self, session: str | None, now: float) -> SharedView:
        """The session's binding and the other replicas' load, before a decision."""
        return SharedView(self.local_binding(session, now) if session else None)

    async def write(self, writes: StateWrites, now: float) -> None:
        """What a decision (or the end of a request) changed, after it."""
        if writes.binding is not None:
            self.set_local_binding(*writes.binding, now)

    def local_binding(self, session: str, now: float) -> Binding | None:
        entry = self._bindings.get(session)
        if entry is None:
            return None
        binding, expiry = entry
        if expiry < now:
            del self._bindings[session]
            return None
        return binding

    def set_local_binding(self, session: str, binding: Binding, now: float) -> None:
        bindings = self._bindings
        bindings[session] = (binding, now + self.binding_ttl_s)
        bindings.move_to_end(session)
        while bindings:
            oldest, (_, expiry) = next(iter(bindings.items()))
            if expiry >= now and len(bindings) <= self.max_sessions:
                break
            del bindings[oldest]
            self._forgot(oldest)
            if expiry >= now:
                self.evictions += 1

    @property
    def entries(self) -> int:
        """Bindings held in this replica's memory."""
        return len(self._bindings)

    def _forgot(self, session: str) -> None:
        """``session``'s local binding was dropped (expired or evicted)."""


class RedisState(LocalState):
    def __init__(
        self,
        url: str,
        replica_id: str | None = None,
        prefix: str = "tandem",
        binding_ttl_s: float = 3600.0,
        refresh_s: float = 0.2,
        retry_s: float = 1.0,
        load_ttl_s: float = 15.0,
        timeout_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = 1_000_000,
    ) -> None:
        super().__init__(binding_ttl_s, max_sessions)
        import redis.asyncio as aioredis

        self.url = url
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.prefix = prefix
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.load_ttl_s = load_ttl_s
        # The background tasks' time; callers pass theirs (on the same clock).
        self._clock = clock
        self._redis: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self.up = False
        self.outages = 0
        self._down_logged = False
        self._dirty_sessions: set[str] = set()
        self._published: dict[str, PodLoad] = {}  # this replica's load, as last written
        self._remote_loads: dict[str, PodLoad] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def shared(self) -> bool:
        return True

    def _forgot(self, session: str) -> None:
        # A binding made during an outage and dropped since cannot be written back.
        self._dirty_sessions.discard(session)

    # ----- keys -------------------------------------------------------------
    def _sess_key(self, session: str) -> str:
        return f"{self.prefix}:sess:{session}"

    def _load_key(self, replica: str) -> str:
        return f"{self.prefix}:load:{replica}"

    @property
    def _replicas_key(self) -> str:
        return f"{self.prefix}:replicas"

    # ----- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await self._try_resync()
        self._task = asyncio.create_task(self._background(), name="redis-state")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self.up:
            try:
                await self._redis.delete(self._load_key(self.replica_id))
                await self._redis.srem(self._replicas_key, self.replica_id)
            except Exception:
                pass
        await self._redis.aclose()

    def _went_down(self, err: Exception) -> None:
        if self.up:
            self.outages += 1
        if not self._down_logged:  # once per outage, and when unreachable at start
            log.warning(
                "redis %s unreachable (%s): serving on local state until it returns", self.url, err
            )
            self._down_logged = True
        self.up = False

    async def _try_resync(self) -> bool:
        """Push this replica's state to Redis; True when Redis is up afterwards."""
        try:
            if not self.up:
                # Pooled connections to a Redis that restarted are dead; each
                # would fail once later and count as a new outage.
                await self._redis.connection_pool.disconnect()
            await self._redis.ping()
            pipe = self._redis.pipeline(transaction=False)
            key = self._load_key(self.replica_id)
            pipe.delete(key)
            pipe.hset(key, _ALIVE, 1)  # the hash exists even before any load
            for pod, load in self._published.items():
                pipe.hset(key, mapping=_load_fields(pod, load))
            pipe.expire(key, int(self.load_ttl_s))
            pipe.sadd(self._replicas_key, self.replica_id)
            await pipe.execute()
            # Redis may have come back empty: restore what this replica knows,
            # without overwriting what other replicas wrote meanwhile.
            made_meanwhile = set(self._dirty_sessions)
            restored = await self._write_bindings(
                [s for s in self._bindings if s not in made_meanwhile], only_missing=True
            )
            # The others' load as it is now, not as it was before the outage.
            await self._refresh_remote_loads()
            written = 0
            while self._dirty_sessions:  # made during the outage (more may come meanwhile)
                dirty = list(self._dirty_sessions)
                await self._write_bindings(dirty, only_missing=False)
                self._dirty_sessions.difference_update(dirty)
                written += len(dirty)
            # No await since the loop's last check: a binding made from here on
            # sees up=True and goes straight to Redis.
            if not self.up:
                log.info(
                    "redis %s reachable: state re-synced (%d bindings made while "
                    "unreachable, %d restored)",
                    self.url,
                    written,
                    restored,
                )
            self.up = True
            self._down_logged = False
        except Exception as err:  # redis.RedisError, OSError, timeouts
            self._went_down(err)
        return self.up

    async def _write_bindings(
        self, sessions: list[str], only_missing: bool, chunk: int = 1000
    ) -> int:
        """Write these sessions' local bindings with their remaining TTL; with
        ``only_missing``, only where Redis has none. Returns how many were written."""
        written = 0
        for i in range(0, len(sessions), chunk):
            now = self._clock()
            pipe = self._redis.pipeline(transaction=False)
            for session in sessions[i : i + chunk]:
                entry = self._bindings.get(session)
                if entry is None or entry[1] <= now:
                    continue
                binding, expiry = entry
                pipe.set(
                    self._sess_key(session),
                    _encode_binding(binding),
                    ex=max(1, int(expiry - now)),
                    nx=only_missing,
                )
            written += sum(1 for ok in await pipe.execute() if ok)
        return written

    async def _background(self) -> None:
        last_heartbeat = 0.0
        while True:
            if not self.up:
                await asyncio.sleep(self.retry_s)
                await self._try_resync()
                continue
            try:
                now = self._clock()
                if now - last_heartbeat > self.load_ttl_s / 3:
                    pipe = self._redis.pipeline(transaction=False)
                    pipe.hset(self._load_key(self.replica_id), _ALIVE, 1)
                    pipe.expire(self._load_key(self.replica_id), int(self.load_ttl_s))
                    pipe.sadd(self._replicas_key, self.replica_id)
                    await pipe.execute()
                    last_heartbeat = now
                await self._refresh_remote_loads()
            except Exception as err:
                self._went_down(err)
            await asyncio.sleep(self.refresh_s)

    async def _refresh_remote_loads(self) -> None:
        replicas: list[str] = [
            r for r in await self._redis.smembers(self._replicas_key) if r != self.replica_id
        ]
        pipe = self._redis.pipeline(transaction=False)
        for r in replicas:
            pipe.hgetall(self._load_key(r))
        totals: dict[str, PodLoad] = {}
        gone = []
        for r, fields in zip(replicas, await pipe.execute()):
            if not fields:
                gone.append(r)  # its load key expired: the replica is gone
                continue
            for name, value in fields.items():
                pod, sep, kind = name.rpartition("|")
                if not sep:
                    continue  # the alive marker
                n = max(0, int(value))
                load = totals.get(pod, PodLoad())
                totals[pod] = (
                    PodLoad(load.in_flight + n, load.pending_prefill_tokens)
                    if kind == "r"
                    else PodLoad(load.in_flight, load.pending_prefill_tokens + n)
                )
        if gone:
            await self._redis.srem(self._replicas_key, *gone)
        self._remote_loads = totals

    # ----- the store's interface ------------------------------------------
    async def read(self, session: str | None, now: float) -> SharedView:
        """The session's binding (from Redis while it is up) and the other
        replicas' load as of the last refresh (none while Redis is down)."""
        binding = await self.get_binding(session, now) if session else None
        return SharedView(binding, self._remote_loads if self.up else {})

    async def write(self, writes: StateWrites, now: float) -> None:
        """This replica's new load and binding, in one round trip."""
        for pod, load in writes.loads.items():
            # A pod with no load has no fields: pods come and go, the hash stays small.
            if load == PodLoad():
                self._published.pop(pod, None)
            else:
                self._published[pod] = load
        if writes.binding is not None:
            self.set_local_binding(*writes.binding, now)
        if not (writes.loads or writes.binding):
            return
        if self.up:
            try:
                pipe = self._redis.pipeline(transaction=False)
                if writes.loads:
                    # Absolute values, not increments: a lost write never skews the count.
                    key = self._load_key(self.replica_id)
                    for pod, load in writes.loads.items():
                        if load == PodLoad():
                            pipe.hdel(key, *_load_fields(pod, load))
                        else:
                            pipe.hset(key, mapping=_load_fields(pod, load))
                    pipe.expire(key, int(self.load_ttl_s))
                if writes.binding is not None:
                    session, binding = writes.binding
                    pipe.set(
                        self._sess_key(session),
                        _encode_binding(binding),
                        ex=int(self.binding_ttl_s),
                    )
                await pipe.execute()
                return
            except Exception as err:
                self._went_down(err)
        # Loads are re-written in full on re-sync; bindings made meanwhile too.
        if writes.binding is not None:
            self._dirty_sessions.add(writes.binding[0])

    # ----- bindings ---------------------------------------------------------
    async def get_binding(self, session: str, now: float) -> Binding | None:
        if self.up:
            try:
                binding = _decode_binding(await self._redis.get(self._sess_key(session)))
                if binding is not None:
                    self.set_local_binding(session, binding, now)
                    return binding
                if session in self._dirty_sessions:
                    return self.local_binding(session, now)
                return None
            except Exception as err:
                self._went_down(err)
        return self.local_binding(session, now)

    async def set_binding(self, session: str, binding: Binding, now: float) -> None:
        await self.write(StateWrites(binding=(session, binding)), now)


def _load_fields(pod: str, load: PodLoad) -> Mapping[str, int]:
    return {f"{pod}|r": load.in_flight, f"{pod}|t": load.pending_prefill_tokens}
