"""The routers the benchmarks compare: Tandem's (``services.router``) and the
Rust routers vllm-router and sglang-router (``pip install -e '.[routers]'``),
how to find them and the command line they share."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.ports import free_port
from services.router.chat_templates import CHATML_TOOLS

HOST = "127.0.0.1"


@dataclass(frozen=True)
class RouterSpec:
    name: str
    backend: str  # "grpc" (Tandem's engine service) or "http" (OpenAI HTTP servers)
    policy: str  # its round-robin policy, the simplest one each router has
    package: str | None = None  # pip package that provides `binary`
    binary: str | None = None
    ready_path: str = "/health"
    router_args: tuple[str, ...] = ()  # Tandem's router: flags beyond the common ones
    request_fields: dict = field(default_factory=dict)  # added to every chat request


# What an agent sends each turn: two function tools (bench/router_overhead.py
# measures the router's tool parsing, and structured output's schema checks,
# against plain chat).
AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
            },
        },
    }
    for name, description, properties in (
        (
            "read_file",
            "Read a file of the repository",
            {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
        ),
        (
            "run_tests",
            "Run the test suite, or one test file",
            {"target": {"type": "string"}, "verbose": {"type": "boolean"}},
        ),
    )
]
ANSWER_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "summary": {"type": "string"},
                "files": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["summary", "files"],
            "additionalProperties": False,
        },
    },
}


ROUTERS: dict[str, RouterSpec] = {
    "tandem": RouterSpec("tandem", "grpc", "round-robin"),
    # The same router run from another source tree (--base-src): before/after in one run.
    "tandem-base": RouterSpec("tandem-base", "grpc", "round-robin"),
    # A Generate call per request (a gRPC message per token) instead of the
    # shared GenerateStream per engine.
    "tandem-per-request": RouterSpec(
        "tandem-per-request",
        "grpc",
        "round-robin",
        router_args=("--engine-streams", "per-request"),
    ),
    # The same router with the bundled model's tool template and vLLM's hermes
    # parser, every request carrying tools (tool_choice auto: each output token
    # goes through the parser).
    "tandem-tools": RouterSpec(
        "tandem-tools",
        "grpc",
        "round-robin",
        router_args=("--chat-template", str(CHATML_TOOLS), "--tool-call-parser", "hermes"),
        request_fields={"tools": AGENT_TOOLS, "tool_choice": "auto"},
    ),
    # Every request constrained by a JSON schema (checked by the router, carried
    # to the engine; the fake engine does not apply it).
    "tandem-structured": RouterSpec(
        "tandem-structured",
        "grpc",
        "round-robin",
        request_fields={"response_format": ANSWER_SCHEMA},
    ),
    "vllm-router": RouterSpec(
        "vllm-router", "http", "round_robin", package="vllm-router==0.1.17", binary="vllm-router"
    ),
    # /health answers OK before any worker is registered; /readiness waits for one.
    "sglang-router": RouterSpec(
        "sglang-router",
        "http",
        "round_robin",
        package="sglang-router==0.3.2",
        binary="sglang-router",
        ready_path="/readiness",
    ),
    # SGLang's gateway, sglang-router's successor (its own venv: see find_binary).
    "smg": RouterSpec(
        "smg", "http", "round_robin", package="smg==1.13.0", binary="smg", ready_path="/readiness"
    ),
}


def own_venv(spec: RouterSpec) -> Path:
    """A venv of the router's own, so that its dependencies stay out of the
    project's (smg pins versions the project does not use)."""
    return Path(".tandem") / f"venv-{spec.name}"


def find_binary(spec: RouterSpec) -> str:
    """The router's console script: on PATH, next to this Python (a venv used
    without activating it), or in `own_venv`."""
    found = (
        shutil.which(spec.binary)
        or shutil.which(spec.binary, path=str(Path(sys.executable).parent))
        or shutil.which(spec.binary, path=str(own_venv(spec) / "bin"))
    )
    if not found:
        venv = own_venv(spec)
        raise SystemExit(
            f"{spec.name}: the '{spec.binary}' command is not installed. Install it with "
            f"`python -m venv {venv} && {venv}/bin/pip install {spec.package}` (or "
            f"`pip install {spec.package}`, `make bench-routers`), or leave it out with "
            f"--routers."
        )
    return str(Path(found).resolve())


def http_router_argv(spec: RouterSpec, port: int, worker_urls: list[str], policy: str) -> list[str]:
    """vllm-router or sglang-router on `port` in front of `worker_urls` with
    `policy`, logging at warning level, its Prometheus endpoint on a port of
    its own (replicas must not collide on the default)."""
    common = [
        "--host",
        HOST,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
    ]
    if spec.name == "vllm-router":
        return [find_binary(spec), *common, "--log-level", "warning"]
    if spec.name in ("sglang-router", "smg"):
        return [find_binary(spec), "launch", *common, "--log-level", "warn"]
    raise ValueError(f"unknown router {spec.name!r}")


def in_dir(argv: list[str], cwd: str) -> list[str]:
    """`argv` run from `cwd` (the base router's source tree)."""
    if cwd == os.getcwd():
        return argv
    return ["sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
