"""Run one LeaderWorkerSet group's rendered commands as two local "pods" on this host.

The operator renders a multi-node replica as a LeaderWorkerSet whose leader
starts Ray's head, waits for $LWS_GROUP_SIZE nodes and runs the engine on the
Ray executor, and whose worker joins $LWS_LEADER_ADDRESS (operators/manifests/engine.py).
`start_group` runs those two `sh -c` scripts here, each in its own process
group, doing what the kubelet and LWS would: `$(VAR)` references expanded from
the pod's env (POD_IP from the downward API, LWS_* from LWS). Both "pods"
share this host's network, so the fixed in-pod ports (Ray's 6379, the
engine's) move to free ones and each Ray node gets its own agent port; nothing
else of the commands changes. Used by tests/operators/test_ray_group.py (CPU:
vLLM refuses the Ray executor there) and bench/ray_group_gpu.py (serving).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.ports import free_port
from common.procs import group_alive
from operators import manifests

REPO = Path(__file__).resolve().parents[1]
# Ray's worker processes take ports from this range on every node by default.
RAY_WORKER_PORTS = range(10002, 20000)


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """`$(NAME)` → its value, for names the container's env defines (as the kubelet does)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def move_ports(script: str, moves: dict[int, int]) -> str:
    """Every `=PORT` / `:PORT` of `moves`' keys replaced; each must occur."""
    for old, new in moves.items():
        script, count = re.subn(rf"(?<=[=:]){old}\b", str(new), script)
        if not count:
            raise ValueError(f"port {old} is not in the script")
    return script


def free_non_ray_port() -> int:
    while True:
        port = free_port()
        if port not in RAY_WORKER_PORTS:
            return port


class LocalPod:
    """One container's `sh -c` script, run in its own process group like a pod."""

    def __init__(self, name: str, script: str, env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                ["sh", "-c", script],
                cwd=REPO,
                env=env,
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM the pod's process group (Ray drains), then SIGKILL what is left;
        the daemons `ray start --head` leaves behind are in the same group."""
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not group_alive(self.proc.pid):
                break
        if self.proc.poll() is None:
            self.proc.wait(5)
        if group_alive(self.proc.pid):
            raise RuntimeError(f"{self.name}: group {self.proc.pid} outlived SIGKILL")


def pod_env(container: dict, pod_name: str, home: Path, extra: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (downward API: this host).

    Each pod gets a HOME of its own, as a container has its own file system:
    Ray keeps state there (``~/.ray/auth_token`` turns token authentication on
    for every later ``ray start``), and a user's own Ray must not leak in.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        HOME=str(home),
        **extra,
    )
    fields = {"status.podIP": "127.0.0.1", "metadata.name": pod_name}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def raylet_healthy(agent_port: int) -> bool:
    """The worker pods' probe: Ray's agent says whether its node's raylet is up."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{agent_port}/api/local_raylet_healthz", timeout=2
        ) as reply:
            return reply.read() == b"success"
    except OSError:
        return False


@dataclass
class Group:
    leader: LocalPod
    worker: LocalPod
    grpc_port: int
    metrics_port: int
    worker_agent_port: int

    def stop(self) -> None:
        for pod in (self.worker, self.leader):
            pod.stop()


def start_group(
    lws: dict,
    log_dir: Path,
    ray_tmp: str,
    leader_env: dict[str, str] | None = None,
    worker_env: dict[str, str] | None = None,
) -> Group:
    """Start a two-node LeaderWorkerSet group's leader and worker here."""
    template = lws["spec"]["leaderWorkerTemplate"]
    if template["size"] != 2:
        raise ValueError("a local group has two pods")
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    gcs, grpc, metrics, nixl, dashboard, client, head_agent, worker_agent = (
        free_non_ray_port() for _ in range(8)
    )
    name = lws["metadata"]["name"]
    lws_env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "RAY_TMPDIR": ray_tmp}

    env = pod_env(
        leader,
        f"{name}-0",
        Path(ray_tmp) / "home-leader",
        {**lws_env, "LWS_WORKER_INDEX": "0", **(leader_env or {})},
    )
    script = move_ports(
        kubelet_expand(leader["args"][0], env),
        {
            manifests.RAY_PORT: gcs,
            manifests.GRPC_PORT: grpc,
            manifests.METRICS_PORT: metrics,
            manifests.NIXL_PORT: nixl,
        },
    )
    script = script.replace(
        "ray start --head",
        f"ray start --head --dashboard-port={dashboard} "
        f"--ray-client-server-port={client} "
        f"--dashboard-agent-listen-port={head_agent}",
        1,
    )
    head = LocalPod("leader", script, env, log_dir / "leader.log")

    env = pod_env(
        worker,
        f"{name}-0-1",
        Path(ray_tmp) / "home-worker",
        {**lws_env, "LWS_WORKER_INDEX": "1", **(worker_env or {})},
    )
    script = move_ports(kubelet_expand(worker["args"][0], env), {manifests.RAY_PORT: gcs})
    script = script.replace(
        "ray start", f"ray start --dashboard-agent-listen-port={worker_agent}", 1
    )
    return Group(
        head, LocalPod("worker", script, env, log_dir / "worker.log"), grpc, metrics, worker_agent
    )
