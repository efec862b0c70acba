"""GPU check of the multi-node path: a two-node LeaderWorkerSet group, served through Ray.

For a machine with at least two NVIDIA GPUs and vLLM's CUDA build (the engine
image). The operator's own leader and worker commands for a pool with
`nodesPerReplica: 2` (one GPU per pod, tensor parallel 2 across the two Ray
nodes) run as two local "pods" (bench/ray_group.py: GPU 0 for the leader, GPU 1
for the worker); once the leader's engine serves, one greedy generation goes
through its gRPC API and the time from start to ready and to the first token
are printed. vLLM's CPU build refuses the Ray executor, so this path has not
run on the machines the project is built on.

    python -m bench.ray_group_gpu --model /path/to/model-dir [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.engine_client import EngineClient
from bench.ray_group import raylet_healthy, start_group
from operators import manifests
from operators.spec import parse, problems, with_defaults


def group_workload(model: str, tensor: int, pipeline: int) -> dict:
    spec = with_defaults(
        {
            "model": {"path": model, "dtype": "auto"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "aggregated": {
                "replicas": 1,
                "nodesPerReplica": 2,
                "gpusPerPod": tensor * pipeline // 2,
                "parallelism": {"tensor": tensor, "pipeline": pipeline},
                "engineArgs": ["--max-model-len=4096", "--gpu-memory-utilization=0.8"],
            },
            "kvStore": {"enabled": False},
        }
    )
    found = problems(parse(spec))
    if found:
        raise SystemExit("; ".join(found))
    owner = manifests.Owner("EnginePool", "check-aggregated", "uid")
    return manifests.pool_workload("check", "default", parse(spec), "aggregated", 1, owner)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local model folder (config.json)")
    parser.add_argument("--tensor", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--timeout", type=float, default=480, help="seconds to wait for ready")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    per_pod = args.tensor * args.pipeline // 2
    if torch.cuda.device_count() < 2 * per_pod:
        raise SystemExit(f"needs {2 * per_pod} GPUs, found {torch.cuda.device_count()}")
    lws = group_workload(str(Path(args.model).resolve()), args.tensor, args.pipeline)
    gpus = [",".join(str(i) for i in range(k * per_pod, (k + 1) * per_pod)) for k in (0, 1)]
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    logs = Path(tempfile.mkdtemp(prefix="ray-group-logs-"))
    start = time.perf_counter()
    group = start_group(
        lws,
        logs,
        ray_tmp,
        leader_env={"CUDA_VISIBLE_DEVICES": gpus[0]},
        worker_env={"CUDA_VISIBLE_DEVICES": gpus[1]},
    )
    client = EngineClient(group.grpc_port, group.metrics_port)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if group.leader.proc.poll() is not None:
                raise SystemExit(f"the leader exited:\n{group.leader.output()[-4000:]}")
            try:
                client.wait_ready(timeout=2)
                break
            except Exception:  # the channel is not ready yet
                if time.monotonic() > deadline:
                    raise SystemExit(f"not ready in {args.timeout} s; logs in {logs}") from None
        ready_s = time.perf_counter() - start
        result = client.generate(list(range(100, 164)), max_tokens=16)
        out = {
            "ready_s": round(ready_s, 1),
            "first_token_s": round(result.seconds, 3),
            "tokens": len(result.token_ids),
            "worker_raylet_healthy": raylet_healthy(group.worker_agent_port),
            "group_ready_logged": "ray group ready: 2 nodes" in group.leader.output(),
        }
        assert out["tokens"] == 16 and out["group_ready_logged"], out
        print(
            json.dumps(out)
            if args.json
            else f"two-node Ray group served: ready in {out['ready_s']} s, first token "
            f"{out['first_token_s']} s, worker raylet healthy {out['worker_raylet_healthy']}"
        )
    finally:
        client.close()
        group.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
