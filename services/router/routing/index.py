"""Which KV blocks each pod holds, and how much of a prompt each pod has cached.

Blocks are keyed by the 64-bit hashes KV events carry (see ``hashing``). One
ordered map, hash -> bitmask of pods holding it, serves every pod, so a block
cached on several pods costs one entry; extra physical copies of a hash on the
same pod (vLLM publishes a duplicate ``BlockStored`` when it recomputes a
cached block, and one ``BlockRemoved`` per copy) are counted on the side.

Memory is bounded: past ``capacity`` hashes, the least recently stored or
matched hash is forgotten on every pod (an under-estimate of what pods hold,
never a phantom hit that lasts). Pods that publish no KV events get
*predicted* entries from the router's own decisions, which expire after a TTL;
pods that do publish also get them for a few seconds, covering the gap between
a routing decision and the engine's events (concurrent forks of one context).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000, predicted_capacity: int = 200_000) -> None:
        if capacity <= 0 or predicted_capacity <= 0:
            raise ValueError("index capacities must be positive")
        self.capacity = capacity
        self.predicted_capacity = predicted_capacity
        self._bits: dict[str, int] = {}  # pod -> bit number
        self._blocks: OrderedDict[int, int] = OrderedDict()  # hash -> pod bitmask
        self._extra_copies: dict[tuple[int, int], int] = {}  # (bit, hash) -> copies - 1
        self._held: dict[int, int] = {}  # bit -> distinct hashes held
        # bit -> hash -> expiry, oldest first. One queue per pod: a pod's
        # predictions share one TTL, so each queue expires in order.
        self._predicted: dict[int, OrderedDict[int, float]] = {}
        self._predicted_count = 0
        # The queues' oldest predictions, to drop the oldest of all past the
        # bound without a look at every pod: (expiry, the queue's place
        # among the pods, bit), one at least for each queue's current oldest
        # and stale ones (a queue's oldest since gone), skipped when met.
        self._heads: list[tuple[float, int, int]] = []
        self._places: dict[int, int] = {}  # bit -> its queue's place in _predicted
        self._added = 0
        self.evictions = 0  # confirmed hashes dropped by the capacity bound
        self.predicted_evictions = 0  # predictions dropped by theirs before their TTL
        # bit -> when a block last stopped being held there (a tick of
        # _clock): a match made since holds as far as it went (``epoch``).
        self._epochs: dict[int, int] = {}
        self._clock = 0

    # ----- pods -------------------------------------------------------------
    def add_pod(self, pod: str) -> int:
        bit = self._bits.get(pod)
        if bit is None:
            used = set(self._bits.values())
            bit = next(b for b in range(len(used) + 1) if b not in used)
            self._bits[pod] = bit
            self._held[bit] = 0
            self._predicted[bit] = OrderedDict()
            self._added += 1
            self._places[bit] = self._added
            self._lost(bit)
        return bit

    def remove_pod(self, pod: str) -> None:
        self.clear_pod(pod)
        bit = self._bits.pop(pod, None)
        if bit is not None:
            self._held.pop(bit, None)
            self._predicted_count -= len(self._predicted.pop(bit, {}))
            self._places.pop(bit, None)
            self._epochs.pop(bit, None)

    @property
    def pods(self) -> list[str]:
        return list(self._bits)

    def resize(self, capacity: int) -> None:
        """A new bound on the hashes kept; past it the least recently stored
        or matched go at once."""
        if capacity <= 0:
            raise ValueError("index capacities must be positive")
        self.capacity = capacity
        while len(self._blocks) > capacity:
            self._evict_oldest()

    def epoch(self, pod: str) -> int | None:
        """Changes whenever a block stops being held on ``pod`` (removed,
        evicted, cleared, a prediction gone that no event confirmed); None:
        no such pod. While it stays, a prefix matched there still is."""
        bit = self._bits.get(pod)
        return None if bit is None else self._epochs[bit]

    def _lost(self, bit: int) -> None:
        self._clock += 1
        self._epochs[bit] = self._clock

    def held_blocks(self, pod: str) -> int:
        return self._held.get(self._bits.get(pod, -1), 0)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def predicted_entries(self) -> int:
        return self._predicted_count

    # ----- confirmed blocks (KV events) -------------------------------------
    def stored(self, pod: str, hashes: Iterable[int]) -> None:
        bit = self.add_pod(pod)
        flag = 1 << bit
        blocks = self._blocks
        for h in hashes:
            mask = blocks.get(h)
            if mask is None:
                blocks[h] = flag
                self._held[bit] += 1
                if len(blocks) > self.capacity:
                    self._evict_oldest()
            elif mask & flag:
                key = (bit, h)
                self._extra_copies[key] = self._extra_copies.get(key, 0) + 1
                blocks.move_to_end(h)
            else:
                blocks[h] = mask | flag
                self._held[bit] += 1
                blocks.move_to_end(h)

    def removed(self, pod: str, hashes: Iterable[int]) -> None:
        bit = self._bits.get(pod)
        if bit is None:
            return
        flag = 1 << bit
        for h in hashes:
            mask = self._blocks.get(h)
            if mask is None or not mask & flag:
                continue  # evicted here already, or never seen (joined late)
            key = (bit, h)
            extra = self._extra_copies.get(key)
            if extra:
                if extra == 1:
                    del self._extra_copies[key]
                else:
                    self._extra_copies[key] = extra - 1
                continue
            self._held[bit] -= 1
            self._lost(bit)
            mask &= ~flag
            if mask:
                self._blocks[h] = mask
            else:
                del self._blocks[h]

    def clear_pod(self, pod: str) -> None:
        """The pod dropped its whole cache (AllBlocksCleared, restart, lost events)."""
        bit = self._bits.get(pod)
        if bit is None:
            return
        flag = 1 << bit
        for h in [h for h, m in self._blocks.items() if m & flag]:
            mask = self._blocks[h] & ~flag
            if mask:
                self._blocks[h] = mask
            else:
                del self._blocks[h]
        self._extra_copies = {k: v for k, v in self._extra_copies.items() if k[0] != bit}
        self._held[bit] = 0
        self._predicted_count -= len(self._predicted[bit])
        self._predicted[bit] = OrderedDict()
        self._lost(bit)

    def _evict_oldest(self) -> None:
        h, mask = self._blocks.popitem(last=False)
        self.evictions += 1
        while mask:
            low = mask & -mask
            bit = low.bit_length() - 1
            self._held[bit] -= 1
            self._extra_copies.pop((bit, h), None)
            self._lost(bit)
            mask ^= low

    # ----- predicted blocks (router's own decisions) ------------------------
    def predict(self, pod: str, hashes: Sequence[int], now: float, ttl_s: float) -> None:
        bit = self.add_pod(pod)
        expiry = now + ttl_s
        queue = self._predicted[bit]
        before = len(queue)
        oldest_before = self._oldest_expiry(queue)
        for h in hashes:
            queue[h] = expiry
            queue.move_to_end(h)
        self._predicted_count += len(queue) - before
        self._new_head(bit, oldest_before)
        while self._predicted_count > self.predicted_capacity:
            # The prediction that would expire first, of any pod (the first
            # such pod of ``_predicted`` on a tie).
            oldest = self._oldest_queue()
            queue = self._predicted[oldest]
            h, gone = queue.popitem(last=False)
            self._new_head(oldest, gone)
            self._prediction_gone(oldest, h)
            self.predicted_evictions += 1

    @staticmethod
    def _oldest_expiry(queue: OrderedDict[int, float]) -> float | None:
        return next(iter(queue.values()), None)

    def _new_head(self, bit: int, before: float | None) -> None:
        """The queue's oldest prediction may have changed from one that
        expires at ``before``: a new one goes on the heap of heads."""
        oldest = self._oldest_expiry(self._predicted[bit])
        if oldest is None or oldest == before:
            return
        if len(self._heads) > 2 * len(self._predicted) + 64:  # mostly stale: rebuild
            self._heads = [
                (e, self._places[b], b)
                for b, q in self._predicted.items()
                if (e := self._oldest_expiry(q)) is not None
            ]
            heapq.heapify(self._heads)
        else:
            heapq.heappush(self._heads, (oldest, self._places[bit], bit))

    def _oldest_queue(self) -> int:
        """The pod whose oldest prediction expires first (ties: the first
        pod in ``_predicted``'s order), of the non-empty queues."""
        heads = self._heads
        while True:
            expiry, place, bit = heads[0]
            queue = self._predicted.get(bit)
            if (
                queue is not None
                and self._places[bit] == place
                and self._oldest_expiry(queue) == expiry
            ):
                return bit
            heapq.heappop(heads)  # stale: that queue's oldest changed since

    def expire_predictions(self, now: float) -> None:
        """Drop expired predictions (oldest first; refreshes move keys to the end)."""
        for bit, queue in self._predicted.items():
            before = self._oldest_expiry(queue)
            while queue:
                h, expiry = next(iter(queue.items()))
                if expiry > now:
                    break
                queue.popitem(last=False)
                self._prediction_gone(bit, h)
            self._new_head(bit, before)

    def _prediction_gone(self, bit: int, h: int) -> None:
        self._predicted_count -= 1
        if not self._blocks.get(h, 0) & (1 << bit):  # no event confirmed it
            self._lost(bit)

    # ----- queries ----------------------------------------------------------
    def match(
        self, hashes: Sequence[int], now: float, start: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Per pod, how many leading blocks of ``hashes`` it holds (0 if none).

        ``start``: per pod, leading blocks known to be held there (a match
        of the same prefix made since the pod's ``epoch`` last changed); the
        walk there begins after them, so a prompt that extends a matched
        one costs its new blocks. Blocks walked count as recently used.
        """
        start = start or {}
        blocks = self._blocks
        n = len(hashes)
        # One walk for all pods, as bit masks: the pods still matching, less
        # those whose known prefix covers this block. A block costs the same
        # with 2 pods or 1,000 (each of which holds a common system prompt);
        # a pod costs only where it stops matching.
        alive = 0
        skipping = 0
        known: list[tuple[int, int]] = []  # (end of the known prefix, bit)
        for pod, bit in self._bits.items():
            alive |= 1 << bit
            held = min(start.get(pod, 0), n)
            if held:
                skipping |= 1 << bit
                known.append((held, bit))
        known.sort(reverse=True)
        ends: dict[int, int] = {}
        for i, h in enumerate(hashes):
            while known and known[-1][0] <= i:
                skipping &= ~(1 << known.pop()[1])
            if not alive:
                break
            checked = alive & ~skipping
            mask = blocks.get(h, 0)
            if checked & mask:
                blocks.move_to_end(h)  # matched blocks are recently used
            missing = checked & ~mask
            while missing:
                low = missing & -missing
                missing ^= low
                bit = low.bit_length() - 1
                predicted = self._predicted[bit]
                if not predicted or predicted.get(h, 0.0) <= now:
                    alive ^= low
                    ends[bit] = i
        return {pod: ends.get(bit, n) for pod, bit in self._bits.items()}


def predicted_cached_tokens(matched_blocks: int, num_tokens: int, block_size: int) -> int:
    """Tokens vLLM will report as cached: full shared blocks, never the whole prompt.

    The engine must compute at least the last prompt token, so a hit is capped
    at ``(num_tokens - 1) // block_size`` blocks.
    """
    if num_tokens <= 0:
        return 0
    return min(matched_blocks, (num_tokens - 1) // block_size) * block_size
