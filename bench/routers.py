"""The routers the benchmarks compare: Tandem's (``services.router``) and the
Rust routers vllm-router and sglang-router (``pip install -e '.[routers]'``),
how to find them and the command line they share."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from common.ports import free_port

HOST = "127.0.0.1"


@dataclass(frozen=True)
class RouterSpec:
    name: str
    backend: str  # "grpc" (Tandem's engine service) or "http" (OpenAI HTTP servers)
    policy: str  # its round-robin policy, the simplest one each router has
    package: str | None = None  # pip package that provides `binary`
    binary: str | None = None
    ready_path: str = "/health"


ROUTERS: dict[str, RouterSpec] = {
    "tandem": RouterSpec("tandem", "grpc", "round-robin"),
    "vllm-router": RouterSpec("vllm-router", "http", "round_robin",
                              package="vllm-router==0.1.17", binary="vllm-router"),
    # /health answers OK before any worker is registered; /readiness waits for one.
    "sglang-router": RouterSpec("sglang-router", "http", "round_robin",
                                package="sglang-router==0.3.2", binary="sglang-router",
                                ready_path="/readiness"),
}


def find_binary(spec: RouterSpec) -> str:
    """The router's console script: on PATH, else next to this Python (a venv
    used without activating it)."""
    found = shutil.which(spec.binary) or shutil.which(
        spec.binary, path=str(Path(sys.executable).parent))
    if not found:
        raise SystemExit(
            f"{spec.name}: the '{spec.binary}' command is not installed. Install it with "
            f"`pip install {spec.package}` (or `pip install -e '.[routers]'`, or "
            f"`make bench-routers`), or leave it out with --routers.")
    return found


def http_router_argv(spec: RouterSpec, port: int, worker_urls: list[str],
                     policy: str) -> list[str]:
    """vllm-router or sglang-router on `port` in front of `worker_urls` with
    `policy`, logging at warning level, its Prometheus endpoint on a port of
    its own (replicas must not collide on the default)."""
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *worker_urls,
              "--policy", policy, "--prometheus-host", HOST,
              "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    if spec.name == "vllm-router":
        return [find_binary(spec), *common, "--log-level", "warning"]
    if spec.name == "sglang-router":
        return [find_binary(spec), "launch", *common, "--log-level", "warn"]
    raise ValueError(f"unknown router {spec.name!r}")
