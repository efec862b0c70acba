"""The Messages API routes (Anthropic's); errors on them take Anthropic's
format (errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.json_body import JsonBodyRoute
from services.router.api.messages.protocol import CountTokensRequest, MessagesRequest
from services.router.api.openapi import (
    ANTHROPIC_ERRORS,
    AnthropicMessage,
    TokenCount,
    answers,
    generation,
)
from services.router.api.parts import parts_of
from services.router.errors import ANTHROPIC_MESSAGES_PATH

router = APIRouter(route_class=JsonBodyRoute)


@router.post(ANTHROPIC_MESSAGES_PATH, responses=generation(AnthropicMessage, ANTHROPIC_ERRORS))
async def messages(request: Request, body: MessagesRequest):
    return await parts_of(request).messages.messages(request, body)


@router.post(
    ANTHROPIC_MESSAGES_PATH + "/count_tokens", responses=answers(TokenCount, ANTHROPIC_ERRORS)
)
async def count_message_tokens(request: Request, body: CountTokensRequest):
    return await parts_of(request).messages.count_tokens(body)
