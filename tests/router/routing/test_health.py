"""Circuit breaker state machine, time passed in. No servers."""

from services.router.routing.health import BreakerSettings, CircuitState, PodHealth


def test_ejects_after_threshold_and_recovers_on_probe():
    h = PodHealth(BreakerSettings(failure_threshold=2, open_s=5, max_open_s=20))
    assert h.allows_traffic("a", 0)
    assert not h.record_failure("a", 0)
    assert h.record_failure("a", 1)  # second consecutive failure ejects
    assert not h.allows_traffic("a", 2)
    assert not h.breaker("a").probe_due(3)
    assert h.breaker("a").probe_due(6.5)
    assert h.breaker("a").state is CircuitState.HALF_OPEN
    h.record_success("a", 7)
    assert h.allows_traffic("a", 7)


def test_failed_probe_backs_off_exponentially():
    h = PodHealth(BreakerSettings(failure_threshold=1, open_s=5, max_open_s=12))
    h.record_failure("a", 0)
    assert h.breaker("a").open_until == 5
    assert h.breaker("a").probe_due(5)
    assert h.record_failure("a", 5)  # the probe failed
    assert h.breaker("a").open_until == 15
    h.breaker("a").probe_due(15)
    h.record_failure("a", 15)
    assert h.breaker("a").open_until == 27  # capped at max_open_s
    assert h.breaker("a").ejections == 3


def test_success_resets_the_count():
    h = PodHealth(BreakerSettings(failure_threshold=3))
    h.record_failure("a", 0)
    h.record_failure("a", 0)
    h.record_success("a", 0)
    h.record_failure("a", 0)
    assert h.allows_traffic("a", 0)
