"""The routing-policy benchmark's pieces without engines: the router command
lines it runs (kv_aware gets every engine's KV events, each router every
engine), the summary table's ratios against Tandem's default in the same
regime, and argument errors caught before any engine starts. The benchmark
itself (`python -m bench.router_policies`) starts four vLLM engines per regime:
its figures are in docs/benchmarks.md, not asserted here."""

from __future__ import annotations

import pytest

from bench import router_policies as rp
from bench import routers

ENGINES = [
    rp.HttpEngine("http://127.0.0.1:8401", "tcp://127.0.0.1:5571,tcp://127.0.0.1:5572", None),
    rp.HttpEngine("http://127.0.0.1:8402", "tcp://127.0.0.1:5581,tcp://127.0.0.1:5582", None),
]


@pytest.fixture
def fake_binaries(monkeypatch):
    monkeypatch.setattr(routers, "find_binary", lambda spec: f"/bin/{spec.binary}")


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_kv_aware_subscribes_to_every_engine(fake_binaries):
    argv = rp.contender_argv(
        rp.Contender("vllm-router", "kv_aware", kv_events=True),
        8500,
        ENGINES,
        "/models/smol",
        block_size=128,
    )
    assert argv[0] == "/bin/vllm-router"
    assert _after(argv, "--policy") == ["kv_aware"]
    assert _after(argv, "--kv-event-source") == [
        "http://127.0.0.1:8401=tcp://127.0.0.1:5571",
        "http://127.0.0.1:8402=tcp://127.0.0.1:5581",
    ]
    assert _after(argv, "--kv-event-replay-source") == [
        "http://127.0.0.1:8401=tcp://127.0.0.1:5572",
        "http://127.0.0.1:8402=tcp://127.0.0.1:5582",
    ]
    assert _after(argv, "--kv-event-block-size") == ["128"]
    assert "--kv-aware-session-affinity-ttl-secs" in argv


def test_other_policies_get_every_worker_and_no_events(fake_binaries):
    for c in (
        rp.Contender("vllm-router", "consistent_hash"),
        rp.Contender("sglang-router", "cache_aware"),
    ):
        argv = rp.contender_argv(c, 8500, ENGINES, "/models/smol", block_size=128)
        i = argv.index("--worker-urls")
        assert argv[i + 1 : i + 3] == [e.url for e in ENGINES]
        assert _after(argv, "--policy") == [c.policy]
        assert "--kv-event-source" not in argv
    assert argv[:2] == ["/bin/sglang-router", "launch"]


def _run(label: str, regime: str, ttft_p50: float, hit: float) -> dict:
    records = [
        {"agent": "", "ok": True, "prompt_tokens": 100, "cached_tokens": 100 * hit},
        {"agent": "sa1", "ok": True, "prompt_tokens": 100, "cached_tokens": 50},
    ]
    return {
        "label": label,
        "regime": regime,
        "records": records,
        "summary": {
            "hit_rate": hit,
            "ttft_p50": ttft_p50,
            "ttft_p90": 2 * ttft_p50,
            "output_tokens_per_s": 10.0,
            "total_tokens_per_s": 500.0,
            "failures": 0,
        },
    }


def test_summary_ratios_are_against_tandem_default_in_the_same_regime():
    runs = [
        _run("tandem:cost", "ample", 1.0, 0.8),
        _run("vllm-router:kv_aware", "ample", 1.5, 0.8),
        _run("tandem:cost", "tight", 2.0, 0.6),
        _run("vllm-router:kv_aware", "tight", 5.0, 0.4),
    ]
    rows = {
        tuple(c.strip() for c in line.split("|")[1:3]): line
        for line in rp.summary_table(runs, 0.86).splitlines()
        if line.startswith("| ")
    }
    assert "| 1.50× | 1.50× |" in rows[("ample", "vllm-router:kv_aware")]
    assert "| 2.50× | 2.50× |" in rows[("tight", "vllm-router:kv_aware")]
    assert "| 40.0% |" in rows[("tight", "vllm-router:kv_aware")]
    assert "| 1.00× | 1.00× |" in rows[("tight", "tandem:cost")]


def test_repeated_runs_are_averaged_with_their_hit_range():
    runs = [
        _run("tandem:cost", "tight", 2.0, 0.7),
        _run("vllm-router:kv_aware", "tight", 4.0, 0.6),
        _run("tandem:cost", "tight", 4.0, 0.8),
        _run("vllm-router:kv_aware", "tight", 2.0, 0.8),
    ]
    (line,) = [
        row for row in rp.summary_table(runs, None).splitlines() if "vllm-router:kv_aware" in row
    ]
    cells = [c.strip() for c in line.split("|")[1:-1]]
    # runs, mean hit, range, mean TTFT p50 / p90, and ratios of the means
    assert cells[2:8] == ["2", "70.0%", "60.0%–80.0%", "70.0%", "50.0%", "3.00"]
    assert cells[-2:] == ["1.00×", "1.00×"]
    assert rp.run_dir(rp.Path("/o"), "tight", 1, 3) == rp.Path("/o/tight/run2")
    assert rp.run_dir(rp.Path("/o"), "tight", 0, 1) == rp.Path("/o/tight")


def test_unknown_contender_fails_before_any_engine_starts(capsys):
    assert rp.main(["--contenders", "tandem:cost,vllm-router:magic"]) == 2
    assert "vllm-router:magic" in capsys.readouterr().err


def test_tandem_variant_carries_router_flags():
    known = {c.name: c for c in rp.CONTENDERS}
    v = rp.parse_variant("tandem:cost+move-cost-factor=1.0+eviction-cost-factor=0", known)
    assert v.flags == ("--move-cost-factor", "1.0", "--eviction-cost-factor", "0")
    assert v.name == "tandem:cost+move-cost-factor=1.0+eviction-cost-factor=0"
    assert rp.parse_variant("vllm-router:cache_aware+x=1", known) is None  # Tandem only
    assert rp.parse_variant("tandem:cost+move-cost-factor", known) is None  # no value


def test_router_accepts_the_move_cost_factor():
    from services.router.config import parse_settings

    settings = parse_settings(["--engine", "127.0.0.1:1", "--move-cost-factor", "1.0"])
    assert settings.routing.policy.move_cost_factor == 1.0
