"""Tandem's routing core: which pods serve a request, and why.

The router calls one object, ``RoutingCore`` (see README.md here): a
synchronous ``route(RouteRequest, SharedView, now) -> RouteDecision`` over a
view of the shared state read before it, then ``report_prefill``,
``report_failure`` and ``release`` as the request proceeds; ``add_pod``,
``remove_pod`` and ``set_draining`` change the pod set.
"""

from services.router.routing.core import (
    PodLoad,
    PodReport,
    PodSpec,
    PodStatus,
    RouteDecision,
    RouteRequest,
    RoutingCore,
    SharedView,
    StateWrites,
)
from services.router.routing.policy import NoPodAvailable
from services.router.routing.replica import Replica
from services.router.routing.sessions import IncrementalTokenizer, session_key
from services.router.routing.settings import RoutingSettings

__all__ = [
    "IncrementalTokenizer",
    "NoPodAvailable",
    "PodLoad",
    "PodReport",
    "PodSpec",
    "PodStatus",
    "Replica",
    "RouteDecision",
    "RouteRequest",
    "RoutingCore",
    "RoutingSettings",
    "SharedView",
    "StateWrites",
    "session_key",
]
