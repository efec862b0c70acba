"""What the routes serve with, kept on ``app.state`` by the composition root
(app.py), where each route finds it: the metrics, made with the app (so
``/metrics`` answers from the first request on), and `RouterParts`, built once
at startup (the lifespan) from what the engines serve."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from services.router.api.chat.serving import ChatServing
from services.router.api.completions.serving import CompletionsServing
from services.router.api.engine_request import ModelCard
from services.router.api.messages.serving import MessagesServing
from services.router.api.responses.serving import ResponsesServing
from services.router.api.tokenize.serving import TokenizeServing
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.routing import RoutingCore


@dataclass(frozen=True)
class RouterParts:
    card: ModelCard
    core: RoutingCore  # the pods' state, for /health
    chat: ChatServing
    completions: CompletionsServing
    messages: MessagesServing
    responses: ResponsesServing
    tokenize: TokenizeServing


def parts_of(request: Request) -> RouterParts:
    """The parts of the app serving `request`; a 503 while it is starting.

    Called in the route's body, not as a FastAPI dependency: dependencies run
    before the body is validated, and an invalid body is a 400 whatever the
    router's state."""
    parts = getattr(request.app.state, "parts", None)
    if parts is None:
        raise OpenAIError(503, "the router is starting")
    return parts


def metrics_of(request: Request) -> RouterMetrics:
    return request.app.state.metrics
