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
from tests.helpers import AGGREGATED_BLOCK_SIZE, MODEL_NAME, TOOLS_TEMPLATE

# Long enough that a prefill engine that never hands its KV over keeps it for
# the whole test; early release is what the tests look for.
KV_LEASE_SECONDS = 120


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def stack(model_dir, tmp_path_factory, request):
    if any("reference" in item.fixturenames for item in request.session.items):
        # Launched first, so its minute of start-up overlaps the stack's
        # rather than following it.
        reference_server(request, model_dir, tmp_path_factory)
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


# Session-scoped engines that only some stack tests use, by fixture name, and
# how to stop them: each stops right after the last test that needs it
# (pytest_runtest_teardown), so it is gone before the next group's engines start.
EARLY_STOPS = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def aggregated_engines(model_dir, tmp_path_factory, request):
    """Two aggregated engines (role both: whole requests, no P/D split) with
    small KV blocks, publishing KV events, behind a cost-policy router. Shared
    by tests/stack/test_sessions.py (through the router) and
    tests/router/routing/test_engine_agreement.py (engine-0 alone, over gRPC),
    so they start once."""
    config = StackConfig(
        prefill=0,
        decode=0,
        aggregated=2,
        router_port=free_port(),
        kv_cache_gib=1,
        max_model_len=4096,
        state_dir=tmp_path_factory.mktemp("two-engines"),
        engine_args=["--block-size", str(AGGREGATED_BLOCK_SIZE)],
        router_args=[
            "--block-size",
            str(AGGREGATED_BLOCK_SIZE),
            "--routing-policy",
            "cost",
            "--chat-template",
            str(TOOLS_TEMPLATE),
        ],
        # A guard against hangs, not a performance bound: on a
        # loaded 2-core machine engines alone took 8 minutes.
        startup_timeout_s=1800,
    )
    s = Stack(config)
    s.start()
    request.config.stash.setdefault(EARLY_STOPS, {})["aggregated_engines"] = s.stop
    yield s
    s.stop()  # a second stop does nothing


class ReferenceServer:
    """vLLM's own OpenAI server with the same model and dtype, aggregated (no
    P/D, no connector). Launched when made; `url()` waits until it serves."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        port = free_port()
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
        self.proc, self.popen = launch(
            "reference", argv, log, env=engine_env(same_engine.kv_cache_gib, engine_cores(1)[0])
        )
        self._url = f"http://127.0.0.1:{port}"
        self.deadline = time.monotonic() + 1200

    def url(self) -> str:
        wait_http_ok(f"{self._url}/health", self.proc, self.deadline)
        return self._url

    def stop(self) -> None:
        if self.popen.poll() is None:
            stop_process_group(self.proc, grace_s=10)
            self.popen.wait(timeout=10)


REFERENCE = pytest.StashKey[ReferenceServer]()


def reference_server(request, model_dir: Path, tmp_path_factory) -> ReferenceServer:
    """The session's one ReferenceServer, launched on first call; it stops at
    the end of the session whichever fixture launched it."""
    stash = request.config.stash
    if REFERENCE not in stash:
        log = tmp_path_factory.mktemp("reference") / "vllm.log"
        stash[REFERENCE] = server = ReferenceServer(model_dir, log)
        request.config.add_cleanup(server.stop)
    return stash[REFERENCE]


@pytest.fixture(scope="session")
def reference(model_dir, tmp_path_factory, request):
    """vLLM's own OpenAI server (ReferenceServer): the ground truth for
    token-identical output. Started once: it takes a minute, and two test
    files compare against it. The `stack` fixture launches it already when a
    test of the session needs it, so the two start side by side."""
    server = reference_server(request, model_dir, tmp_path_factory)
    yield server.url()
    server.stop()


def pytest_collection_modifyitems(config, items):
    """Fast tests first, then tests that start their own engines, then the
    tests on the shared aggregated engines, then the tests on the shared P/D
    stack, the chaos sequence last (it kills the stack's engines; the harness
    restarts them, but a failure of its should fail nothing else). Module-scoped
    engines are gone, and the aggregated engines stopped
    (pytest_runtest_teardown), before the next group starts, so a 24 GiB
    machine never holds all at once."""

    def group(item) -> int:
        if item.get_closest_marker("stack") is None:
            return 0
        if item.get_closest_marker("chaos") is not None:
            return 4
        if "stack" in item.fixturenames:
            return 3
        return 2 if "aggregated_engines" in item.fixturenames else 1

    items.sort(key=group)  # stable: file order is kept within a group


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stops each early-stopping session fixture (EARLY_STOPS) once no test
    after this one uses it. Not under pytest-xdist, whose workers run the
    items in another order than the list: there they stop at the end."""
    result = yield
    stops = item.config.stash.get(EARLY_STOPS, {})
    if stops and not hasattr(item.config, "workerinput"):
        later = item.session.items[item.session.items.index(item) + 1 :]
        for name in [n for n in stops if not any(n in i.fixturenames for i in later)]:
            stops.pop(name)()
    return result
