"""Request classes: a long fresh prefill or an append turn, and the prefill
pool each class goes to.

A request is ``long`` when the part of its prompt no pod holds (the prefix
index's prediction, the best pod's) is at least ``long_tokens``: a session's
first turn, a sub-agent with a new context, a history the caches lost. It is
``append`` otherwise: a later turn that reuses its context and prefills a
little. On a shared prefill pool a long prefill takes the engine's token
budget step after step and append turns queue behind it (head-of-line
blocking); separate pools keep them apart.

Pools are named on the pods (``PodSpec.pool``: ``--prefill POOL=ADDR``, or the
``tandem.dev/pool`` label of a discovered pod's EndpointSlice). A class
assigned a pool (``--prefill-pool-for CLASS=POOL``) is prefilled only there;
a class without one, only on pods of pools no class reserved. When its pods
cannot serve, the decode pod prefills the request itself, as without any
prefill pod: the other class's pool is never borrowed, since isolating the
two is the point.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

LONG = "long"
APPEND = "append"
REQUEST_CLASSES = (LONG, APPEND)


@dataclass(frozen=True)
class ClassPool:
    """Prefills of ``request_class`` go to the prefill pods of ``pool``."""

    request_class: str
    pool: str

    def __str__(self) -> str:  # the flag's own syntax (common.settings.to_argv)
        return f"{self.request_class}={self.pool}"


def parse_class_pool(text: str) -> ClassPool:
    """``CLASS=POOL``, CLASS one of ``REQUEST_CLASSES``."""
    request_class, sep, pool = (part.strip() for part in text.partition("="))
    if not sep or not pool or request_class not in REQUEST_CLASSES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected CLASS=POOL with CLASS one of {', '.join(REQUEST_CLASSES)}"
        )
    return ClassPool(request_class, pool)


def classify(num_tokens: int, cached_tokens: Iterable[int], long_tokens: int) -> str:
    """The request's class from the tokens each pod is predicted to hold."""
    uncached = num_tokens - max(cached_tokens, default=0)
    return LONG if uncached >= long_tokens else APPEND


class _Pooled(Protocol):
    @property
    def pool(self) -> str: ...


P = TypeVar("P", bound=_Pooled)


def pods_for_class(
    pods: Sequence[P], request_class: str, assignments: Sequence[ClassPool]
) -> list[P]:
    """The prefill pods ``request_class`` may use: its pool's, else those of
    pools no class reserved. Without assignments, all of them."""
    own = {a.pool for a in assignments if a.request_class == request_class}
    if own:
        return [p for p in pods if p.pool in own]
    reserved = {a.pool for a in assignments}
    return [p for p in pods if p.pool not in reserved]
