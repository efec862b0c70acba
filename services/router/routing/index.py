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

from collections import OrderedDict
from collections.abc import Iterable, Sequence


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
        self._predicted: OrderedDict[tuple[int, int], float] = OrderedDict()  # -> expiry
        self._predicted_per_bit: dict[int, int] = {}
        self.evictions = 0  # confirmed hashes dropped by the capacity bound
        self.predicted_evictions = 0  # predictions dropped by theirs before their TTL

    # ----- pods -------------------------------------------------------------
    def add_pod(self, pod: str) -> int:
        bit = self._bits.get(pod)
        if bit is None:
            used = set(self._bits.values())
            bit = next(b for b in range(len(used) + 1) if b not in used)
            self._bits[pod] = bit
            self._held[bit] = 0
            self._predicted_per_bit[bit] = 0
        return bit

    def remove_pod(self, pod: str) -> None:
        self.clear_pod(pod)
        bit = self._bits.pop(pod, None)
        if bit is not None:
            self._held.pop(bit, None)
            self._predicted_per_bit.pop(bit, None)

    @property
    def pods(self) -> list[str]:
        return list(self._bits)

    def held_blocks(self, pod: str) -> int:
        return self._held.get(self._bits.get(pod, -1), 0)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def predicted_entries(self) -> int:
        return len(self._predicted)

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
        self._predicted = OrderedDict((k, v) for k, v in self._predicted.items() if k[0] != bit)
        self._predicted_per_bit[bit] = 0

    def _evict_oldest(self) -> None:
        h, mask = self._blocks.popitem(last=False)
        self.evictions += 1
        while mask:
            low = mask & -mask
            bit = low.bit_length() - 1
            self._held[bit] -= 1
            self._extra_copies.pop((bit, h), None)
            mask ^= low

    # ----- predicted blocks (router's own decisions) ------------------------
    def predict(self, pod: str, hashes: Sequence[int], now: float, ttl_s: float) -> None:
        bit = self.add_pod(pod)
        expiry = now + ttl_s
        predicted = self._predicted
        for h in hashes:
            key = (bit, h)
            if key not in predicted:
                self._predicted_per_bit[bit] += 1
            predicted[key] = expiry
            predicted.move_to_end(key)
        while len(predicted) > self.predicted_capacity:
            (old_bit, _), _ = predicted.popitem(last=False)
            self._predicted_per_bit[old_bit] -= 1
            self.predicted_evictions += 1

    def expire_predictions(self, now: float) -> None:
        """Drop expired predictions (oldest first; refreshes move keys to the end)."""
        predicted = self._predicted
        while predicted:
            key, expiry = next(iter(predicted.items()))
            if expiry > now:
                break
            predicted.popitem(last=False)
            self._predicted_per_bit[key[0]] -= 1

    # ----- queries ----------------------------------------------------------
    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per pod, how many leading blocks of ``hashes`` it holds (0 if none)."""
        result = {pod: 0 for pod in self._bits}
        if not hashes or not self._bits:
            return result
        by_bit = {bit: pod for pod, bit in self._bits.items()}
        predicting = [b for b, n in self._predicted_per_bit.items() if n > 0]
        alive = 0
        for bit in self._bits.values():
            alive |= 1 << bit
        blocks = self._blocks
        predicted = self._predicted
        for i, h in enumerate(hashes):
            mask = blocks.get(h, 0) & alive
            for bit in predicting:
                flag = 1 << bit
                if alive & flag and not mask & flag:
                    expiry = predicted.get((bit, h))
                    if expiry is not None and expiry > now:
                        mask |= flag
            dropped = alive & ~mask
            while dropped:
                low = dropped & -dropped
                result[by_bit[low.bit_length() - 1]] = i
                dropped ^= low
            alive = mask
            if not alive:
                break
            if h in blocks:
                blocks.move_to_end(h)  # matched blocks are recently used
        else:
            while alive:
                low = alive & -alive
                result[by_bit[low.bit_length() - 1]] = len(hashes)
                alive ^= low
        return result


def predicted_cached_tokens(matched_blocks: int, num_tokens: int, block_size: int) -> int:
    """Tokens vLLM will report as cached: full shared blocks, never the whole prompt.

    The engine must compute at least the last prompt token, so a hit is capped
    at ``(num_tokens - 1) // block_size`` blocks.
    """
    if num_tokens <= 0:
        return 0
    return min(matched_blocks, (num_tokens - 1) // block_size) * block_size
