"""Where the router's engine pods come from.

A ``PodSource`` names the pods there are at start (``initial``) and then
keeps the pool's pod set current (``watch``) through ``PodPool.add_pod``,
``remove_pod`` and ``set_draining``: a source that watches a cluster marks a
terminating pod draining (its streams finish, it gets no new requests) and
removes it once it is gone. ``StaticPods`` is the list from the command line
(``--prefill``, ``--decode``, ``--engine``, ``--kv-events``), fixed for the
router's lifetime.
"""

from __future__ import annotations

from typing import Protocol

from services.router.pods import PodPool
from services.router.routing import PodSpec


class PodSource(Protocol):
    async def initial(self) -> list[PodSpec]:
        """The pods there are now (the router asks them what model they serve)."""
        ...

    async def watch(self, pool: PodPool) -> None:
        """Keep ``pool``'s pod set current until cancelled."""
        ...


class StaticPods:
    def __init__(self, pods: list[PodSpec]) -> None:
        self._pods = pods

    async def initial(self) -> list[PodSpec]:
        return list(self._pods)

    async def watch(self, pool: PodPool) -> None:
        """A fixed list: nothing changes."""
