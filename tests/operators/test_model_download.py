"""An hf:// model is downloaded once, by a Job the operator runs, before any
engine starts: the operator as a real process (`python -m operators`, kopf)
against the fake API server. It runs no Job controller, so the test writes
the Job's status as Kubernetes' Job controller does (Failed after
backoffLimit, Complete), through the status subresource, and looks at what
the operator does: no engines while the download runs or after it failed, a
failure in the TandemDeployment's conditions and Events, the Job made again
once deleted, engines mounting the cache read-only once it completed."""

from __future__ import annotations

import pytest

from operators import manifests
from tests.kube.plugin import running_operator, wait_for

SOURCE = "hf://Qwen/Qwen3-8B@9c1d2a7"
TD = f"""
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {{name: demo}}
spec:
  model:
    source: "{SOURCE}"
    cache: {{persistentVolumeClaim: weights}}
    hfTokenSecretRef: {{name: hf-token}}
  prefill: {{replicas: 1}}
  decode: {{replicas: 1}}
"""
JOB = manifests.download_job_name("demo", SOURCE)


@pytest.fixture
def operator(kube_api, tmp_path):
    with running_operator(kube_api, tmp_path) as proc:
        yield proc


def download_job(api) -> dict | None:
    return next(
        (j for j in api.list("batch", "v1", "jobs", "default") if j["metadata"]["name"] == JOB),
        None,
    )


def deployments(api) -> set[str]:
    return {d["metadata"]["name"] for d in api.list("apps", "v1", "deployments", "default")}


def model_ready(api) -> dict:
    status = api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo")
    conditions = status.get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "ModelReady"), {})


def job_finished(api, kind: str, message: str) -> None:
    """What the Job controller writes when the Job ends."""
    store = api.store
    jobs = store.kind("batch", "v1", "jobs")
    condition = {"type": kind, "status": "True", "reason": kind, "message": message}
    counts = {"failed": 4} if kind == "Failed" else {"succeeded": 1}
    api.call(
        lambda: store.patch(
            jobs,
            "default",
            JOB,
            {"status": {"conditions": [condition], **counts}},
            "application/merge-patch+json",
            subresource="status",
        )
    )


def test_engines_start_only_once_the_download_completed(kube_api, kubectl, operator):
    kubectl("create", "-f", "-", stdin=TD)
    job = wait_for(lambda: download_job(kube_api), what="the Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][-1] == SOURCE
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    } in container["env"]
    wait_for(lambda: model_ready(kube_api).get("reason") == "Downloading", what="Downloading")
    assert deployments(kube_api) >= {"demo-router"}
    assert not deployments(kube_api) & {"demo-prefill", "demo-decode"}

    # Failed after its retries: said in the conditions, still no engines.
    job_finished(kube_api, "Failed", "Job has reached the specified backoff limit")
    cond = wait_for(
        lambda: (c := model_ready(kube_api)).get("reason") == "DownloadFailed" and c,
        what="DownloadFailed",
    )
    assert cond["status"] == "False" and "backoff limit" in cond["message"]
    status = kube_api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo")
    degraded = next(c for c in status["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "DownloadFailed")
    assert not deployments(kube_api) & {"demo-prefill", "demo-decode"}
    wait_for(
        lambda: any(
            e.get("reason") == "DownloadFailed"
            for e in kube_api.list("", "v1", "events", "default")
        ),
        what="the DownloadFailed Event",
    )

    # Deleted to retry: made again; complete: the engines start, reading the cache.
    kubectl("delete", "job", JOB)
    wait_for(
        lambda: (j := download_job(kube_api)) and not j.get("status", {}).get("conditions"),
        what="the Job made again",
    )
    job_finished(kube_api, "Complete", "")
    wait_for(lambda: {"demo-prefill", "demo-decode"} <= deployments(kube_api), what="engines")
    assert wait_for(lambda: model_ready(kube_api).get("status") == "True", what="ModelReady")
    decode = kube_api.get("apps", "v1", "deployments", "default", "demo-decode")
    pod = decode["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    assert "--model=/models/hf/Qwen/Qwen3-8B/9c1d2a7" in pod["containers"][0]["args"]
    assert "--served-model-name=Qwen/Qwen3-8B" in pod["containers"][0]["args"]
