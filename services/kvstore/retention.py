"""Per-request retention hints: the router's word on what the KV store keeps.

The router attaches a :class:`RetentionHint` (protos: ``RetentionHint``) to
the Prefill/Generate request of a session; the engine host puts it into the
request's ``kv_transfer_params`` under :data:`HINT_KEY`; Tandem's store
connector (``connector.py``) reads it there on the scheduler side and hands
it to the worker that writes the request's KV blocks. Pure data and
conversions, no vLLM or Mooncake import, so the router, the engine host and
the tests share it.

Why these semantics (Mooncake 0.3.13, measured, see services/kvstore/README.md, "Router hints"):
a soft pin is set when an object is written and lasts its TTL; reads do not
renew it, and writing an existing key again leaves it as it was. So a hint
can pin what a request *writes*, and a session's end can only be acted on by
removing its blocks (an unpin would rewrite their data).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HINT_KEY = "tandem_retention"
# Attribute set on vLLM's per-request store job (ReqMeta) for the worker.
REQ_META_ATTR = "tandem_retention"


@dataclass(frozen=True)
class RetentionHint:
    session: str = ""
    pin_ttl_ms: int = 0  # > 0: soft-pin the blocks this request writes
    release: bool = False  # the session is over: remove its blocks after this request
    keep_tokens: int = 0  # with release: the first keep_tokens tokens' blocks are shared

    def __post_init__(self) -> None:
        if self.pin_ttl_ms < 0 or self.keep_tokens < 0:
            raise ValueError("pin_ttl_ms and keep_tokens must not be negative")
        if self.release and self.pin_ttl_ms:
            raise ValueError("a release does not pin")

    @property
    def pins(self) -> bool:
        return self.pin_ttl_ms > 0 and not self.release

    def to_params(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "pin_ttl_ms": self.pin_ttl_ms,
            "release": self.release,
            "keep_tokens": self.keep_tokens,
        }

    @classmethod
    def from_params(cls, kv_transfer_params: Mapping[str, Any] | None) -> RetentionHint | None:
        """The hint in a request's kv_transfer_params, None if there is none.

        Raises ValueError for a malformed hint (the engine host checks it
        before the request reaches vLLM, so the connector never sees one).
        """
        if not kv_transfer_params:
            return None
        raw = kv_transfer_params.get(HINT_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"{HINT_KEY} must be an object, got {type(raw).__name__}")
        unknown = set(raw) - {"session", "pin_ttl_ms", "release", "keep_tokens"}
        if unknown:
            raise ValueError(f"{HINT_KEY}: unknown fields {sorted(unknown)}")
        try:
            return cls(
                session=str(raw.get("session", "")),
                pin_ttl_ms=int(raw.get("pin_ttl_ms", 0)),
                release=bool(raw.get("release", False)),
                keep_tokens=int(raw.get("keep_tokens", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{HINT_KEY}: {exc}") from None


def from_proto(message: Any) -> RetentionHint | None:
    """A ``tandem.engine.v1.RetentionHint`` (None or unset → None)."""
    if message is None:
        return None
    if not (message.session or message.pin_ttl_ms or message.release):
        return None
    return RetentionHint(message.session, message.pin_ttl_ms, message.release, message.keep_tokens)


def with_hint(
    kv_transfer_params: dict[str, Any] | None, hint: RetentionHint | None
) -> dict[str, Any] | None:
    """``kv_transfer_params`` plus the hint (a new dict; the input is not changed)."""
    if hint is None:
        return kv_transfer_params
    return {**(kv_transfer_params or {}), HINT_KEY: hint.to_params()}


def without_hint(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The KV hand-off part of ``kv_transfer_params`` (None when only a hint is left)."""
    if not kv_transfer_params:
        return None
    rest = {k: v for k, v in kv_transfer_params.items() if k != HINT_KEY}
    return rest or None
