"""Tandem's routing core: which pods serve a request, and why.

The router calls one object, ``RoutingCore`` (see README.md here):
``route(RouteRequest, now) -> RouteDecision``, then ``report_prefill``,
``report_failure`` and ``release`` as the request proceeds.
"""

from services.router.routing.core import (PodSpec, RouteDecision, RouteRequest,
                                          RoutingCore)
from services.router.routing.policy import NoPodAvailable
from services.router.routing.sessions import IncrementalTokenizer, session_key
from services.router.routing.settings import (KvEventSource, RoutingSettings,
                                              add_routing_arguments,
                                              routing_settings_from_args)

__all__ = ["IncrementalTokenizer", "KvEventSource", "NoPodAvailable", "PodSpec",
           "RouteDecision", "RouteRequest", "RoutingCore", "RoutingSettings",
           "add_routing_arguments", "routing_settings_from_args", "session_key"]
