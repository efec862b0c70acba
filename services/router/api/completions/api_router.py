"""The completions route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.completions.protocol import CompletionRequest
from services.router.api.json_body import JsonBodyRoute
from services.router.api.openapi import Completion, generation
from services.router.api.parts import parts_of

router = APIRouter(route_class=JsonBodyRoute)


@router.post("/v1/completions", responses=generation(Completion))
async def completions(request: Request, body: CompletionRequest):
    return await parts_of(request).completions.completions(request, body)
