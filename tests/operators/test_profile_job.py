"""TandemProfile: `tandem profile` as a Job the operator runs against a pool.

The pure part (operators/profile.py: the Job, the profile read back, the
ConfigMap) on its own; then the operator as a real process (kopf) against the
fake API server with the local cluster's controllers (the Job controller
included). There is no kubelet: the test marks the engine pods Ready and
ends the Job's pod as the kubelet would, with `tandem profile`'s result as
its termination message (the real `result_json`). The end-to-end run, with
engines and the real command in the pod, is in tests/journey/test_journey.py.
"""

from __future__ import annotations

import json
import re
import shlex
from datetime import UTC, datetime, timedelta

import pytest

from devcluster import semantics
from operators.planner.profiles import PROFILE_KEY, profile_from_configmap, profiles_from_yaml
from operators.profile import (
    job_name,
    parse_profile,
    profile_from_message,
    profile_job,
    result_configmap,
    stale_condition,
    taken_on,
    termination_message,
)
from operators.spec import parse
from tandem.profile import RESULT_BYTES, result_json
from tests.kube.plugin import running_operator, wait_for
from tests.planner.synthetic import ramp_profile

NS = "default"
TD_SPEC = {
    "model": {"path": "/models/smol"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "router": {"apiKeySecretRef": {"name": "keys"}},
    "scaling": {"mode": "Recommend"},
}
TD = {
    "apiVersion": "tandem.dev/v1alpha1",
    "kind": "TandemDeployment",
    "metadata": {"name": "demo", "namespace": NS},
    "spec": TD_SPEC,
}
DECODE = ramp_profile("demo-decode-profile", "decode", 65.0)
PODS = ("", "v1", "pods")
PROFILES = ("tandem.dev", "v1alpha1", "tandemprofiles")


def tandem_profile(name: str, role: str = "decode", **spec) -> dict:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemProfile",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"deployment": "demo", "role": role, **spec},
    }


# ---- the pure part ------------------------------------------------------------


def script_lines(job: dict) -> list[list[str]]:
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["sh", "-c"]
    return [shlex.split(line) for line in container["command"][2].splitlines()]


def test_the_job_runs_its_own_router_on_loopback_then_tandem_profile():
    p = parse_profile({"deployment": "demo", "role": "decode", "concurrencies": [4, 1, 2]})
    assert p.concurrencies == (1, 2, 4) and p.config_map == "demo-decode-profile"
    assert p.active_deadline_seconds == 2 * 3 * 60 + 600
    job = profile_job("run1", NS, "uid-1", p, parse(TD_SPEC), replicas=2)
    assert job["metadata"]["name"] == job_name("run1")
    assert job["metadata"]["ownerReferences"][0]["kind"] == "TandemProfile"
    pod = job["spec"]["template"]["spec"]
    # The routers' ServiceAccount: EndpointSlices and pods read, nothing written.
    assert pod["serviceAccountName"] == "demo-router" and pod["restartPolicy"] == "Never"
    [container] = pod["containers"]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    # No API keys: the router answers on the pod's loopback only.
    assert not any(e["name"] == "TANDEM_ROUTER_API_KEYS" for e in container["env"])
    router, profile, *rest = script_lines(job)
    assert router[:3] == ["python", "-m", "services.router"] and router[-1] == "&"
    assert router[-4:-1] == ["--host=127.0.0.1", "--remote-prefill-threshold", "0"]
    assert "--discovery=kubernetes" in router and "--discovery-deployment=demo" in router
    assert profile[:2] == ["tandem", "profile"]
    assert {
        "--url=http://127.0.0.1:8000",
        "--role=decode",
        "--concurrencies=1,2,4",
        "--replicas=2",
        "--result-file=/dev/termination-log",
        "--tokenizer=/models/smol",
    } <= set(profile)
    assert rest == [["code=$?"], ["kill", "$!", "2>/dev/null"], ["exit", "$code"]]
    # An aggregated pool keeps the router's own prompt routing.
    agg = dict(TD_SPEC, aggregated={"replicas": 1})
    p = parse_profile({"deployment": "demo", "role": "aggregated"})
    router = script_lines(profile_job("run2", NS, "u", p, parse(agg), 1))[0]
    assert "--remote-prefill-threshold" not in router


# A DNS label, which a label value (beside being possibly empty) must also be.
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def test_a_long_profile_name_gives_a_job_name_and_labels_kubernetes_takes():
    p = parse_profile({"deployment": "demo", "role": "decode"})
    long = "nightly-decode-profile-after-the-model-upgrade-to-revision-7"  # 60 characters
    job = profile_job(long, NS, "uid-1", p, parse(TD_SPEC), replicas=1)
    name = job["metadata"]["name"]
    # The Job controller labels the pods job-name=<name>: 63 characters at most.
    assert DNS_LABEL.match(name) and name == job_name(long), name
    for lbls in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        assert all(len(v) <= 63 for v in lbls.values()), lbls
    # Two long names that share their first 55 characters get two Jobs.
    assert job_name(long) != job_name(long[:-1] + "8")
    # Short names stay as they were.
    assert job_name("run1") == "run1-profile"
    # The profile is its owner: how the operator finds it from the Job.
    [owner] = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("TandemProfile", long)


