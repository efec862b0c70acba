"""Errors in each API's own format, mapped from exceptions in one place.

Every error leaves the router with the status OpenAI's API uses for the case —
never a stack trace — as ``{"error": {"message", "type", "param", "code"}}``,
or, on the Anthropic Messages path, as Anthropic's
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import logging
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# 401 is invalid_request_error because that is what OpenAI's API answers for
# a missing or wrong key (with code invalid_api_key); clients match on it.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


# Anthropic's error types, by status (its SDK maps statuses to exception
# classes; the type is what clients log).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# The path of the Anthropic Messages API: errors there take Anthropic's format.
ANTHROPIC_MESSAGES_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_MESSAGES_PATH)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        message = (
            f"{self.param}: {self.message}"
            if self.param and self.param not in self.message
            else self.message
        )
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API at `path` answers it."""
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def sse(self) -> bytes:
        """The error as a server-sent event, for failures after streaming began."""
        return f"data: {json.dumps(self.body())}\n\n".encode()

    def anthropic_sse(self) -> bytes:
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n".encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# What pydantic puts in an error's location for the member of a union that
# failed ("str", "list[dict[str,any]]", "function-after[...]"): no field name.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes"})


def field_path(loc: tuple | list) -> str | None:
    """An error location as the API names fields: ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif (part == "body" and not path) or part in _UNION_TAGS or "[" in str(part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}".rstrip(": "), None
    param = field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param is None and first.get("type") == "value_error":
        # A model-level check: its message starts with the field it names.
        head, sep, rest = msg.partition(": ")
        if sep and head.replace("_", "").replace(".", "").isalnum():
            return msg, head
    if first.get("type") == "missing":
        return (f"{param}: this field is required" if param else "a field is missing"), param
    return (f"{param}: {msg}" if param else msg), param


def _http_message(exc: StarletteHTTPException) -> str:
    """The detail, or for a body FastAPI could not parse (it says only "There
    was an error parsing the body"), why."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 (byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "request body is not valid JSON: nested too deeply"
    if cause is not None and exc.status_code == 400:
        return f"request body is not valid JSON: {type(cause).__name__}"
    return str(exc.detail)


def withheld_traceback(exc: BaseException) -> str:
    """A traceback without the exception's message, which may quote the
    request (a prompt, a header): its type and frames only."""
    frames = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
    return (
        f"Traceback (most recent call last):\n{frames}\n{type(exc).__qualname__} "
        "(message withheld: it may quote the request; TANDEM_LOG_LEVEL=debug shows it)"
    )


class WithholdMessages(logging.Filter):
    """For loggers outside the router's own (uvicorn's "Exception in ASGI
    application"): their tracebacks lose the exception's message unless the
    router logs at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and not log.isEnabledFor(logging.DEBUG):
            record.exc_info = None
            record.exc_text = withheld_traceback(exc)
        return True


def log_unexpected(exc: BaseException) -> None:
    """An unexpected error's type and where it happened; its message only at
    DEBUG (docs/operate.md, "Logs")."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("unhandled error", exc_info=exc)
    else:
        log.error("unhandled error\n%s", withheld_traceback(exc))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return bad_request(message, param=param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, _http_message(exc)).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log_unexpected(exc)
        return OpenAIError(500, f"internal error: {type(exc).__name__}").response(request.url.path)
