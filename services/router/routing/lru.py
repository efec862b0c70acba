"""The one bound every router table that grows with traffic shares.

``BoundedLru`` keeps entries least recently put first and, after each
``put``, drops the oldest while there are more than ``max_entries`` or their
weights (``weigh``) sum past ``max_weight``; the newest entry stays even
when it alone is over the weight bound, so a table never refuses the entry it
was just given. Each entry the bound drops counts in ``evictions`` (what the
``tandem_router_table_evictions_total`` metric reports) and goes through
``on_drop``, as does every entry replaced, popped or dropped by ``drop``, so
that a table can keep what it derives from its entries (reference counts,
per-pod indexes) in step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _weightless(_value: object) -> int:
    return 0


class BoundedLru(Generic[K, V]):
    def __init__(
        self,
        max_entries: int,
        max_weight: int | None = None,
        weigh: Callable[[V], int] = _weightless,
        on_drop: Callable[[K, V], None] | None = None,
    ) -> None:
        if max_entries <= 0 or (max_weight is not None and max_weight <= 0):
            raise ValueError("table bounds must be positive")
        self.max_entries = max_entries
        self.max_weight = max_weight
        self.evictions = 0
        self._weigh = weigh
        self._on_drop = on_drop
        self._weight = 0
        self._entries: OrderedDict[K, V] = OrderedDict()

    def put(self, key: K, value: V) -> None:
        """Store ``value`` as the newest entry, then enforce the bounds."""
        self.pop(key)
        self._entries[key] = value
        self._weight += self._weigh(value)
        entries = self._entries
        while len(entries) > 1 and (
            len(entries) > self.max_entries
            or (self.max_weight is not None and self._weight > self.max_weight)
        ):
            self.pop(next(iter(entries)))
            self.evictions += 1

    def replace(self, key: K, value: V) -> None:
        """Change an entry's value where it stands (no younger, bounds unchanged:
        ``value`` must weigh no more than the one it replaces)."""
        old = self._entries[key]
        self._weight += self._weigh(value) - self._weigh(old)
        self._entries[key] = value

    def pop(self, key: K) -> V | None:
        value = self._entries.pop(key, None)
        if value is not None:
            self._weight -= self._weigh(value)
            if self._on_drop is not None:
                self._on_drop(key, value)
        return value

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def oldest(self) -> tuple[K, V] | None:
        return next(iter(self._entries.items()), None)

    def items(self) -> list[tuple[K, V]]:
        """A copy, oldest first: safe to pop from while walking it."""
        return list(self._entries.items())

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    @property
    def weight(self) -> int:
        """The entries' weights, in all (what ``max_weight`` bounds)."""
        return self._weight

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
