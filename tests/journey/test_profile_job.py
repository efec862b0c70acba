"""A TandemProfile end to end on the local cluster, as root: `tandem cluster
up`, the operator (a process on the host) bringing up one prefill and one
decode engine from a TandemDeployment, then a TandemProfile of the decode
pool: the Job's pod runs its own router (every prompt to the prefill pool)
and the real `tandem profile` at two short levels, the kubelet hands its
result over as the pod's termination message, and the operator writes the
profile ConfigMap, names it in the deployment's scaling.profiles and reports
it in both statuses.

Two engines; a few minutes on 2 cores. Not in `make test` (`make
profile-job` runs it, its timings printed with -s); marked `stack` so that
`pytest -m "not stack"` leaves it out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model import resolve_model
from operators.planner.profiles import profile_from_configmap
from tests.kube.plugin import start_operator
from tests.localcluster import LocalCluster, down, up

pytestmark = [pytest.mark.stack, pytest.mark.profile_job]

# Its own bridge and addresses: a user's cluster, the journey and the
# kubelet tests may run beside it.
BRIDGE = "tdprofjob"
POD_CIDR = "10.241.0.0/16"
ENGINES_DEADLINE_S = 900.0
PROFILE_DEADLINE_S = 600.0
TDS = "/apis/tandem.dev/v1alpha1"


def pool(**more: object) -> dict:
    return {
        "replicas": 1,
        "engineArgs": ["--enforce-eager"],
        "gpusPerPod": 0,
        "resources": {"requests": {"cpu": "1", "memory": "4Gi"}},
        "shmSize": "1Gi",
        "terminationGracePeriodSeconds": 10,
        **more,
    }


def deployment() -> dict:
    model = resolve_model(None)
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {
                "path": f"/models/{model.name}",
                "servedName": model.name,
                "dtype": "float32",
                "maxModelLen": 8192,
                "volume": {"hostPath": str(model.parent)},
            },
            "prefill": pool(),
            "decode": pool(),
            "router": {"replicas": 1},
            "kvStore": {"enabled": False},
            "scaling": {"mode": "Recommend"},
        },
    }


PROFILE = {
    "apiVersion": "tandem.dev/v1alpha1",
    "kind": "TandemProfile",
    "metadata": {"name": "decode-now"},
    "spec": {
        "deployment": "demo",
        "role": "decode",
        "concurrencies": [1, 2],
        "levelSeconds": 8,
        "apply": True,
        # Small and quick: four sessions, no think time, short answers.
        "args": ["--sessions=4", "--think-scale=0", "--max-tokens-cap=16"],
    },
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    state = tmp_path / "cluster"
    try:
        running = up(state, BRIDGE, POD_CIDR)
        yield running
        running.close()
    finally:
        down(state)


def condition(obj: dict | None, kind: str) -> dict:
    conditions = (obj or {}).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def test_a_tandemprofile_measures_the_pool_and_writes_its_configmap(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    started = time.monotonic()

    def record(what: str) -> None:
        print(f"\n[profile-job] {what}: {time.monotonic() - started:.1f} s", flush=True)

    operator = start_operator(cluster, tmp_path)  # type: ignore[arg-type]
    try:
        operator.wait_ready()
        cluster.apply(deployment(), PROFILE)

        def pools_ready() -> bool:
            status = (cluster.get("tandemdeployments/demo", api=TDS) or {}).get("status", {})
            return status.get("prefill") == "1/1" and status.get("decode") == "1/1"

        cluster.wait(pools_ready, ENGINES_DEADLINE_S, "the engines ready")
        record("engines ready")

        def phase() -> str:
            found = cluster.get("tandemprofiles/decode-now", api=TDS) or {}
            return found.get("status", {}).get("phase", "")

        cluster.wait(lambda: phase() == "Running", 120, "the profile Job started")
        cluster.wait(
            lambda: phase() in ("Succeeded", "Failed"), PROFILE_DEADLINE_S, "the profile's end"
        )
        record("profile finished")
        found = cluster.get("tandemprofiles/decode-now", api=TDS)
        assert phase() == "Succeeded", (
            condition(found, "Profiled"),
            cluster.kubectl("logs", "job/decode-now-profile", check=False)[-3000:],
        )
        status = (found or {})["status"]
        assert status["configMap"] == "demo-decode-profile" and status["points"] >= 1

        profile = profile_from_configmap(cluster.get("configmaps/demo-decode-profile") or {})
        assert profile.role == "decode" and profile.source == "measured"
        assert len(profile.points) == status["points"]
        assert all(p.output_tokens_per_s > 0 for p in profile.points)
        td = cluster.get("tandemdeployments/demo", api=TDS) or {}
        assert td["spec"]["scaling"]["profiles"]["decode"] == "demo-decode-profile"
        assert td["status"]["profiles"]["decode"]["tandemProfile"] == "decode-now"
        print(f"\n[profile-job] {cluster.kubectl('get', 'tandemprofile', '-o', 'wide')}")
        for point in profile.points:
            print(
                f"[profile-job] c={point.concurrency:g}: {point.output_tokens_per_s:.1f} "
                f"output tok/s, TTFT p90 {point.ttft_p90_s or 0:.2f} s"
            )
    finally:
        operator.stop()
        print(f"\n--- operator log ---\n{operator.output()[-5000:]}")
