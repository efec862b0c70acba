"""Prefix index: per-pod block sets, copies, predictions, LRU bound. No servers, no mocks."""

import time

import psutil
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.routing.index import PrefixIndex, predicted_cached_tokens


def test_longest_prefix_per_pod():
    idx = PrefixIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 2])
    idx.stored("c", [2, 3])  # no first block: no prefix at all
    assert idx.match([1, 2, 3, 4], now=0) == {"a": 3, "b": 2, "c": 0}
    assert idx.match([9], now=0) == {"a": 0, "b": 0, "c": 0}
    assert idx.match([1, 2, 3], now=0)["a"] == 3


def test_copies_are_counted_per_pod():
    idx = PrefixIndex()
    idx.stored("a", [1, 2])
    idx.stored("a", [2])  # recomputed duplicate of a cached block
    idx.removed("a", [2])  # one physical copy gone, the other stays
    assert idx.match([1, 2], 0)["a"] == 2
    idx.removed("a", [2])
    assert idx.match([1, 2], 0)["a"] == 1
    assert idx.held_blocks("a") == 1


def test_all_blocks_cleared_only_touches_that_pod():
    idx = PrefixIndex()
    idx.stored("a", [1, 2])
    idx.stored("b", [1, 2])
    idx.clear_pod("a")
    assert idx.match([1, 2], 0) == {"a": 0, "b": 2}
    assert len(idx) == 2


def test_cached_token_cap_never_whole_prompt():
    assert predicted_cached_tokens(4, 4 * 128, 128) == 3 * 128  # last token is computed
    assert predicted_cached_tokens(4, 4 * 128 + 1, 128) == 4 * 128
    assert predicted_cached_tokens(2, 1000, 128) == 256
    assert predicted_cached_tokens(0, 0, 128) == 0


def test_predictions_expire():
    idx = PrefixIndex()
    idx.predict("quiet", [1, 2], now=100.0, ttl_s=10.0)
    assert idx.match([1, 2, 3], now=105.0)["quiet"] == 2
    assert idx.match([1, 2, 3], now=111.0)["quiet"] == 0
    idx.expire_predictions(111.0)
    assert idx.predicted_entries == 0


def test_prediction_and_events_combine():
    idx = PrefixIndex()
    idx.stored("a", [1])
    idx.predict("a", [1, 2], now=0, ttl_s=5)
    assert idx.match([1, 2, 3], now=1)["a"] == 2
    assert idx.match([1, 2, 3], now=6)["a"] == 1  # the prediction expired, the event stays


def test_lru_bound_keeps_recently_used():
    idx = PrefixIndex(capacity=3)
    idx.stored("a", [1, 2, 3])
    idx.match([1], now=0)  # touch 1
    idx.stored("a", [4])  # evicts 2, the least recently used
    assert len(idx) == 3
    assert idx.match([1, 2], 0)["a"] == 1
    assert idx.held_blocks("a") == 3
    assert idx.evictions == 1


def test_million_blocks_stay_within_cap_and_memory():
    """1.2 x 10^6 distinct blocks on four pods with cap 10^6: size and memory stay bounded."""
    cap = 1_000_000
    proc = psutil.Process()
    base = proc.memory_info().rss
    idx = PrefixIndex(capacity=cap)
    pods = ["p0", "p1", "p2", "p3"]
    t0 = time.perf_counter()
    for start in range(0, cap + 200_000, 10_000):
        # 64-bit hashes like events carry
        chunk = [(h * 0x9E3779B97F4A7C15) & (2**64 - 1) for h in range(start, start + 10_000)]
        idx.stored(pods[(start // 10_000) % 4], chunk)
    elapsed = time.perf_counter() - t0
    used = proc.memory_info().rss - base  # resident growth: the index and its ints
    assert len(idx) == cap
    assert sum(idx.held_blocks(p) for p in pods) == cap
    assert idx.evictions == 200_000
    per_block = used / cap
    print(
        f"\nindex: {cap} blocks held, {used / 2**20:.1f} MiB "
        f"({per_block:.0f} B/block resident), 1.2e6 stores in {elapsed:.1f} s"
    )
    assert per_block < 300, per_block  # measured: 186 B/block traced, ~230 resident


def test_predictions_beyond_their_bound_are_dropped_and_counted():
    idx = PrefixIndex(capacity=10, predicted_capacity=3)
    idx.predict("a", [1, 2], now=0, ttl_s=60)
    idx.predict("b", [1, 2], now=0, ttl_s=60)  # 4 entries: a's block 1 goes
    assert idx.predicted_entries == 3 and idx.predicted_evictions == 1
    assert idx.match([1, 2], now=1) == {"a": 0, "b": 2}
    idx.expire_predictions(now=61)  # expiry is not an eviction
    assert idx.predicted_entries == 0 and idx.predicted_evictions == 1


_op = st.tuples(
    st.sampled_from(["stored", "removed", "predict", "expire", "clear"]),
    st.sampled_from(["a", "b"]),
    st.lists(st.integers(0, 9), max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(
    first=st.lists(st.integers(0, 9), max_size=10),
    second=st.lists(st.integers(0, 9), max_size=10),
    before=st.lists(_op, max_size=6),
    between=st.lists(_op, max_size=6),
)
def test_a_match_resumed_where_no_block_was_lost_equals_a_full_one(first, second, before, between):
    """Resuming a pod's walk after the blocks a previous match found there
    (the prefix both prompts share) gives the full walk's answer, whatever
    was stored, removed, predicted or expired in between, as long as the
    pod's epoch did not change."""
    index = PrefixIndex(capacity=12, predicted_capacity=6)  # evictions happen too
    now = [0.0]

    def apply(ops):
        for kind, pod, hashes in ops:
            now[0] += 1.0
            if kind == "stored":
                index.stored(pod, hashes)
            elif kind == "removed":
                index.removed(pod, hashes)
            elif kind == "predict":
                index.predict(pod, hashes, now[0], ttl_s=2.0 if pod == "a" else 5.0)
            elif kind == "expire":
                index.expire_predictions(now[0])
            else:
                index.clear_pod(pod)

    index.add_pod("a"), index.add_pod("b")
    apply(before)
    index.expire_predictions(now[0])
    old = first
    held = index.match(old, now[0])
    epochs = {pod: index.epoch(pod) for pod in held}
    apply(between)
    index.expire_predictions(now[0])
    new = old[: len(old) // 2] + second  # shares a prefix with the old prompt
    shared = next((i for i, (x, y) in enumerate(zip(old, new)) if x != y), min(len(old), len(new)))
    start = {pod: min(n, shared) for pod, n in held.items() if index.epoch(pod) == epochs[pod]}
    assert index.match(new, now[0], start) == index.match(new, now[0])


def _walk_each_pod(index, hashes, now, start):
    """The match pod by pod: each pod's walk from its known prefix while
    its blocks are stored there or predicted and not expired."""
    out = {}
    for pod, bit in index._bits.items():
        i = min(start.get(pod, 0), len(hashes))
        while i < len(hashes):
            h = hashes[i]
            stored = index._blocks.get(h, 0) & (1 << bit)
            if not stored and index._predicted[bit].get(h, 0.0) <= now:
                break
            i += 1
        out[pod] = i
    return out


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["stored", "removed", "predict", "expire"]),
            st.sampled_from("abcdefgh"),
            st.lists(st.integers(0, 9), max_size=8),
        ),
        max_size=20,
    ),
    prompt=st.lists(st.integers(0, 9), max_size=12),
    starts=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 14)),
)
def test_one_walk_for_all_pods_matches_each_pods_own_walk(ops, prompt, starts):
    index = PrefixIndex(capacity=30, predicted_capacity=20)
    for pod in "abcdefgh":
        index.add_pod(pod)
    now = 0.0
    for kind, pod, hashes in ops:
        now += 1.0
        if kind == "stored":
            index.stored(pod, hashes)
        elif kind == "removed":
            index.removed(pod, hashes)
        elif kind == "predict":
            index.predict(pod, hashes, now, ttl_s=3.0)
        else:
            index.expire_predictions(now)
    assert index.match(prompt, now, starts) == _walk_each_pod(index, prompt, now, starts)


