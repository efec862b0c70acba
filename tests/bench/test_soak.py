"""The soak's analysis (bench/soak.py): growth past the warm-up is caught,
steady use within the tolerances is not; on synthetic samples (the soak
itself runs an hour on the real stack, ``make soak``, not here)."""

from __future__ import annotations

import pytest

from bench.soak import ROUTER_BOUNDS, Sample, growth, report
from services.router.config import parse_settings

MIB = 2**20


def _samples(rss_mib, fds) -> list[Sample]:
    return [Sample(float(i), int(r * MIB), f) for i, (r, f) in enumerate(zip(rss_mib, fds))]


def _grew(samples, **kw) -> dict[str, bool]:
    args = {"warmup_minutes": 2, "rss_tolerance": 0.10, "fd_tolerance": 8, **kw}
    return {g.what: g.grew for g in growth(samples, "router", **args)}


def test_warm_up_and_noise_are_not_growth():
    # Fast growth while warming up (tables filling), then flat with noise.
    rss = [100, 300, 500, 510, 495, 505, 512, 498, 507, 503, 509, 501]
    fds = [20, 40, 45, 46, 44, 45, 47, 45, 44, 46, 45, 47]
    assert _grew(_samples(rss, fds)) == {"rss": False, "fds": False}


def test_steady_growth_is_caught():
    # 2% a minute after warm-up: a leak; one fd a minute: a descriptor leak.
    rss = [500 * 1.02**i for i in range(30)]
    fds = [40 + i for i in range(30)]
    assert _grew(_samples(rss, fds)) == {"rss": True, "fds": True}


def test_the_tolerances_are_what_decides():
    rss = [500] * 6 + [540] * 6  # +8%
    fds = [40] * 6 + [47] * 6  # +7
    assert _grew(_samples(rss, fds)) == {"rss": False, "fds": False}
    assert _grew(_samples(rss, fds), rss_tolerance=0.05, fd_tolerance=5) == {
        "rss": True,
        "fds": True,
    }


def test_too_few_samples_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="need at least 4"):
        growth(_samples([1, 2, 3, 4], [1, 1, 1, 1]), "router", 2, 0.1, 8)


def test_the_table_has_a_row_per_sample():
    text = report({"router": _samples([100, 101], [10, 11]), "decode-0": _samples([900], [30])})
    lines = text.splitlines()
    assert len(lines) == 3 and "router MiB" in lines[0] and "decode-0 fds" in lines[0]
    assert "101.0" in lines[2] and "11" in lines[2]


def test_the_soak_bounds_are_valid_router_flags():
    settings = parse_settings(["--engine", "e:1", *ROUTER_BOUNDS])
    assert settings.routing.index_capacity == 2000 and settings.caches.responses_store_max == 64