def test_a_profile_is_stale_once_old_or_taken_on_another_model_tp_or_image():
    scaling = {"mode": "Recommend", "profiles": {"decode": "demo-decode-profile"}}
    td = {**TD_SPEC, "scaling": scaling}
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    on = taken_on(parse(td), "decode")
    assert on == {
        "model": "/models/smol",
        "tensorParallel": 1,
        "image": "ghcr.io/tandem-serving/tandem:latest",
    }

    def record(hours_ago: float, **differs: object) -> dict:
        return {
            "configMap": "demo-decode-profile",
            "takenAt": (now - timedelta(hours=hours_ago)).strftime("%Y-%m-%dT%H:%M:%S%z"),
            "takenOn": {**on, **differs},
        }

    fresh = stale_condition(parse(td), {"decode": record(2)}, now)
    assert fresh is not None and (fresh.status, fresh.reason) == (False, "Fresh")
    old = stale_condition(parse(td), {"decode": record(721)}, now)
    assert old is not None and old.status and "721 h ago" in old.message
    assert "profileMaxAgeHours 720" in old.message and "TandemProfile" in old.message
    other = stale_condition(
        parse(td), {"decode": record(1, tensorParallel=2, image="vllm:0.31")}, now
    )
    assert other is not None and other.status
    assert "tensor parallelism 2 then, 1 now" in other.message
    assert "engine image 'vllm:0.31' then" in other.message
    # A date without its UTC offset (a profile edited by hand) is not aged.
    naive = {**record(2), "takenAt": "2026-01-01T00:00:00"}
    assert stale_condition(parse(td), {"decode": naive}, now).reason == "Fresh"
    # The age is the deployment's to state.
    lenient = {**td, "scaling": {**td["scaling"], "profileMaxAgeHours": 1000}}
    assert not stale_condition(parse(lenient), {"decode": record(721)}, now).status
    # A pool whose scaling.profiles names another ConfigMap than the run wrote,
    # or no run recorded at all: not judged, no condition.
    elsewhere = {**td, "scaling": {"mode": "Recommend", "profiles": {"decode": "by-hand"}}}
    assert stale_condition(parse(elsewhere), {"decode": record(721)}, now) is None
    assert stale_condition(parse(td), {}, now) is None


def test_the_result_round_trips_into_the_configmap_tandem_profile_writes():
    text = result_json(DECODE)
    assert len(text.encode()) <= RESULT_BYTES and "\n" not in text
    profile = profile_from_message(text)
    assert profile == DECODE
    p = parse_profile({"deployment": "demo", "role": "decode"})
    cm = result_configmap(profile, p, "run1", NS, "td-uid")
    assert profile_from_configmap(cm) == DECODE
    assert cm["metadata"]["labels"]["tandem.dev/engine-profile"] == "decode"
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "TandemDeployment"
    with pytest.raises(ValueError, match="not JSON"):
        profile_from_message("Traceback (most recent call last): ...")
    pods = [
        {"status": {"phase": "Failed"}},
        {
            "status": {
                "phase": "Succeeded",
                "containerStatuses": [
                    {"name": "profile", "state": {"terminated": {"message": text}}}
                ],
            }
        },
    ]
    assert termination_message(pods, "Succeeded") == text
    assert termination_message(pods, "Failed") is None
    assert profiles_from_yaml(json.dumps(cm)) == [DECODE]
    assert json.loads(cm["data"][PROFILE_KEY])["config"]["role"] == "decode"


# ---- the operator -------------------------------------------------------------


@pytest.fixture
def kube_api(kube_api_with_controllers):
    """The server with its controllers (the Job controller among them)."""
    return kube_api_with_controllers


@pytest.fixture
def operator(kube_api, tmp_path):
    with running_operator(kube_api, tmp_path) as proc:
        yield proc


def write_pod_status(api, name: str, status: dict) -> None:
    store = api.store
    api.call(
        lambda: store.patch(
            store.kind(*PODS),
            NS,
            name,
            {"status": status},
            "application/merge-patch+json",
            subresource="status",
        )
    )


def engines_ready(api) -> None:
    """What the kubelet would report of every engine pod: Running and Ready."""
    for pod in api.list(*PODS, NS, "app.kubernetes.io/component=engine"):
        write_pod_status(
            api,
            pod["metadata"]["name"],
            {
                "phase": "Running",
                "podIP": "10.244.0.9",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "lastTransitionTime": semantics.now_rfc3339(),
                    }
                ],
            },
        )


def job_pod_ends(api, job: str, phase: str, message: str) -> None:
    """The profile container exited: its termination message in the pod's status."""
    pod = wait_for(lambda: api.list(*PODS, NS, f"job-name={job}"), what=f"the pod of {job}")[0]
    write_pod_status(
        api,
        pod["metadata"]["name"],
        {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "profile",
                    "image": "x",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": 0 if phase == "Succeeded" else 1,
                            "message": message,
                        }
                    },
                }
            ],
        },
    )


