"""Each API answers errors in its own format: Anthropic's on /v1/messages
(validation, 401 from the API-key middleware, 404), OpenAI's elsewhere — the
real router app from `create_app` (its lifespan, which needs engines, is
never run). Fast; no engines."""

from __future__ import annotations

import httpx

from services.router.app import create_app
from services.router.config import RouterSettings


def _client(**settings) -> httpx.AsyncClient:
    app = create_app(RouterSettings(engines=["fake:1"], **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def test_messages_validation_error_is_anthropic_shaped():
    async with _client() as router:
        response = await router.post(
            "/v1/messages",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("max_tokens")
    async with _client() as router:
        response = await router.post("/v1/messages", content=b"{not json")
    assert response.status_code == 400 and response.json()["type"] == "error"


async def test_missing_key_is_an_anthropic_authentication_error():
    async with _client(api_keys=("k",)) as router:
        messages = await router.post("/v1/messages", json={})
        chat = await router.post("/v1/chat/completions", json={})
    assert messages.status_code == chat.status_code == 401
    assert messages.json()["error"]["type"] == "authentication_error"
    assert chat.json()["error"]["code"] == "invalid_api_key"


async def test_responses_errors_are_openai_shaped():
    async with _client() as router:
        response = await router.post(
            "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 0}
        )
        missing = await router.post("/v1/messages/nope", json={})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_output_tokens"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
