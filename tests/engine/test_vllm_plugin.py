"""The vLLM plugin: NIXL agents get a poll timeout instead of a spin, on CPU
by default and wherever the flag asks for it."""

from __future__ import annotations

import importlib.metadata

from services.engine import vllm_plugin
from services.engine.config import parse_settings
from services.engine.vllm_plugin import BindingsWithDelay


def test_entry_point_is_registered_for_vllm():
    names = {ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "services.engine.vllm_plugin:register" in names


def test_agents_with_progress_thread_get_the_delay():
    from vllm.distributed import nixl_utils

    bindings = __import__(nixl_utils.NixlWrapper.__module__, fromlist=["nixlBind"]).nixlBind
    if isinstance(bindings, BindingsWithDelay):
        bindings = bindings.bindings
    created = []

    class Recorder:
        nixlAgentConfig = bindings.nixlAgentConfig

        def nixlAgent(self, name, config):  # noqa: N802
            created.append(config)

    wrapped = BindingsWithDelay(Recorder(), delay_us=10_000)
    for prog_thread, delay in ((True, 0), (True, 500), (False, 0)):
        config = wrapped.nixlAgentConfig()
        config.useProgThread = prog_thread
        config.pthrDelay = delay
        wrapped.nixlAgent("agent", config)
    assert [c.pthrDelay for c in created] == [10_000, 500, 0]


def test_defaults_by_device_and_flags_override():
    auto = parse_settings(["--role", "prefill", "--model", "/x"])
    assert auto.plugin_env("cpu") == {vllm_plugin.NIXL_DELAY_ENV: "10000"}
    assert auto.plugin_env("cuda") == {vllm_plugin.NIXL_DELAY_ENV: "0"}
    spin = parse_settings(["--role", "prefill", "--model", "/x", "--nixl-progress-delay-us", "0"])
    assert spin.plugin_env("cpu") == {vllm_plugin.NIXL_DELAY_ENV: "0"}


def _affinity_in_a_thread(start: set[int], build) -> set[int]:
    """The CPU affinity a fresh thread has after pinning itself to `start`
    and running `build` (threads keep their own affinity: the test's stays)."""
    import os
    import threading

    found: list[set[int]] = []

    def run() -> None:
        os.sched_setaffinity(0, start)
        build()
        found.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return found[0]


def test_the_nixl_worker_leaves_the_model_thread_on_its_cores():
    import os

    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "needs two CPUs to tell a binding from the reserved core"
    bound, reserved = {cpus[0]}, {cpus[-1]}

    class PinsLikeVllm:  # what NixlBaseConnectorWorker.__init__ does on CPU
        def __init__(self) -> None:
            os.sched_setaffinity(0, reserved)

    assert _affinity_in_a_thread(bound, PinsLikeVllm) == reserved
    PinsLikeVllm.__init__ = vllm_plugin.keeping_thread_affinity(PinsLikeVllm.__init__)
    assert _affinity_in_a_thread(bound, PinsLikeVllm) == bound


def test_register_wraps_vllms_nixl_worker_once():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    vllm_plugin.register()
    wrapped = NixlBaseConnectorWorker.__init__
    vllm_plugin.register()
    assert NixlBaseConnectorWorker.__init__ is wrapped
    assert wrapped.keeps_thread_affinity