def profile_status(api, name: str) -> dict:
    return api.get(*PROFILES, NS, name).get("status", {})


def reason(api, name: str) -> str:
    conditions = profile_status(api, name).get("conditions", [])
    return next((c["reason"] for c in conditions if c["type"] == "Profiled"), "")


def td(api) -> dict:
    return api.get("tandem.dev", "v1alpha1", "tandemdeployments", NS, "demo")


def stale(api) -> dict:
    conditions = td(api).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "ProfileStale"), {})


# Longer than a Job name's 63 characters with "-profile": the Job's name is cut.
RUN2 = "second-run-of-the-decode-pool-profile-with-a-long-name-x"


def test_a_profile_runs_as_a_job_and_lands_in_the_configmap(kube_api, kubectl, operator):
    kube_api.install(TD, tandem_profile("run1", apply=True))
    # No engine is ready yet: the profile waits.
    wait_for(lambda: reason(kube_api, "run1") == "PoolNotReady", what="PoolNotReady")
    assert profile_status(kube_api, "run1")["phase"] == "Pending"
    wait_for(lambda: kube_api.list(*PODS, NS, "app.kubernetes.io/component=engine"), what="pods")
    wait_for(
        lambda: len(kube_api.list(*PODS, NS, "app.kubernetes.io/component=engine")) == 3,
        what="three engine pods",
    )
    engines_ready(kube_api)
    wait_for(lambda: profile_status(kube_api, "run1").get("phase") == "Running", what="Running")
    s = profile_status(kube_api, "run1")
    assert s["job"] == job_name("run1") and s["replicas"] == 2

    # A second profile of the same pool waits for the first.
    kube_api.install(tandem_profile(RUN2))
    wait_for(lambda: reason(kube_api, RUN2) == "AnotherProfileRunning", what="the second waits")

    job_pod_ends(kube_api, job_name("run1"), "Succeeded", result_json(DECODE))
    wait_for(lambda: profile_status(kube_api, "run1").get("phase") == "Succeeded", what="done")
    s = profile_status(kube_api, "run1")
    assert (s["configMap"], s["points"], s["applied"]) == (
        "demo-decode-profile",
        len(DECODE.points),
        True,
    )
    cm = kube_api.get("", "v1", "configmaps", NS, "demo-decode-profile")
    assert profile_from_configmap(cm) == DECODE
    deployment = td(kube_api)
    assert deployment["spec"]["scaling"]["profiles"]["decode"] == "demo-decode-profile"
    recorded = deployment["status"]["profiles"]["decode"]
    assert (recorded["tandemProfile"], recorded["points"]) == ("run1", len(DECODE.points))
    assert "completedAt" in recorded
    assert recorded["takenOn"]["image"] == "ghcr.io/tandem-serving/tandem:latest"
    # kubectl shows it.
    out = kubectl("get", "tandemprofile", "run1", "-o", "jsonpath={.status.phase}").stdout
    assert out == "Succeeded"
    # Profiled on what the pool runs; a new engine image makes the profile stale.
    wait_for(lambda: stale(kube_api).get("reason") == "Fresh", what="ProfileStale=False")
    kubectl(
        "patch",
        "td",
        "demo",
        "--type=merge",
        "-p",
        '{"spec": {"images": {"engine": "ghcr.io/tandem-serving/tandem-engine:2.0"}}}',
    )
    wait_for(lambda: stale(kube_api).get("status") == "True", what="ProfileStale=True")
    assert "engine image" in stale(kube_api)["message"]

    # The second starts once the first is done, and its failure says why.
    wait_for(lambda: profile_status(kube_api, RUN2).get("phase") == "Running", what="run2 runs")
    job_pod_ends(kube_api, job_name(RUN2), "Failed", "RuntimeError: profile decode: no level")
    wait_for(lambda: profile_status(kube_api, RUN2).get("phase") == "Failed", what="run2 fails")
    assert reason(kube_api, RUN2) == "JobFailed"
    message = next(
        c["message"]
        for c in profile_status(kube_api, RUN2)["conditions"]
        if c["type"] == "Profiled"
    )
    assert "no level" in message and "backoff limit" in message
    # A finished run is left as it is.
    assert profile_status(kube_api, "run1")["phase"] == "Succeeded"


def test_refused_while_the_controller_scales_in_auto_mode(kube_api, operator):
    auto = json.loads(json.dumps(TD))
    auto["spec"]["scaling"] = {"mode": "Auto"}
    kube_api.install(auto, tandem_profile("run1"), tandem_profile("agg", role="aggregated"))
    wait_for(lambda: reason(kube_api, "run1") == "AutoScaling", what="AutoScaling")
    message = next(
        c["message"]
        for c in profile_status(kube_api, "run1")["conditions"]
        if c["type"] == "Profiled"
    )
    assert "Auto mode" in message and "Recommend" in message
    assert not kube_api.list("batch", "v1", "jobs", NS)
    # A pool the deployment does not run fails at once.
    wait_for(lambda: profile_status(kube_api, "agg").get("phase") == "Failed", what="NoSuchPool")
    assert reason(kube_api, "agg") == "NoSuchPool"
