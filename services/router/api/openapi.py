"""What the router's OpenAPI document (``/openapi.json``) says each route
answers: its success body (JSON, or an event stream when ``stream`` is
true) and its errors — OpenAI's error object everywhere but /v1/messages,
Anthropic's there — with the statuses errors.py really uses. Without this
FastAPI documents a 422 with its own error shape, which the router never
sends (an invalid body is a 400 in the API's format).

The success models describe the fields every answer carries; answers may
carry more (``extra="allow"``). They document, they do not filter: routes
return plain dicts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error object (every route but /v1/messages)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error object (/v1/messages and /v1/messages/count_tokens)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage


class AnthropicMessage(_Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, Any]


class TokenCount(BaseModel):
    input_tokens: int


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]


class Tokens(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(BaseModel):
    prompt: str


class ModelCardBody(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCardBody]


class PodHealth(BaseModel):
    role: str
    state: Literal["available", "draining", "ejected", "unhealthy"]
    healthy: bool
    draining: bool
    in_flight: int


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    pods: dict[str, PodHealth]


_ERROR_STATUSES = (
    "400: invalid body or field (named); 401: API key; 404: unknown model or id; "
    "408: body not received in time; 413: body too large; 429: at capacity or over a rate limit"
)


def _errors(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        "4XX": {"model": model, "description": _ERROR_STATUSES},
        "5XX": {
            "model": model,
            "description": "503: no healthy pod can serve, or starting; 504: request timeout",
        },
    }


OPENAI_ERRORS = _errors(OpenAIErrorBody)
ANTHROPIC_ERRORS = _errors(AnthropicErrorBody)
_EVENTS = {"text/event-stream": {"schema": {"type": "string"}}}


def generation(model: type[BaseModel], errors: dict[int | str, dict[str, Any]] = OPENAI_ERRORS):
    """The responses of a route that generates: `model` as JSON, or with
    ``stream: true`` server-sent events."""
    return {
        200: {"model": model, "description": "the answer; with stream: true, its events"}
        | {"content": _EVENTS},
        **errors,
    }


def answers(model: type[BaseModel], errors: dict[int | str, dict[str, Any]] = OPENAI_ERRORS):
    return {200: {"model": model}, **errors}
