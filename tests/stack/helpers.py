"""Small helpers for tests against the running stack."""

from __future__ import annotations

import json
import time

import grpc
import httpx

from bench.harness import sse_data
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc


def chat(url: str, model: str, content: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of a server-sent event stream, checking its framing:
    every event is one ``data:`` line."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        data = sse_data(block)
        assert data is not None and "\n" not in block, f"malformed SSE block: {block!r}"
        events.append(data)
    return events


def stream_text(events: list[str], field: str = "chat") -> str:
    text = []
    for data in events[:-1]:
        chunk = json.loads(data)
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content", "") if field == "chat" else choice["text"])
    return "".join(text)


def engine_load(address: str) -> pb.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.EngineStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_for(predicate, timeout: float, interval: float = 0.2):
    """Poll until predicate() is truthy; return its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def metric_value(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
