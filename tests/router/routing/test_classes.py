"""Request classes: long fresh prefills vs append turns, each to its own
prefill pool when configured. Pure decisions; no servers."""

import argparse

import pytest

from common.roles import Role
from common.settings import SettingError
from services.router.routing.classes import ClassPool, classify, parse_class_pool, pods_for_class
from services.router.routing.policy import PodView, Policy, PolicySettings, RouteInput


def test_classify_by_the_best_pods_uncached_remainder():
    assert classify(5000, [0, 0], long_tokens=1024) == "long"
    assert classify(5000, [4096, 0], long_tokens=1024) == "append"  # 904 uncached on the best
    assert classify(5000, [3976], long_tokens=1024) == "long"  # exactly the threshold
    assert classify(100, [], long_tokens=1024) == "append"  # short, nothing cached anywhere


def test_class_pool_flag_syntax():
    assert parse_class_pool(" long = fresh ") == ClassPool("long", "fresh")
    assert str(ClassPool("append", "warm")) == "append=warm"  # round-trips as a flag
    for bad in ("long", "long=", "first=fresh", "=fresh"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_class_pool(bad)


def test_pods_for_class_own_pool_else_unreserved_pools():
    pods = [PodView("p1", pool="fresh"), PodView("p2", pool="warm"), PodView("p3")]
    names = lambda ps: [p.name for p in ps]  # noqa: E731
    assert names(pods_for_class(pods, "long", ())) == ["p1", "p2", "p3"]
    only_long = (ClassPool("long", "fresh"),)
    assert names(pods_for_class(pods, "long", only_long)) == ["p1"]
    assert names(pods_for_class(pods, "append", only_long)) == ["p2", "p3"]
    both = (ClassPool("long", "fresh"), ClassPool("append", "warm"))
    assert names(pods_for_class(pods, "append", both)) == ["p2"]


def _pd_pods(**prefill_overrides):
    return [
        PodView("fresh-1", Role.PREFILL, pool="fresh", **prefill_overrides),
        PodView("warm-1", Role.PREFILL, pool="warm"),
        PodView("d", Role.DECODE),
    ]


def _policy(**kw):
    return Policy(
        PolicySettings(
            remote_prefill_threshold=256,
            long_request_tokens=1024,
            prefill_pool_for=(ClassPool("long", "fresh"),),
            **kw,
        )
    )


def test_long_request_goes_to_its_pool_even_when_that_pool_is_busier():
    views = _pd_pods(pending_prefill_tokens=50_000, in_flight=5)
    c = _policy().choose(RouteInput(4000, views, "s"))
    assert (c.request_class, c.prefill_pod, c.pod) == ("long", "fresh-1", "d")


def test_append_turn_stays_off_the_long_pool():
    # The session's context is cached on the decode pod and on the long pool's
    # pod; 600 tokens remain: an append turn, prefilled remotely on the other pool.
    views = [
        PodView("fresh-1", Role.PREFILL, pool="fresh", cached_tokens=3400),
        PodView("warm-1", Role.PREFILL, pool="warm"),
        PodView("d", Role.DECODE, cached_tokens=3400),
    ]
    c = _policy().choose(RouteInput(4000, views, "s"))
    assert (c.request_class, c.prefill_pod) == ("append", "warm-1")


def test_short_remainder_still_prefills_on_the_decode_pod():
    views = [
        PodView("fresh-1", Role.PREFILL, pool="fresh"),
        PodView("warm-1", Role.PREFILL, pool="warm"),
        PodView("d", Role.DECODE, cached_tokens=3900),
    ]
    c = _policy().choose(RouteInput(4000, views, "s"))
    assert (c.request_class, c.prefill_pod, c.local_prefill) == ("append", None, "short_uncached")


def test_class_pool_down_means_local_prefill_not_the_other_pool():
    views = _pd_pods(available=False)
    c = _policy().choose(RouteInput(4000, views, "s"))
    assert (c.request_class, c.prefill_pod, c.local_prefill) == (
        "long",
        None,
        "class_pool_unavailable",
    )
    assert c.reason.endswith("+local-prefill:class-pool-unavailable")


def test_without_assignments_classes_change_nothing():
    views = _pd_pods(pending_prefill_tokens=50_000, in_flight=5)
    plain = Policy(PolicySettings(remote_prefill_threshold=256))
    c = plain.choose(RouteInput(4000, views, "s"))
    assert (c.request_class, c.prefill_pod) == ("long", "warm-1")  # the least loaded


def test_aggregated_pods_get_a_class_too():
    c = Policy(PolicySettings()).choose(RouteInput(4000, [PodView("a", cached_tokens=3500)]))
    assert (c.request_class, c.pod) == ("append", "a")


def test_class_settings_are_validated():
    with pytest.raises(SettingError, match="--long-request-tokens"):
        PolicySettings(long_request_tokens=0).validate()
    with pytest.raises(SettingError, match="--prefill-pool-for"):
        PolicySettings(prefill_pool_for=(ClassPool("long", "a"), ClassPool("long", "b"))).validate()
