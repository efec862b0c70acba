"""bench.remote_prefill_scope's pure parts: the router's local prefills, the
rows (sub-agents apart from main agents) and the on/off table."""

from __future__ import annotations

from bench.remote_prefill_scope import local_prefills, summarize, tables

ROUTER_TEXT = """\
# TYPE tandem_router_local_prefill counter
tandem_router_local_prefill_total{reason="short_uncached"} 12.0
tandem_router_local_prefill_total{reason="prefill_unavailable"} 1.0
"""


def record(ttft: float, agent: str = "", ok: bool = True) -> dict:
    return {
        "ok": ok,
        "ttft": ttft,
        "agent": agent,
        "session": "s",
        "turn": 0,
        "prompt_tokens": 100,
        "expected_prompt_tokens": 100,
        "cached_tokens": 50,
        "output_tokens": 10,
        "e2e": ttft + 1.0,
        "itl": [0.1] * 9,
        "error": None if ok else "boom",
    }


def run(records: list[dict], local: dict) -> dict:
    return {"records": records, "summary": {"duration_s": 10.0}, "local_prefills": local}


def test_local_prefills_by_reason():
    assert local_prefills(ROUTER_TEXT) == {"short_uncached": 12, "prefill_unavailable": 1}
    assert local_prefills("") == {}


def test_rows_split_sub_agents_from_main_agents_and_the_table_has_ratios():
    off = summarize(
        "off", [run([record(1.0), record(8.0, "sa0"), record(9.0, "sa1")], {"short_uncached": 2})]
    )
    on = summarize(
        "on", [run([record(1.0), record(2.0, "sa0"), record(3.0, "sa1")], {"short_uncached": 1})]
    )
    assert (off["requests"], off["failures"], off["fork_requests"]) == (3, 0, 2)
    assert off["main_ttft_p90"] == 1.0 and on["fork_ttft_p50"] < off["fork_ttft_p50"]
    text = "\n".join(tables([off, on]))
    assert "| off (request) | 3 (0 failed)" in text and "| on (pod) |" in text
    assert "on / off:" in text and "fork_ttft_p50 0.29×" in text
    assert "* on: [{'short_uncached': 1}]" in text
