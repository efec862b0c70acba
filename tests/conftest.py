"""Shared fixtures. The real embedded stack (vLLM engines over gRPC, NIXL KV
hand-off, the router) starts once per test session; nothing in it is mocked.
Helpers that several test files use are in tests/helpers.py.

A test that needs a piece that is absent (the model, vLLM, NIXL) fails: the
fixture raises with the reason, it never skips.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from common.model import resolve_model
from common.ports import free_port
from common.procs import launch, stop_process_group, wait_http_ok
from services.stack import Stack, StackConfig, engine_cores, engine_env, vllm_flags
from tests.helpers import MODEL_NAME, TOOLS_TEMPLATE

# Long enough that a prefill engine that never hands its KV over keeps it for
# the whole test; early release is what the tests look for.
KV_LEASE_SECONDS = 120


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def stack(model_dir, tmp_path_factory):
    config = StackConfig(
        router_port=free_port(),
        kv_cache_gib=1,
        max_model_len=4096,
        state_dir=tmp_path_factory.mktemp("stack"),
        engine_args=["--kv-lease-s", str(KV_LEASE_SECONDS)],
        # Every prompt goes through the prefill pod, however
        # short: the P/D tests check its KV moves over NIXL.
        router_args=[
            "--remote-prefill-threshold",
            "0",
            # Tools: SmolLM2's own template lacks them.
            "--chat-template",
            str(TOOLS_TEMPLATE),
            "--tool-call-parser",
            "hermes",
        ],
    )
    s = Stack(config)
    s.start()
    s.model = MODEL_NAME
    yield s
    s.stop()


@pytest.fixture(scope="session")
def reference(model_dir, tmp_path_factory):
    """vLLM's own OpenAI server with the same model and dtype, aggregated (no
    P/D, no connector): the ground truth for token-identical output. Started
    once: it takes a minute, and two test files compare against it."""
    port = free_port()
    log = tmp_path_factory.mktemp("reference") / "vllm.log"
    same_engine = StackConfig(kv_cache_gib=1, max_model_len=4096)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *vllm_flags(same_engine, model=str(model_dir)),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prompt-tokens-details",
    ]
    proc, popen = launch(
        "reference", argv, log, env=engine_env(same_engine.kv_cache_gib, engine_cores(1)[0])
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc, time.monotonic() + 1200)
        yield url
    finally:
        stop_process_group(proc, grace_s=10)
        popen.wait(timeout=10)


def pytest_collection_modifyitems(config, items):
    """Fast tests first, then tests that start their own engines, then the
    tests on the shared session stack. Module-scoped engines are gone before
    the session stack starts, so a 24 GiB machine never holds all at once."""

    def group(item) -> int:
        if item.get_closest_marker("stack") is None:
            return 0
        return 2 if "stack" in item.fixturenames else 1

    items.sort(key=group)  # stable: file order is kept within a group
