"""What the router's fuzz tests share: the real router process
(``python -m services.router``, tool parsing on) in front of one fake gRPC
engine (bench/router_fakes.py), so bodies that pass validation are really
tokenized, routed and generated; and the check that an answer is no 5xx and,
when a refusal, in the endpoint's own error format."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import router_fakes
from common.model import resolve_model
from common.ports import free_port
from common.procs import Proc, Processes, wait_grpc_serving, wait_http_ok
from services.router.chat_templates import CHATML_TOOLS

HOST = "127.0.0.1"
STARTUP_S = 120.0


@dataclass(frozen=True)
class LiveRouter:
    url: str
    proc: Proc
    client: httpx.Client

    def rss_peak_kib(self) -> int:
        """The router process's peak resident memory (VmHWM), in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/<pid>/status")


@contextmanager
def live_router(log_dir: Path, *router_args: str, token_text: str = "ok") -> Iterator[LiveRouter]:
    """The router with `router_args` added to its flags, before one fake
    engine generating `token_text` as each token. Each process's output is in
    ``<log_dir>/<name>.log``."""
    procs = Processes(log_dir)
    cpus = set(os.sched_getaffinity(0))
    model_dir = str(resolve_model(None))
    try:
        engine_port, port = free_port(), free_port()
        fake, _ = procs.launch(
            "fake-engine",
            router_fakes.command(
                "grpc",
                HOST,
                str(engine_port),
                model_dir,
                "--token-text",
                token_text,
                # No delay between tokens: a body without max_tokens
                # generates to the end of the context (8k tokens), in a second.
                "--token-delay-ms",
                "0",
            ),
            cpus,
        )
        wait_grpc_serving(f"{HOST}:{engine_port}", fake, time.monotonic() + STARTUP_S)
        proc, _ = procs.launch(
            "router",
            [
                sys.executable,
                "-m",
                "services.router",
                "--host",
                HOST,
                "--port",
                str(port),
                "--engine",
                f"{HOST}:{engine_port}",
                "--model",
                model_dir,
                "--chat-template",
                str(CHATML_TOOLS),
                "--tool-call-parser",
                "hermes",
                *router_args,
            ],
            cpus,
        )
        url = f"http://{HOST}:{port}"
        wait_http_ok(f"{url}/health", proc, time.monotonic() + STARTUP_S)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield LiveRouter(url, proc, client)
        assert proc.alive(), "the router exited during the tests"
    finally:
        procs.stop_all()


def speaks_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def check_answer(path: str, response: httpx.Response, what: object = "") -> None:
    """`response` is no 5xx, and a refusal is in the endpoint's own error
    format: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    assert response.status_code < 500, f"{path} {what!r}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), response.headers
        error = response.json()
        if speaks_anthropic(path):
            assert error["type"] == "error", error
            assert error["error"]["type"] and error["error"]["message"], error
        else:
            assert set(error) == {"error"}, error
            assert error["error"]["message"] and error["error"]["type"], error
            assert {"param", "code"} <= set(error["error"]), error


def named_field(path: str, response: httpx.Response) -> str | None:
    """The field an error names: OpenAI's ``param``; on /v1/messages, the
    ``<field>: `` that starts Anthropic's message."""
    error = response.json()
    if speaks_anthropic(path):
        message = error["error"]["message"]
        head, sep, _ = message.partition(": ")
        return head if sep and " " not in head else None
    return error["error"]["param"]
