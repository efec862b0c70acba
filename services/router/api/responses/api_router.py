"""The Responses API routes (OpenAI's)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.json_body import JsonBodyRoute
from services.router.api.openapi import ResponseObject, answers, generation
from services.router.api.parts import parts_of
from services.router.api.responses.protocol import ResponsesRequest

router = APIRouter(route_class=JsonBodyRoute)


@router.post("/v1/responses", responses=generation(ResponseObject))
async def responses(request: Request, body: ResponsesRequest):
    return await parts_of(request).responses.responses(request, body)


@router.get("/v1/responses/{response_id}", responses=answers(ResponseObject))
async def stored_response(request: Request, response_id: str):
    return parts_of(request).responses.stored_response(response_id)
