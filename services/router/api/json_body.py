"""The route class of the routes that take a JSON body: the body validated
straight from its bytes.

FastAPI parses a body with ``json.loads``, then solves the route's
dependencies and validates the parsed value field by field: about a tenth
of the router's CPU per streamed chat request (docs/benchmarks.md, "Router
overhead"). For a route ``(request, body: Model)`` and a body sent as
``application/json``, `JsonBodyRoute` hands the bytes to pydantic's
``model_validate_json`` (parsing and validation in one pass, in Rust) and
calls the route with the model. Anything else — another content type, or a
body that does not validate — takes FastAPI's own path, so every error
reads as it always has (errors.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json"


class JsonBodyRoute(APIRoute):
    """An APIRoute whose JSON body is validated in one pass (module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        general = super().get_route_handler()
        model = self._body_model()
        if model is None:
            return general
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            if _is_json(request.headers.get("content-type")):
                try:
                    body = model.model_validate_json(await request.body())
                except ValidationError:
                    pass  # FastAPI's path says why, in the words errors.py maps
                else:
                    result = await endpoint(request, body)
                    return result if isinstance(result, Response) else JSONResponse(result)
            return await general(request)

        return handler

    def _body_model(self) -> type[BaseModel] | None:
        """The model of a route declared ``(request: Request, body: Model)``;
        None for any other signature (FastAPI's path serves it)."""
        params = list(inspect.signature(self.endpoint).parameters.values())
        if (
            len(params) != 2
            or self.body_field is None
            or self.dependant.request_param_name != params[0].name
        ):
            return None
        model = self.body_field.field_info.annotation
        if params[1].name != self.body_field.name or not (
            isinstance(model, type) and issubclass(model, BaseModel)
        ):
            return None
        return model
