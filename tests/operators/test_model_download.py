"""An hf:// model is downloaded once, by a Job the operator runs, before any
engine starts: the operator as a real process (`python -m operators`, kopf)
against the fake API server with the local cluster's controllers, its Job
controller among them. There is no kubelet (and no Hub here): the test ends
the download pods as the kubelet reports a container's exit, and the Job
controller says how the Job went (Failed past backoffLimit, Complete). It
looks at what the operator does: no engines while the download runs or after
it failed, a failure in the TandemDeployment's conditions and Events, the Job
made again once deleted, engines mounting the cache read-only once it
completed."""

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
    downloadBackoffLimit: 1
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


def download_pods_end(api, phase: str) -> None:
    """Each running pod of the download Job exits (Failed or Succeeded), as the
    kubelet reports it; the Job controller acts on it."""
    store = api.store
    pods = store.kind("", "v1", "pods")
    for pod in api.list("", "v1", "pods", "default", f"job-name={JOB}"):
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        status = {"status": {"phase": phase}}
        api.call(
            lambda name=pod["metadata"]["name"], status=status: store.patch(
                pods, "default", name, status, "application/merge-patch+json", subresource="status"
            )
        )


def job_ended(api) -> str | None:
    job = download_job(api) or {}
    done = [c["type"] for c in job.get("status", {}).get("conditions", []) if c["status"] == "True"]
    return done[0] if done else None


@pytest.fixture
def kube_api(kube_api_with_controllers):
    """The server with its controllers: the Job controller runs the download's pods."""
    return kube_api_with_controllers


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

    # Failed after its retries (backoffLimit 1: two pods): said in the
    # conditions, still no engines.
    for _ in range(2):
        wait_for(
            lambda: any(
                p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
                for p in kube_api.list("", "v1", "pods", "default", f"job-name={JOB}")
            ),
            what="a download pod",
        )
        download_pods_end(kube_api, "Failed")
    wait_for(lambda: job_ended(kube_api) == "Failed", what="the Job failed")
    assert len(kube_api.list("", "v1", "pods", "default", f"job-name={JOB}")) == 2
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
        lambda: (j := download_job(kube_api)) and j.get("status", {}).get("active") == 1,
        what="the Job made again, its pod running",
    )
    download_pods_end(kube_api, "Succeeded")
    wait_for(lambda: job_ended(kube_api) == "Complete", what="the Job complete")
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