class _PredictionsByScan:
    """Predicted entries as the bound dropped them by looking at every pod:
    the pod whose oldest prediction expires first, the first such pod on a
    tie (pods in the order they were added)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.queues = {}  # pod -> {hash: expiry}, oldest first
        self.evictions = 0

    def predict(self, pod, hashes, now, ttl_s):
        queue = self.queues.setdefault(pod, {})
        for h in hashes:
            queue.pop(h, None)
            queue[h] = now + ttl_s
        while sum(len(q) for q in self.queues.values()) > self.capacity:
            oldest = min(
                (p for p, q in self.queues.items() if q),
                key=lambda p: [*self.queues[p].values()][0],
            )
            del self.queues[oldest][next(iter(self.queues[oldest]))]
            self.evictions += 1

    def expire(self, now):
        for queue in self.queues.values():
            for h in [h for h, expiry in queue.items() if expiry <= now]:
                del queue[h]


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["predict", "predict", "predict", "expire", "clear", "remove"]),
            st.sampled_from("abcd"),
            st.lists(st.integers(0, 9), max_size=6),
            st.sampled_from([1.0, 2.0, 5.0]),  # a pod's TTL (with events or without)
        ),
        max_size=40,
    )
)
def test_predictions_past_their_bound_go_oldest_first_as_a_scan_of_every_pod_finds(ops):
    index = PrefixIndex(capacity=100, predicted_capacity=7)
    scan = _PredictionsByScan(7)
    ttl = {}
    now = 0.0
    for kind, pod, hashes, pod_ttl in ops:
        now += 0.5
        if kind == "predict":
            ttl.setdefault(pod, pod_ttl)  # one TTL a pod, as the core sets it
            index.predict(pod, hashes, now, ttl[pod])
            scan.predict(pod, hashes, now, ttl[pod])
        elif kind == "expire":
            index.expire_predictions(now)
            scan.expire(now)
        elif kind == "clear":
            index.clear_pod(pod)
            scan.queues.get(pod, {}).clear()
        else:
            index.remove_pod(pod)
            scan.queues.pop(pod, None)
        held = {p: list(index._predicted[index._bits[p]].items()) for p in index.pods}
        assert held == {p: list(q.items()) for p, q in scan.queues.items()}
        assert index.predicted_evictions == scan.evictions


def test_past_the_bound_the_oldest_prediction_left_after_an_expiry_goes_first():
    idx = PrefixIndex(capacity=10, predicted_capacity=4)
    idx.predict("a", [1], now=0, ttl_s=10)
    idx.predict("a", [2], now=1, ttl_s=10)
    idx.predict("b", [3], now=2, ttl_s=10)
    idx.expire_predictions(now=10.5)  # a's 1 expires; a's oldest is now 2
    idx.predict("b", [4, 5, 6], now=10.5, ttl_s=10)  # 5 entries: a's 2 (until 11) goes
    assert idx.match([2], now=10.6) == {"a": 0, "b": 0}
    assert idx.match([3], now=10.6) == {"a": 0, "b": 1}
    assert idx.predicted_evictions == 1
