"""The simulator against the real stack's recorded runs (sim/measured.json):
every recorded run simulated with the shipped profiles, held to the issue's
bounds — prefix hit rate within 3 points, TTFT p50/p90 within 25% — and to
the measured order of the policies. No engines: the measurements are
recorded, the simulation is rerun (about a second)."""

from __future__ import annotations

import itertools
import json

import pytest

from sim import validation
from sim.cli import main as sim_main
from sim.cluster import Traffic
from sim.defaults import CPU_STEP_MODEL, fitted_model, load_step_model

# Outside the bounds today, each with how far it may be (sim/README.md,
# "Validation"), on the runs that had the machine to themselves, each
# simulated with its own first visible tokens and vLLM's asynchronous
# scheduling: the cost policy's TTFT p90 at 16 sessions with the store, put
# longer than its four runs (16.4-20.3 s): the model prices the runs' opening
# burst of cold prompts about 1.35x what they took.
KNOWN_OUTSIDE = {
    ("16 sessions, 50 blocks, store", "cost", "p90"): 0.4,
}
# Hit rates outside the 3 points, with how far they may be: none today.
KNOWN_HIT_OUTSIDE: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def compared():
    measured = validation.load_measured()
    return validation.compare(measured, validation.engines_model(), validation.STORE_BLOCKS)


def test_hit_rates_within_three_points(compared):
    for c in compared:
        bound = KNOWN_HIT_OUTSIDE.get((c.measured.regime, c.measured.label), validation.HIT_POINTS)
        assert abs(c.hit_off_points) <= bound, (c.measured, c.hit_rate)


def test_ttft_within_a_quarter(compared):
    for c in compared:
        for which, ratio in (("p50", c.p50_ratio), ("p90", c.p90_ratio)):
            if ratio is None:
                continue
            bound = KNOWN_OUTSIDE.get((c.measured.regime, c.measured.label, which))
            assert abs(ratio - 1.0) <= (bound or validation.TTFT_RATIO), (c.measured, which, ratio)


def test_policies_keep_their_measured_order(compared):
    # TTFT p90: every two policies of a regime whose runs do not overlap.
    for regime, ranking in validation.rankings(compared).items():
        assert not ranking.misordered, (regime, ranking)
    # Hit rates: every two runs of a regime that the measurement tells apart
    # (more than the bound between them) in the same order in simulation.
    for a, b in itertools.combinations(compared, 2):
        if a.measured.regime != b.measured.regime:
            continue
        gap = 100 * (a.measured.hit_rate - b.measured.hit_rate)
        if abs(gap) > validation.HIT_POINTS:
            assert (a.hit_rate - b.hit_rate) * gap > 0, (a.measured, b.measured)


def test_an_order_is_held_only_where_the_runs_tell_the_policies_apart():
    def row(policy, p90_range, simulated_p90):
        m = validation.Measured(
            16,
            16,
            50,
            True,
            policy,
            153,
            0.86,
            7.0,
            sum(p90_range) / 2,
            "run",
            runs=2,
            p90_range=p90_range,
        )
        return validation.Compared(m, 0.86, 7.0, simulated_p90)

    overlapping = [row("cost", (16.6, 19.2), 25.0), row("round-robin", (17.9, 25.9), 21.5)]
    (ranking,) = validation.rankings(overlapping).values()
    assert ranking.measured == ["cost", "round-robin"]
    assert ranking.simulated == ["round-robin", "cost"]
    assert ranking.misordered == []
    assert "different only where the runs' p90 ranges overlap" in validation.table(overlapping)
    apart = [row("cost", (16.6, 17.0), 25.0), row("round-robin", (17.9, 25.9), 21.5)]
    (ranking,) = validation.rankings(apart).values()
    assert ranking.misordered == [("cost", "round-robin")]
    assert "DIFFERENT: cost < round-robin in every run" in validation.table(apart)


def test_calibration_finds_the_profiles_speed_on_the_runs_they_match():
    """On the quiet machine's runs the engines ran at the profiles' speed:
    calibration keeps it (1×) rather than trading one side against the other."""
    quiet = [m for m in validation.load_measured() if m.sessions == 4 and m.kv_blocks == 25]
    factors = (0.5, 1.0, 2.0)
    assert validation.calibrate(quiet, fitted_model(), 0, factors) == (1.0, 1.0)


