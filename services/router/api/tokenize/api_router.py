"""The tokenize and detokenize routes (vLLM's)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.router.api.openapi import Detokenized, Tokens, answers
from services.router.api.parts import parts_of
from services.router.api.tokenize.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize", responses=answers(Tokens))
async def tokenize(request: Request, body: TokenizeRequest):
    return await parts_of(request).tokenize.tokenize(body)


@router.post("/detokenize", responses=answers(Detokenized))
async def detokenize(request: Request, body: DetokenizeRequest):
    return await parts_of(request).tokenize.detokenize(body)
