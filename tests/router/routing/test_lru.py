"""The bound every growing router table shares (services/router/routing/lru.py)."""

import pytest

from services.router.routing.lru import BoundedLru


def test_count_bound_drops_least_recently_put():
    dropped = []
    lru = BoundedLru(2, on_drop=lambda k, v: dropped.append(k))
    lru.put("a", 1)
    lru.put("b", 2)
    lru.put("a", 3)  # a is now the newest: b goes next
    lru.put("c", 4)
    assert list(lru) == ["a", "c"]
    assert dropped == ["a", "b"]  # the replaced value, then the evicted one
    assert lru.evictions == 1


def test_weight_bound_keeps_the_newest_even_alone():
    lru = BoundedLru(10, max_weight=5, weigh=len)
    lru.put("a", "xx")
    lru.put("b", "xxx")
    assert lru.weight == 5 and len(lru) == 2
    lru.put("c", "xxxxxxxx")  # over the bound alone: stays, the rest go
    assert list(lru) == ["c"] and lru.weight == 8 and lru.evictions == 2


def test_pop_and_replace_keep_weight_and_order():
    lru = BoundedLru(3, max_weight=100, weigh=len)
    for key in "abc":
        lru.put(key, key * 3)
    lru.replace("a", "z")
    assert list(lru) == ["a", "b", "c"] and lru.weight == 7
    assert lru.pop("b") == "bbb" and lru.pop("b") is None
    assert lru.weight == 4 and lru.oldest() == ("a", "z") and lru.evictions == 0


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        BoundedLru(0)
    with pytest.raises(ValueError):
        BoundedLru(1, max_weight=0)
