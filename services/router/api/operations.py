"""The routes operators and Kubernetes probe: ``/live`` (the process serves
HTTP: liveness, which must not fail because engines are down — restarting the
router would not bring them back), ``/health`` (can this router serve: some
decode-capable pod available; readiness) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.roles import Role
from services.router.api.openapi import OPENAI_ERRORS, Health
from services.router.api.parts import metrics_of, parts_of

router = APIRouter()


@router.get(
    "/health",
    responses={
        200: {"model": Health, "description": "a decode-capable pod is available"},
        503: {"model": Health, "description": "no pod can serve"},
        "4XX": OPENAI_ERRORS["4XX"],
    },
)
async def health(request: Request):
    pods = parts_of(request).core.report(time.monotonic())
    can_serve = any(p.state == "available" and p.role != Role.PREFILL for p in pods)
    body = {
        "status": "ok" if can_serve else "unavailable",
        "pods": {
            p.name: {
                "role": p.role,
                "state": p.state,
                "healthy": p.healthy,
                "draining": p.draining,
                "in_flight": p.in_flight,
            }
            for p in pods
        },
    }
    return JSONResponse(body, status_code=200 if can_serve else 503)


@router.get(
    "/live",
    responses={200: {"description": "the router process serves HTTP"}, "4XX": OPENAI_ERRORS["4XX"]},
)
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **OPENAI_ERRORS,
    },
)
async def prometheus_metrics(request: Request):
    registry = metrics_of(request).registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
