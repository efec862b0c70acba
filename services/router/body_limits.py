"""Request bodies are bounded in size and in time.

Neither uvicorn nor Starlette bounds a request body: a client could make the
router buffer 50 MB (or 5 GB) of JSON, or send its body a byte a second and
hold a connection (and the memory of what it sent so far) for ever. This
middleware, outermost but for the request accounting, refuses a body larger
than ``--max-body-mib`` with 413 — at once when ``Content-Length`` says so,
else as soon as the bytes read pass the limit, so at most the limit is ever
held — and a body not complete within ``--body-timeout-s`` of the request's
start with 408. Both in the API's own error format (errors.py).

The body is read before an admission slot is taken (admission.py), so a slow
upload never holds a slot; the timeout bounds how long it holds a connection.
uvicorn has no timeout for a request's *headers*: behind a load balancer
that has one (most have) that is covered; exposed directly, it is not.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from common.settings import SettingError, flag_of, setting
from services.router.errors import OpenAIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class BodySettings:
    max_body_mib: float = setting(
        16.0,
        "largest request body accepted, in MiB (larger: 413); a 1M-token prompt "
        "is about 4 MiB of JSON",
    )
    body_timeout_s: float = setting(
        60.0, "seconds from a request's start within which its whole body must arrive (else 408)"
    )

    def validate(self) -> None:
        for name in ("max_body_mib", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingError(flag_of(BodySettings, name), "must be positive")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * MIB)


class BodyRefused(HTTPException):
    """Raised from `receive` when a body breaks a limit. An HTTPException, so
    that FastAPI passes it through its body parsing to the error handlers
    (errors.py) unchanged; a middleware that reads the body itself
    (admission.py) lets it rise to `BodyLimits`, which answers it."""


class BodyLimits:
    """Pure ASGI middleware enforcing `BodySettings` on every HTTP request."""

    def __init__(self, app, settings: BodySettings) -> None:
        self.app = app
        self.max_bytes = settings.max_body_bytes
        self.timeout_s = settings.body_timeout_s

    def _too_large(self) -> BodyRefused:
        return BodyRefused(
            413, f"request body larger than the server's limit of {self.max_bytes} bytes"
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(self._too_large(), scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        received = 0
        complete = False

        async def limited_receive():
            nonlocal received, complete
            if complete:  # the body is in: what is left is the disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(
                    408, f"the request body did not arrive within {self.timeout_s:g}s"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            return message

        started = False

        async def watched_send(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyRefused as exc:
            if started:
                raise
            await self._refuse(exc, scope, receive, send)

    async def _refuse(self, exc: BodyRefused, scope, receive, send) -> None:
        # Connection: close, as the rest of the body is never read.
        error = OpenAIError(exc.status_code, str(exc.detail), headers={"Connection": "close"})
        await error.response(scope["path"])(scope, receive, send)
