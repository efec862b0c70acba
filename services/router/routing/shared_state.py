"""Session bindings and in-flight load, shared by router replicas through Redis.

Two implementations of one async interface:

* ``LocalState``: this replica alone (no Redis configured).
* ``RedisState``: bindings live in Redis (``<prefix>:sess:<key>``, idle TTL), so
  any replica routes a session's next turn to the same pod. Each replica keeps
  its in-flight counts exact in memory and mirrors them into its own hash
  (``<prefix>:load:<replica>``, fields ``POD|r`` and ``POD|t`` plus an
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
from dataclasses import dataclass

from services.router.routing.policy import Binding
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger("tandem.router.routing.shared_state")


@dataclass
class PodLoad:
    in_flight: int = 0
    pending_prefill_tokens: int = 0


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
    """Bindings (LRU with idle TTL) and in-flight load of this replica."""

    def __init__(self, binding_ttl_s: float = 3600.0, max_sessions: int = 1_000_000) -> None:
        self.binding_ttl_s = binding_ttl_s
        self.max_sessions = max_sessions
        self._bindings: OrderedDict[str, tuple[Binding, float]] = OrderedDict()
        self._loads: dict[str, PodLoad] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @property
    def shared(self) -> bool:
        return False

    async def get_binding(self, session: str) -> Binding | None:
        return self.local_binding(session)

    def local_binding(self, session: str) -> Binding | None:
        entry = self._bindings.get(session)
        if entry is None:
            return None
        binding, expiry = entry
        if expiry < time.monotonic():
            del self._bindings[session]
            return None
        return binding

    async def set_binding(self, session: str, binding: Binding) -> None:
        self.set_local_binding(session, binding)

    def set_local_binding(self, session: str, binding: Binding) -> None:
        self._bindings[session] = (binding, time.monotonic() + self.binding_ttl_s)
        self._bindings.move_to_end(session)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)

    def local_bindings(self) -> dict[str, Binding]:
        return {k: b for k, (b, _) in self._bindings.items()}

    async def add_load(self, pod: str, requests: int, prefill_tokens: int) -> None:
        self.add_local_load(pod, requests, prefill_tokens)

    def add_local_load(self, pod: str, requests: int, prefill_tokens: int) -> None:
        load = self._loads.setdefault(pod, PodLoad())
        load.in_flight = max(0, load.in_flight + requests)
        load.pending_prefill_tokens = max(0, load.pending_prefill_tokens + prefill_tokens)

    def local_loads(self) -> dict[str, PodLoad]:
        return {p: PodLoad(l.in_flight, l.pending_prefill_tokens) for p, l in self._loads.items()}

    async def loads(self) -> dict[str, PodLoad]:
        return self.local_loads()


class RedisState(LocalState):
    def __init__(self, url: str, replica_id: str | None = None, prefix: str = "tandem",
                 binding_ttl_s: float = 3600.0, refresh_s: float = 0.2, retry_s: float = 1.0,
                 load_ttl_s: float = 15.0, timeout_s: float = 0.25) -> None:
        super().__init__(binding_ttl_s)
        import redis.asyncio as aioredis

        self.url = url
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.prefix = prefix
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.load_ttl_s = load_ttl_s
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s,
                                              decode_responses=True)
        self.up = False
        self.outages = 0
        self._down_logged = False
        self._dirty_sessions: set[str] = set()
        self._remote_loads: dict[str, PodLoad] = {}
        self._task: asyncio.Task | None = None

    @property
    def shared(self) -> bool:
        return True

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
            log.warning("redis %s unreachable (%s): serving on local state until it returns",
                        self.url, err)
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
            for pod, load in self.local_loads().items():
                pipe.hset(key, mapping={f"{pod}|r": load.in_flight,
                                        f"{pod}|t": load.pending_prefill_tokens})
            pipe.expire(key, int(self.load_ttl_s))
            pipe.sadd(self._replicas_key, self.replica_id)
            await pipe.execute()
            # Redis may have come back empty: restore what this replica knows,
            # without overwriting what other replicas wrote meanwhile.
            made_meanwhile = set(self._dirty_sessions)
            restored = await self._write_bindings(
                [s for s in self._bindings if s not in made_meanwhile], only_missing=True)
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
                log.info("redis %s reachable: state re-synced (%d bindings made while "
                         "unreachable, %d restored)", self.url, written, restored)
            self.up = True
            self._down_logged = False
        except Exception as err:  # redis.RedisError, OSError, timeouts
            self._went_down(err)
        return self.up

    async def _write_bindings(self, sessions: list[str], only_missing: bool,
                              chunk: int = 1000) -> int:
        """Write these sessions' local bindings with their remaining TTL; with
        ``only_missing``, only where Redis has none. Returns how many were written."""
        written = 0
        for i in range(0, len(sessions), chunk):
            now = time.monotonic()
            pipe = self._redis.pipeline(transaction=False)
            for session in sessions[i:i + chunk]:
                entry = self._bindings.get(session)
                if entry is None or entry[1] <= now:
                    continue
                binding, expiry = entry
                pipe.set(self._sess_key(session), _encode_binding(binding),
                         ex=max(1, int(expiry - now)), nx=only_missing)
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
                now = time.monotonic()
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
        replicas = [r for r in await self._redis.smembers(self._replicas_key)
                    if r != self.replica_id]
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
                load = totals.setdefault(pod, PodLoad())
                if kind == "r":
                    load.in_flight += max(0, int(value))
                else:
                    load.pending_prefill_tokens += max(0, int(value))
        if gone:
            await self._redis.srem(self._replicas_key, *gone)
        self._remote_loads = totals

    # ----- bindings ---------------------------------------------------------
    async def get_binding(self, session: str) -> Binding | None:
        if self.up:
            try:
                raw = await self._redis.get(self._sess_key(session))
                binding = _decode_binding(raw)
                if binding is not None:
                    self.set_local_binding(session, binding)
                    return binding
                return self.local_binding(session) if session in self._dirty_sessions else None
            except Exception as err:
                self._went_down(err)
        return self.local_binding(session)

    async def set_binding(self, session: str, binding: Binding) -> None:
        self.set_local_binding(session, binding)
        if self.up:
            try:
                await self._redis.set(self._sess_key(session), _encode_binding(binding),
                                      ex=int(self.binding_ttl_s))
                return
            except Exception as err:
                self._went_down(err)
        self._dirty_sessions.add(session)

    # ----- load -------------------------------------------------------------
    async def add_load(self, pod: str, requests: int, prefill_tokens: int) -> None:
        self.add_local_load(pod, requests, prefill_tokens)
        if not self.up:
            return  # re-written in full on re-sync
        try:
            pipe = self._redis.pipeline(transaction=False)
            key = self._load_key(self.replica_id)
            load = self._loads[pod]
            # Absolute values, not increments: a lost write never skews the count.
            pipe.hset(key, mapping={f"{pod}|r": load.in_flight,
                                    f"{pod}|t": load.pending_prefill_tokens})
            pipe.expire(key, int(self.load_ttl_s))
            await pipe.execute()
        except Exception as err:
            self._went_down(err)

    async def loads(self) -> dict[str, PodLoad]:
        """This replica's exact load plus the others' (as of the last refresh)."""
        total = self.local_loads()
        if self.up:
            for pod, remote in self._remote_loads.items():
                load = total.setdefault(pod, PodLoad())
                load.in_flight += remote.in_flight
                load.pending_prefill_tokens += remote.pending_prefill_tokens
        return total
