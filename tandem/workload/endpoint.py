"""The OpenAI-compatible endpoint a replay talks to: its base URLs, the model
it serves, and the server-sent event stream its chat completions come back in."""

from __future__ import annotations

from typing import Any, AnyStr


def urls(url: str) -> list[str]:
    """The base URLs in a comma-separated list (router replicas)."""
    found = [u.strip() for u in url.split(",") if u.strip()]
    if not found:
        raise ValueError(f"no URL in {url!r}")
    return found


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model `GET /v1/models` lists at `url` (the first of several
    replicas: they serve the same model)."""
    import httpx

    url = urls(url)[0]
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(
            f"cannot list models at {url}/v1/models ({e}); is the "
            f"server up? pass --model to skip the lookup"
        ) from None
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


# -- OpenAI streams -------------------------------------------------------------

DONE = "[DONE]"  # the data of an OpenAI stream's last event


def sse_data(line: AnyStr) -> AnyStr | None:
    """The data of one line of a server-sent event stream (``data: x`` gives
    ``x``, stripped), None for any other line (the blank line that ends an
    event, comments, other fields). Text or bytes in, the same out."""
    prefix = b"data:" if isinstance(line, bytes) else "data:"
    if not line.startswith(prefix):  # type: ignore[arg-type]
        return None
    return line[5:].strip()


def is_done(data: str | bytes) -> bool:
    return data in (DONE, DONE.encode())


def output_deltas(chunk: dict[str, Any]) -> int:
    """How many choices of a streamed chat chunk carry output text (content or
    reasoning; the opening role-only chunk and the usage chunk carry none)."""
    count = 0
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            count += 1
    return count
