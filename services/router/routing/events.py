"""vLLM KV events: the wire format, applying a batch to the index, and an
async ZMQ subscriber per pod that detects sequence gaps and re-syncs through
the engine's replay socket.

Wire format (vLLM 0.32 ``ZmqEventPublisher``): PUB frames ``[topic, seq, payload]``
with ``seq`` an 8-byte big-endian counter from 0 per publisher and ``payload``
a msgpack ``KVEventBatch`` ``[ts, events, dp_rank]``; each event is a map
tagged ``type`` = ``BlockStored`` | ``BlockRemoved`` | ``AllBlocksCleared``.
Replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER endpoint and gets
``[b"", topic, seq, payload]`` per buffered batch with seq >= start_seq, then
``[b"", b"", END, b""]`` with END = -1.

The structs below mirror vLLM's ``vllm.distributed.kv_events`` field for field
(unknown fields are ignored), so the router decodes events without importing
vLLM; a test decodes payloads that vLLM's own classes encoded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from services.router.routing.index import PrefixIndex
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger(__name__)

END_SEQ = -1


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def _as_int(h: int | bytes) -> int:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes full digests: key by low 64 bits.
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & ((1 << 64) - 1)
    return h


# The engine's own KV cache: vLLM labels it ``GPU`` even on CPU (None from
# publishers that predate the field).
_DEVICE_MEDIA = (None, "GPU")


def apply_batch(index: PrefixIndex, pod: str, batch: KVEventBatch) -> None:
    """Apply one batch of events to the pod's entries in the index. Only the
    engine's own cache counts as held: the KV store connector publishes each
    block it writes to the shared store (medium ``cpu``) on the writing
    engine's stream and never its removal, and a block there is no more this
    pod's than any other's."""
    for event in batch.events:
        if isinstance(event, (BlockStored, BlockRemoved)) and event.medium not in _DEVICE_MEDIA:
            continue
        if isinstance(event, BlockStored):
            index.stored(pod, [_as_int(h) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            index.removed(pod, [_as_int(h) for h in event.block_hashes])
        elif isinstance(event, AllBlocksCleared):
            index.clear_pod(pod)


@dataclass
class SubscriberStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0  # batches neither received nor replayable (buffer overrun)
    restarts: int = 0  # publisher sequence went back: engine restarted
    last_seq: int = -1
    connected: bool = False
    errors: int = 0  # malformed batches and replays that timed out
    last_error: str | None = None


class KvEventSubscriber:
    """Keeps one pod's entries in the index in step with its KV event stream.

    Sequence numbers must arrive contiguously. A gap (or joining late) triggers
    a replay request from the first missing number; what the publisher no
    longer buffers is counted as lost, and the pod's entries are rebuilt from
    scratch only when the publisher restarted (sequence went back).
    """

    def __init__(
        self,
        pod: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        topic: str = "kv",
        replay_timeout_s: float = 5.0,
        on_batch: Callable[[str, KVEventBatch], None] | None = None,
    ) -> None:
        self.pod = pod
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.on_batch = on_batch
        self.stats = SubscriberStats()
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._ctx: zmq.asyncio.Context | None = None

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._task = asyncio.create_task(self._run(self._ctx), name=f"kv-events-{self.pod}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # The loop: receive, check the sequence, replay what is missing, apply.
    async def _run(self, ctx: zmq.asyncio.Context) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self.stats.connected = True
        try:
            while True:
                topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                try:
                    await self.handle(seq, payload)
                except (msgspec.DecodeError, ValueError) as err:
                    # A malformed batch must not stop the stream; treat it as lost.
                    self._error(f"seq {seq}: {err}")
                    self._count_lost(1)
                    self._next_seq = seq + 1
        finally:
            self.stats.connected = False
            sub.close(linger=0)

    async def handle(self, seq: int, payload: bytes) -> None:
        """Apply one received batch, replaying any batches missed before it."""
        if seq < self._next_seq:
            if seq == 0 or self._next_seq - seq > 1_000:
                # The publisher started over: the engine restarted with an empty cache.
                log.warning(
                    "kv events from %s restarted at seq %d (expected %d): "
                    "clearing its index entries",
                    self.pod,
                    seq,
                    self._next_seq,
                )
                self.stats.restarts += 1
                self.index.clear_pod(self.pod)
                self._next_seq = 0
                if seq > 0:
                    await self._replay_from(0, seq)
            else:
                return  # duplicate of something already applied via replay
        elif seq > self._next_seq:
            self.stats.gaps += 1
            log.info("kv events from %s: gap %d..%d, replaying", self.pod, self._next_seq, seq - 1)
            await self._replay_from(self._next_seq, seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        apply_batch(self.index, self.pod, batch)
        self.stats.batches += 1
        self.stats.last_seq = seq
        self._next_seq = seq + 1
        if self.on_batch is not None:
            self.on_batch(self.pod, batch)

    async def _replay_from(self, start: int, until: int) -> None:
        """Fetch and apply batches [start, until) from the replay socket."""
        if self.replay_endpoint is None or self._ctx is None:
            self._count_lost(until - start)
            self._next_seq = until
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                _, _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ or seq >= until:
                    if seq == END_SEQ:
                        break
                    continue  # newer than what we wait for: it arrives on SUB too
                if seq < self._next_seq:
                    continue
                if seq > self._next_seq:
                    self._count_lost(seq - self._next_seq)
                self.stats.replayed += 1
                self._apply(seq, payload)
        except TimeoutError:
            self._error(f"replay from {start} timed out")
            log.warning("kv events from %s: replay timed out", self.pod)
        finally:
            dealer.close(linger=0)
        if self._next_seq < until:
            self._count_lost(until - self._next_seq)
            self._next_seq = until

    def _error(self, what: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = what

    def _count_lost(self, n: int) -> None:
        # Lost stores mean under-prediction; lost removals can leave phantom
        # blocks until the LRU bound drops them or the engine restarts.
        self.stats.lost += n
        log.warning("kv events from %s: %d batch(es) lost beyond the replay buffer", self.pod, n)
