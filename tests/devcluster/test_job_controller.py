"""The local cluster's Job controller (devcluster/controllers/job.py) against
its API server, with the real kubectl; the test plays the kubelet (writes the
pods' phase), as tests/devcluster/test_controllers.py does."""

from __future__ import annotations

import time

import pytest

from devcluster.controllers import NODE_NAME

NS = "default"
PODS = ("", "v1", "pods")
JOBS = ("batch", "v1", "jobs")


@pytest.fixture
def kube_api(kube_api_with_controllers):
    """Every test here (and the kubectl fixture) gets the server with controllers."""
    return kube_api_with_controllers


def settle(api) -> None:
    """Until the controllers have acted on every write so far."""
    deadline = time.monotonic() + 30
    while not api.call(api.controllers.idle):
        assert time.monotonic() < deadline, "the controllers never settled"
        time.sleep(0.01)
    assert not api.controllers.errors, list(api.controllers.errors)


def job(name: str = "work", **spec) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "python", "command": ["true"]}],
                },
            },
            **spec,
        },
    }


def create(api, obj: dict) -> None:
    api.install(obj)
    settle(api)


def pods(api, name: str = "work") -> list[dict]:
    return sorted(
        api.list(*PODS, NS, f"job-name={name}"), key=lambda p: p["metadata"]["creationTimestamp"]
    )


def live(api, name: str = "work") -> list[dict]:
    return [
        p
        for p in pods(api, name)
        if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        and not p["metadata"].get("deletionTimestamp")
    ]


def finish(api, pod: dict, phase: str, restarts: int = 0) -> None:
    """The pod's containers ended (phase Succeeded or Failed), as the kubelet writes it."""
    store = api.store
    body = {
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "python",
                    "imageID": "",
                    "ready": False,
                    "restartCount": restarts,
                    "state": {"terminated": {"exitCode": 0 if phase == "Succeeded" else 1}},
                }
            ],
        }
    }
    api.call(
        lambda: store.patch(
            store.kind(*PODS),
            NS,
            pod["metadata"]["name"],
            body,
            "application/merge-patch+json",
            subresource="status",
        )
    )
    settle(api)


def status(api, name: str = "work") -> dict:
    return api.get(*JOBS, NS, name).get("status", {})


def conditions(api, name: str = "work") -> dict[str, dict]:
    return {c["type"]: c for c in status(api, name).get("conditions", [])}


def test_a_job_runs_one_pod_to_completion(kube_api, kubectl):
    create(kube_api, job())
    [pod] = pods(kube_api)
    meta = pod["metadata"]
    assert meta["name"].startswith("work-") and pod["spec"]["nodeName"] == NODE_NAME
    uid = kube_api.get(*JOBS, NS, "work")["metadata"]["uid"]
    assert meta["labels"] == {
        "app": "work",
        "job-name": "work",
        "controller-uid": uid,
        "batch.kubernetes.io/job-name": "work",
        "batch.kubernetes.io/controller-uid": uid,
    }
    [owner] = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Job", "work", True)
    assert status(kube_api)["active"] == 1 and "startTime" in status(kube_api)

    finish(kube_api, pod, "Succeeded")
    s = status(kube_api)
    assert (s["active"], s["succeeded"], s.get("failed", 0)) == (0, 1, 0)
    assert conditions(kube_api)["Complete"]["status"] == "True"
    assert "completionTime" in s
    assert len(pods(kube_api)) == 1  # no pod after the success
    # kubectl reads it as done (its columns come from the same status).
    out = kubectl("get", "job", "work", "-o", "jsonpath={.status.conditions[0].type}").stdout
    assert out == "Complete"


def test_failed_pods_are_replaced_until_the_backoff_limit(kube_api):
    create(kube_api, job(backoffLimit=2))
    for tries in range(1, 4):
        [pod] = live(kube_api)
        finish(kube_api, pod, "Failed")
        assert status(kube_api)["failed"] == tries
    # Three failures with backoffLimit 2: failed, no fourth pod.
    failed = conditions(kube_api)["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "BackoffLimitExceeded")
    assert "backoff limit" in failed["message"]
    assert len(pods(kube_api)) == 3 and not live(kube_api)
    assert "Complete" not in conditions(kube_api) and "completionTime" not in status(kube_api)
    reasons = {e["reason"] for e in kube_api.list("", "v1", "events", NS)}
    assert {"SuccessfulCreate", "BackoffLimitExceeded"} <= reasons


def test_a_pod_that_fails_then_one_that_succeeds_completes_the_job(kube_api):
    create(kube_api, job(backoffLimit=3))
    finish(kube_api, live(kube_api)[0], "Failed")
    finish(kube_api, live(kube_api)[0], "Succeeded")
    s = status(kube_api)
    assert (s["failed"], s["succeeded"], s["active"]) == (1, 1, 0)
    assert conditions(kube_api)["Complete"]["status"] == "True"


def test_restarts_under_on_failure_count_against_the_limit(kube_api):
    spec = job(backoffLimit=1)
    spec["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    create(kube_api, spec)
    [pod] = live(kube_api)
    store = kube_api.store
    kube_api.call(
        lambda: store.patch(
            store.kind(*PODS),
            NS,
            pod["metadata"]["name"],
            {
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {
                            "name": "main",
                            "image": "python",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 2,
                            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        }
                    ],
                }
            },
            "application/merge-patch+json",
            subresource="status",
        )
    )
    settle(kube_api)
    assert conditions(kube_api)["Failed"]["reason"] == "BackoffLimitExceeded"
    # The running pod of a failed Job is deleted (gracefully: it is bound).
    [pod] = pods(kube_api)
    assert pod["metadata"].get("deletionTimestamp")


def test_completions_and_parallelism(kube_api):
    create(kube_api, job(completions=3, parallelism=2))
    assert len(live(kube_api)) == 2
    finish(kube_api, live(kube_api)[0], "Succeeded")
    assert len(live(kube_api)) == 2  # one more to start: 1 done, 2 to go
    finish(kube_api, live(kube_api)[0], "Succeeded")
    assert len(live(kube_api)) == 1  # only one left to succeed
    assert status(kube_api)["succeeded"] == 2 and "Complete" not in conditions(kube_api)
    finish(kube_api, live(kube_api)[0], "Succeeded")
    assert conditions(kube_api)["Complete"]["status"] == "True"
    assert len(pods(kube_api)) == 3


def test_the_active_deadline_fails_the_job_and_stops_its_pod(kube_api):
    create(kube_api, job(activeDeadlineSeconds=1))
    assert len(live(kube_api)) == 1
    deadline = time.monotonic() + 10
    while "Failed" not in conditions(kube_api):
        assert time.monotonic() < deadline, "the deadline never failed the Job"
        time.sleep(0.05)
    assert conditions(kube_api)["Failed"]["reason"] == "DeadlineExceeded"
    settle(kube_api)
    assert not live(kube_api)


def test_a_finished_job_goes_after_its_ttl_with_its_pods(kube_api):
    create(kube_api, job(ttlSecondsAfterFinished=0))
    finish(kube_api, live(kube_api)[0], "Succeeded")
    deadline = time.monotonic() + 10
    while kube_api.list(*JOBS, NS):
        assert time.monotonic() < deadline, "the finished Job stayed"
        time.sleep(0.05)
    settle(kube_api)
    # Collected with it: its pod, bound to the node, is deleted gracefully.
    [pod] = pods(kube_api)
    assert pod["metadata"].get("deletionTimestamp")
