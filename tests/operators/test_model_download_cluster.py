"""An hf:// model's download Job for real, on the local cluster (as root):
the Hub mirror (devcluster/hubmirror.py) runs as a pod over a small model
folder, the operator (a host process) runs the download Job, whose pod runs
`python -m common.model_source` with the real huggingface_hub against
`model.hubEndpoint`. An unknown repo and a mirror that is not there fail the
download: ModelReady=False (DownloadFailed) on the TandemDeployment, no
engine pod started. Pointed at the mirror, the download fills the cache
claim and ModelReady turns True. The pools run no replicas: no engines (the
journey serves a downloaded model, tests/journey/test_journey.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.kube import LABEL_COMPONENT
from devcluster.client import LocalCluster
from devcluster.hubmirror import mirror_objects
from operators import manifests
from tests.kube.plugin import start_operator
from tests.localcluster import cluster_fixture

# Its own bridge and addresses: other local clusters may run beside it.
cluster = cluster_fixture("tdmodeldl", "10.244.0.0/16")

TDS = "/apis/tandem.dev/v1alpha1"
REPO = "tiny-org/tiny-model"
MIRROR = "http://hub-mirror:8080"
# Each try starts a Python process that imports huggingface_hub: slow on a loaded machine.
DOWNLOAD_DEADLINE_S = 240.0


def deployment(source: str, hub: str) -> dict:
    idle = {"replicas": 0, "gpusPerPod": 0}
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {
                "source": source,
                "cache": {"persistentVolumeClaim": "weights"},
                "hubEndpoint": hub,
                "downloadBackoffLimit": 0,
                "servedName": "tiny",
            },
            "prefill": idle,
            "decode": idle,
            "router": {"replicas": 1},
            "kvStore": {"enabled": False},
            "scaling": {"mode": "Off"},
        },
    }


def model_ready(cluster: LocalCluster) -> dict:
    td = cluster.get("tandemdeployments/demo", api=TDS) or {}
    conditions = td.get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "ModelReady"), {})


def failed_download(cluster: LocalCluster, source: str, hub: str) -> str:
    """The ModelReady message once the Job of `source` from `hub` failed."""
    job = manifests.download_job_name("demo", source, hub)
    found = cluster.wait(
        lambda: (
            (c := model_ready(cluster)).get("reason") == "DownloadFailed"
            and f"job/{job}" in c["message"]
            and c
        ),
        DOWNLOAD_DEADLINE_S,
        f"ModelReady=False for job/{job}",
    )
    assert isinstance(found, dict) and found["status"] == "False"
    assert not cluster.pods(f"{LABEL_COMPONENT}=engine")
    [pod] = cluster.pods(f"job-name={job}")
    return cluster.kubectl("logs", pod["metadata"]["name"], check=False)


def test_a_download_fails_on_the_td_and_succeeds_through_the_mirror(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    cluster.apply(*mirror_objects({REPO: model}))
    operator = start_operator(cluster, tmp_path)  # type: ignore[arg-type]
    try:
        operator.wait_ready()
        # A repo the mirror does not have.
        cluster.apply(deployment("hf://nobody/nothing", MIRROR))
        log = failed_download(cluster, "hf://nobody/nothing", MIRROR)
        assert "RepositoryNotFoundError" in log, log[-2000:]
        # No mirror at the endpoint: the name does not resolve.
        cluster.apply(deployment(f"hf://{REPO}", "http://no-mirror:8080"))
        log = failed_download(cluster, f"hf://{REPO}", "http://no-mirror:8080")
        assert "LocalEntryNotFoundError" in log, log[-2000:]
        # The mirror: a new Job, the files in the cache claim, ModelReady.
        cluster.apply(deployment(f"hf://{REPO}", MIRROR))
        cluster.wait(
            lambda: model_ready(cluster).get("status") == "True",
            DOWNLOAD_DEADLINE_S,
            "ModelReady=True",
        )
        cached = cluster.state / "claims" / "default" / "weights" / "hf" / REPO / "main"
        for name in ("config.json", "tokenizer.json"):
            assert (cached / name).read_bytes() == (model / name).read_bytes()
    finally:
        operator.stop()
        print(f"\n--- operator log ---\n{operator.output()[-3000:]}")
