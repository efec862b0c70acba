"""bench.step_costs' fit: the step model's terms recovered from points
priced by a known model, and no term negative."""

from __future__ import annotations

import numpy as np
import pytest

from bench.step_costs import fit, nonnegative_lstsq
from sim.costs import StepModel

TRUE = StepModel(step_s=0.06, token_s=2.6e-3, token_ctx_s=8e-7, seq_s=6e-4, seq_ctx_s=6e-6)


def points() -> tuple[list[dict], list[dict]]:
    prefill = [
        {"prefix": p, "tail": t, "seconds": TRUE.prefill_s(t, p) + 0.01}
        for p in (0, 512, 1536, 2560)
        for t in (128, 256, 512, 1024)
    ]
    decode = [
        {"batch": b, "context": c, "itl_s": TRUE.step([], b, b * c)}
        for b in (1, 2, 4, 8)
        for c in (256, 2048)
    ]
    return prefill, decode


def test_fit_recovers_the_model_that_priced_the_points():
    prefill, decode = points()
    model = fit(prefill, decode)
    for name in ("step_s", "token_s", "token_ctx_s", "seq_s", "seq_ctx_s"):
        assert model[name] == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert model["prefill_fixed_s"] == pytest.approx(0.01, rel=1e-6)
    assert all(p["fitted_s"] == pytest.approx(p["seconds"]) for p in prefill)


def test_no_term_comes_out_negative():
    # Points that an unconstrained fit would give a negative intercept.
    a = np.array([[1.0, x] for x in (1.0, 2.0, 3.0)])
    y = np.array([0.5, 1.6, 2.7])
    assert np.linalg.lstsq(a, y, rcond=None)[0][0] < 0
    coef = nonnegative_lstsq(a, y)
    assert coef[0] == 0.0 and coef[1] > 0
