"""The chat completions route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.json_body import JsonBodyRoute
from services.router.api.openapi import ChatCompletion, generation
from services.router.api.parts import parts_of

router = APIRouter(route_class=JsonBodyRoute)


@router.post("/v1/chat/completions", responses=generation(ChatCompletion))
async def chat_completions(request: Request, body: ChatCompletionRequest):
    return await parts_of(request).chat.chat(request, body)
