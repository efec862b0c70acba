"""bench.store_hits classifies each request by the serving engine's counters
and compares the classes (the engines themselves run in the bench)."""

from bench import store_hits
from bench.engine_client import Result


class CountingEngine:
    """Answers like an engine whose counters move by ``external``/``local``
    hit tokens across each request."""

    def __init__(
        self, external: float, local: float, seconds: float, load_get_s: float = 0.0
    ) -> None:
        self.load_get = store_hits.STORE_OP_SECONDS.format("load_get")
        self.counters = {store_hits.EXTERNAL: 100.0, store_hits.LOCAL: 50.0, self.load_get: 2.5}
        self.external, self.local, self.seconds = external, local, seconds
        self.load_get_s = load_get_s

    def metrics(self) -> dict[str, float]:
        return dict(self.counters)

    def generate(self, ids: list[int], max_tokens: int) -> Result:
        self.counters[store_hits.EXTERNAL] += self.external
        self.counters[store_hits.LOCAL] += self.local
        self.counters[self.load_get] += self.load_get_s
        return Result([1], "x", len(ids), 0, self.seconds)


def test_requests_are_classified_by_the_engines_counters():
    assert store_hits.timed(CountingEngine(896, 0, 0.4), [1, 2])["kind"] == "store"
    assert store_hits.timed(CountingEngine(0, 896, 0.2), [1, 2])["kind"] == "local"
    assert store_hits.timed(CountingEngine(0, 0, 0.9), [1, 2])["kind"] == "miss"
    # A partial local hit completed from the store counts as a store hit.
    assert store_hits.timed(CountingEngine(512, 384, 0.3), [1, 2])["kind"] == "store"


def test_the_time_in_vllms_store_calls_comes_from_the_engines_counters():
    row = store_hits.timed(CountingEngine(896, 0, 0.4, load_get_s=0.125), [1, 2])
    assert row["load_get_s"] == 0.125 and row["lookup_exists_s"] == 0.0
    s = store_hits.summarize([row, {**row, "load_get_s": 0.375}])
    assert s["store"]["load_get_p50_s"] == 0.25 and s["local"]["load_get_p50_s"] is None


def test_summary_compares_store_hits_with_local_hits_and_leaves_misses_out():
    rows = (
        [{"kind": "local", "ttft_s": t} for t in (0.2, 0.4, 0.3)]
        + [{"kind": "store", "ttft_s": t} for t in (0.33, 0.36, 0.9)]
        + [{"kind": "miss", "ttft_s": 5.0}]
    )
    s = store_hits.summarize(rows)
    assert s["local"]["n"] == s["store"]["n"] == 3 and s["misses"] == 1
    assert s["local"]["p50_s"] == 0.3 and s["store"]["p50_s"] == 0.36
    assert abs(s["store_over_local_p50"] - 1.2) < 1e-9
    assert store_hits.summarize([])["store_over_local_p50"] is None


class Tokenizer:
    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [len(w) for w in text.split()]}


def test_the_replay_keeps_each_session_on_its_engine_and_grows_its_context():
    engines = [CountingEngine(896, 0, 0.3), CountingEngine(0, 896, 0.2)]
    rows = store_hits.replay(
        engines, Tokenizer(), sessions=3, turns=2, first_tokens=40, turn_tokens=8
    )
    assert len(rows) == 3 * 2 * 2
    assert [r["kind"] for r in rows if r["session"] == 1] == ["local"] * 4  # engine 1
    assert {r["kind"] for r in rows if r["session"] != 1} == {"store"}
    grown = [r["prompt_tokens"] for r in rows if r["session"] == 0]
    assert grown == sorted(grown) and len(set(grown)) == 4
