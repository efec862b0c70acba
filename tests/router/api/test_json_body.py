"""`JsonBodyRoute`: a JSON body validated in one pass answers as FastAPI's
own path does, errors included, and every generation route takes it."""

from __future__ import annotations

import json

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.completions.protocol import CompletionRequest
from services.router.api.json_body import JsonBodyRoute
from services.router.api.messages.protocol import MessagesRequest
from services.router.api.responses.protocol import ResponsesRequest
from services.router.app import create_app
from services.router.config import parse_settings
from services.router.errors import install_error_handlers

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def app_with(route_class: type[APIRoute], seen: list[str]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=route_class)

    @router.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        seen.append(type(body).__name__)
        return JSONResponse(body.model_dump(mode="json"))

    app.include_router(router)
    return app


BODIES = [
    (json.dumps(CHAT).encode(), "application/json"),
    (json.dumps(CHAT).encode(), "application/json; charset=utf-8"),
    (json.dumps({**CHAT, "temperature": 0.5, "stop": "x", "n": 2}).encode(), "application/json"),
    (json.dumps({**CHAT, "temperature": 9}).encode(), "application/json"),
    (json.dumps({**CHAT, "echo": True}).encode(), "application/json"),
    (json.dumps({"model": "m"}).encode(), "application/json"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "application/json"),
    (b'{"model": "m", "messages": [', "application/json"),
    (b"\xff\xfe", "application/json"),
    (b"[1, 2]", "application/json"),
    (b"", "application/json"),
    (json.dumps(CHAT).encode(), "text/plain"),
    (json.dumps(CHAT).encode(), "application/vnd.api+json"),
]


@pytest.mark.parametrize(("content", "content_type"), BODIES)
def test_answers_as_fastapis_own_path(content, content_type):
    seen_fast: list[str] = []
    seen_plain: list[str] = []
    fast = TestClient(app_with(JsonBodyRoute, seen_fast))
    plain = TestClient(app_with(APIRoute, seen_plain))
    headers = {"content-type": content_type}
    a = fast.post("/v1/chat/completions", content=content, headers=headers)
    b = plain.post("/v1/chat/completions", content=content, headers=headers)
    assert (a.status_code, a.json()) == (b.status_code, b.json())
    assert seen_fast == seen_plain


def test_every_generation_route_validates_in_one_pass():
    app = create_app(parse_settings(["--engine", "127.0.0.1:1"]))
    models = {
        route.path: route._body_model()
        for route in app.routes
        if isinstance(route, JsonBodyRoute) and "POST" in route.methods
    }
    assert models["/v1/chat/completions"] is ChatCompletionRequest
    assert models["/v1/completions"] is CompletionRequest
    assert models["/v1/messages"] is MessagesRequest
    assert models["/v1/responses"] is ResponsesRequest
