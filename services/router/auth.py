"""Optional API keys: when any is configured, every request except /health
and /metrics must carry ``Authorization: Bearer <key>``, else 401.

/health and /metrics stay open because Kubernetes probes and Prometheus
scrape them without credentials. Everything else (not only /v1/*) is
guarded, so an endpoint added later is protected by default. Keys are never
logged nor echoed in errors.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics

OPEN_PATHS = frozenset({"/live", "/health", "/metrics"})


def read_keys_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    keys: list[str] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if any(c.isspace() for c in line):
            # A bearer token has no whitespace: most likely a trailing comment,
            # which would otherwise become part of a key no client can send.
            raise ValueError(
                f"{path}:{number}: a key cannot contain whitespace (put comments on their own line)"
            )
        keys.append(line)
    return keys


def _digest(key: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's timing
    # independent of the key's length as well as its content.
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeyAuth:
    """Pure ASGI middleware; a pass-through when no key is configured."""

    def __init__(
        self, app, keys: list[str] | tuple[str, ...], metrics: RouterMetrics, open_paths=OPEN_PATHS
    ) -> None:
        self.app = app
        self._digests = [_digest(k) for k in keys]
        self._metrics = metrics
        self._open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if not self._digests or scope["type"] != "http" or scope["path"] in self._open_paths:
            return await self.app(scope, receive, send)
        failure = self._check(dict(scope["headers"]).get(b"authorization"))
        if failure is None:
            return await self.app(scope, receive, send)
        reason, message = failure
        self._metrics.auth_failures.labels(reason).inc()
        error = OpenAIError(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response(scope["path"])(scope, receive, send)

    def _check(self, header: bytes | None) -> tuple[str, str] | None:
        """None if the request may pass, else (metric reason, client message)."""
        if not header:
            return "missing", (
                "Missing API key: send it in the Authorization header as "
                "'Authorization: Bearer <key>'"
            )
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return "missing", (
                "Malformed Authorization header: expected 'Authorization: Bearer <key>'"
            )
        digest = _digest(token)
        # Check every key (no early exit), so timing says nothing about which matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return None if matched else ("invalid", "Incorrect API key provided")
