"""The models route: the one model this router serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.openapi import ModelList, answers
from services.router.api.parts import parts_of

router = APIRouter()


@router.get("/v1/models", responses=answers(ModelList))
async def models(request: Request):
    card = parts_of(request).card
    return {
        "object": "list",
        "data": [
            {
                "id": card.name,
                "object": "model",
                "created": card.created,
                "owned_by": "tandem",
                "max_model_len": card.max_model_len,
            }
        ],
    }
