"""Fixtures of the planner's tests."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bench import router_fakes
from common.model import resolve_model
from common.ports import free_port
from common.procs import Processes, wait_grpc_serving, wait_http_ok
from tests.planner.synthetic import FIRST_TOKEN_MS, TOKEN_DELAY_MS

HOST = "127.0.0.1"


@pytest.fixture(scope="session")
def fake_router(tmp_path_factory):
    """A real router process (``python -m services.router``) in front of one
    fake gRPC engine of role "both" (bench/router_fakes.py, fixed latency, no
    cache hits); yields the router's URL."""
    logs = tmp_path_factory.mktemp("planner-router")
    procs = Processes(logs)
    cpus = set(os.sched_getaffinity(0))
    try:
        engine_port, router_port = free_port(), free_port()
        engine, _ = procs.launch(
            "fake-engine",
            router_fakes.command(
                "grpc",
                HOST,
                str(engine_port),
                str(resolve_model(None)),
                "--first-token-ms",
                str(FIRST_TOKEN_MS),
                "--token-delay-ms",
                str(TOKEN_DELAY_MS),
            ),
            cpus,
        )
        wait_grpc_serving(f"{HOST}:{engine_port}", engine, time.monotonic() + 120)
        router, _ = procs.launch(
            "router",
            [
                sys.executable,
                "-m",
                "services.router",
                "--host",
                HOST,
                "--port",
                str(router_port),
                "--engine",
                f"{HOST}:{engine_port}",
                "--model",
                str(resolve_model(None)),
            ],
            cpus,
        )
        url = f"http://{HOST}:{router_port}"
        wait_http_ok(f"{url}/health", router, time.monotonic() + 120)
        yield url
    finally:
        procs.stop_all()