def test_cli_validate_prints_the_table(capsys):
    assert sim_main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "| 4 sessions, 25 blocks | cost |" in out
    with pytest.raises(SystemExit):
        sim_main(["validate", "--calibrate-on", "ten"])


# Hit rates of the 6-16-session regimes within 3 points, per step model, today
# (sim/README.md, "Validation").
HITS_WITHIN = {"default": 11, "hand-written": 10, "term by term": 10}


def test_each_step_model_keeps_its_hit_rates_within_the_bound(compared):
    """The three step models' hit rates of the pressure, hard and extreme
    regimes within 3 points (the figure the runs repeat to a point or so):
    none falls below today's count."""

    def hits_within(rows: list[validation.Compared]) -> int:
        return sum(
            abs(c.hit_off_points) <= validation.HIT_POINTS for c in rows if c.measured.sessions >= 6
        )

    shipped, steps = (
        validation.compare(validation.load_measured(), model, validation.STORE_BLOCKS)
        for model in (fitted_model(), load_step_model(CPU_STEP_MODEL))
    )
    counts = {
        "default": hits_within(compared),
        "hand-written": hits_within(shipped),
        "term by term": hits_within(steps),
    }
    assert all(counts[m] >= n for m, n in HITS_WITHIN.items()), counts


def test_runs_of_a_regime_are_pooled_and_excluded_runs_left_out(tmp_path):
    base = {
        "sessions": 6,
        "concurrency": 6,
        "kv_blocks": 64,
        "store": False,
        "requests": 59,
        "source": "run",
    }
    rows = [
        {**base, "policy": "cost", "hit_rate": 0.85, "ttft_p50_s": 1.0, "ttft_p90_s": 5.0},
        {**base, "policy": "cost", "hit_rate": 0.86, "ttft_p50_s": 2.0, "ttft_p90_s": 9.0},
        {**base, "policy": "round-robin", "hit_rate": 0.77, "ttft_p50_s": 2.0, "ttft_p90_s": 11.0},
        {**base, "policy": "cost", "hit_rate": 0.5, "ttft_p50_s": 9.0, "ttft_p90_s": 99.0}
        | {"excluded": "load average 70"},
    ]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(rows))
    cost, rr = validation.pooled(validation.load_measured(path))
    assert (cost.runs, rr.runs) == (2, 1)
    assert cost.hit_rate == pytest.approx(0.855)
    assert (cost.ttft_p50_s, cost.ttft_p90_s) == (1.5, 7.0)
    assert cost.p90_range == (5.0, 9.0) and rr.p90_range == (11.0, 11.0)
    assert cost.source == "run | run"
    rows.append({**base, "policy": "cost", "requests": 60, "hit_rate": 0.8} | {"ttft_p50_s": 1.0})
    path.write_text(json.dumps([r | {"ttft_p90_s": 1.0} for r in rows]))
    with pytest.raises(ValueError, match="different traces"):
        validation.pooled(validation.load_measured(path))


def test_each_run_of_a_pool_is_simulated_with_its_own_first_visible_tokens(tmp_path):
    """Runs of one regime differ in content (each its salt), so in which of
    their requests' first tokens show text: each is simulated with its own
    indices and the pool's simulated figures are their mean."""
    sessions = Traffic(sessions=6, turns_median=4).generate()

    def indices(k):
        return {s.id: [k for _ in s.iter_requests()] for s in sessions}

    base = {
        "sessions": 6,
        "concurrency": 6,
        "kv_blocks": 64,
        "store": False,
        "policy": "cost",
        "requests": 59,
        "hit_rate": 0.85,
        "ttft_p50_s": 1.0,
        "ttft_p90_s": 5.0,
        "source": "run",
    }
    path = tmp_path / "measured.json"
    model = validation.engines_model()

    def simulated(*ks):
        rows = [base | {"salt": str(k), "first_visible": indices(k)} for k in ks]
        path.write_text(json.dumps(rows))
        (c,) = validation.compare(validation.load_measured(path), model, 0)
        return c

    first, third, both = simulated(0), simulated(2), simulated(0, 2)
    assert third.ttft_p50_s > first.ttft_p50_s
    assert both.ttft_p50_s == pytest.approx((first.ttft_p50_s + third.ttft_p50_s) / 2)
    assert both.measured.runs == 2
