"""The rate-matching controller inside the operator (`python -m operators`, kopf,
a real process) against the fake API server over HTTP. The routers are small
real HTTP servers in the test serving the router's own metrics
(services/router/metrics.py `RouterMetrics`, Prometheus text) whose pool
counters grow at a set demand; the profiles are ConfigMaps written by the
planner's own `profile_configmap`. What the controller should answer comes
from the pure solver on the same profiles and demand."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from prometheus_client import generate_latest

from operators.planner.profiles import profile_configmap
from operators.planner.solver import Demand, Problem, solve
from services.router.metrics import RouterMetrics
from tests.kube.plugin import running_operator, wait_for
from tests.planner.synthetic import ramp_profile

PREFILL = ramp_profile("prefill-test", "prefill", 28.0)
DECODE = ramp_profile("decode-test", "decode", 65.0)
INPUT_TOKENS, OUTPUT_TOKENS, HIT_RATE = 2000.0, 200.0, 0.25
# Inside the band (70-84 req/s) where the plan stays 3P:2D, so that the jitter
# of the measured windows (timed by the operator's clock, the counters by the
# test's) cannot change the answer.
DEMAND_RPS = 77.0
TD = "demo"


def expected(rps: float = DEMAND_RPS, budget: int | None = None) -> dict[str, int]:
    decision = solve(
        Problem(
            profiles=(PREFILL, DECODE),
            demand=Demand(rps, INPUT_TOKENS, OUTPUT_TOKENS, HIT_RATE),
            headroom=1.2,
            budget_gpus=budget,
        )
    )
    return {p.role: p.replicas for p in decision.plan.pools}


class RouterStandIn:
    """A router's /metrics whose pool counters grow at `rps` requests/s of the
    set shape from the moment it starts; `failing` answers 500."""

    def __init__(self, rps: float) -> None:
        self.rps = rps
        self.failing = False
        self.metrics = RouterMetrics()
        self.started = self.counted = time.time()
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/metrics" or stand_in.failing:
                    self.send_error(500 if stand_in.failing else 404)
                    return
                body = stand_in.exposition()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exposition(self) -> bytes:
        with self.lock:
            now = time.time()
            n, self.counted = self.rps * (now - self.counted), now
            m = self.metrics
            m.pool_prompts.labels("prefill").inc(n)
            m.pool_prompt_tokens.labels("prefill").inc(n * INPUT_TOKENS)
            m.pool_cached_tokens.labels("prefill").inc(n * INPUT_TOKENS * HIT_RATE)
            m.pool_busy.labels("prefill").inc(n * 0.3)
            m.pool_generations.labels("decode").inc(n)
            m.pool_output_tokens.labels("decode").inc(n * OUTPUT_TOKENS)
            m.pool_busy.labels("decode").inc(n * 3.0)
            return generate_latest(m.registry)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def router():
    stand_in = RouterStandIn(DEMAND_RPS)
    yield stand_in
    stand_in.stop()


@pytest.fixture
def operator(kube_api, tmp_path):
    with running_operator(kube_api, tmp_path, scaling=1.0) as proc:
        yield proc


def install_cluster(kube_api, router: RouterStandIn) -> None:
    """The profiles' ConfigMaps and one router pod at the stand-in's address."""
    kube_api.install(
        profile_configmap(PREFILL, "prefill-test", "default"),
        profile_configmap(DECODE, "decode-test", "default"),
    )
    kube_api.install(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{TD}-router-0",
                "namespace": "default",
                "labels": {"tandem.dev/deployment": TD, "app.kubernetes.io/component": "router"},
            },
            "spec": {
                "containers": [
                    {
                        "name": "router",
                        "image": "tandem:test",
                        "ports": [{"name": "http", "containerPort": router.port}],
                    }
                ]
            },
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
    )


def deployment(scaling: dict, prefill: dict | None = None, decode: dict | None = None) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "TandemDeployment",
            "metadata": {"name": TD},
            "spec": {
                "model": {"path": "/models/llama"},
                "prefill": {"replicas": 1, **(prefill or {})},
                "decode": {"replicas": 1, **(decode or {})},
                "scaling": {
                    "profiles": {"prefill": "prefill-test", "decode": "decode-test"},
                    **scaling,
                },
            },
        }
    )


def pool_replicas(kube_api) -> dict[str, int]:
    return {
        p["spec"]["role"]: p["spec"]["replicas"]
        for p in kube_api.list("tandem.dev", "v1alpha1", "enginepools", "default")
    }


def td_status(kube_api) -> dict:
    return kube_api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", TD).get(
        "status", {}
    )


def condition(kube_api, kind: str) -> dict:
    return next((c for c in td_status(kube_api).get("conditions", []) if c["type"] == kind), {})


def events(kube_api, reason: str) -> list[dict]:
    return [e for e in kube_api.list("", "v1", "events", "default") if e.get("reason") == reason]


def scaling_status(kube_api) -> dict:
    return td_status(kube_api).get("scaling", {})


def test_auto_scales_the_pools_to_the_solvers_answer(kube_api, kubectl, operator, router):
    want = expected()
    assert want == {"prefill": 3, "decode": 2}  # the band DEMAND_RPS sits in
    install_cluster(kube_api, router)
    kubectl(
        "create",
        "-f",
        "-",
        stdin=deployment({"mode": "Auto", "upCooldownSeconds": 0, "maxStep": 1}),
    )
    started = time.monotonic()
    wait_for(lambda: pool_replicas(kube_api) == want, 60, f"pools scaled to {want}")
    print(f"\nAuto: 1:1 -> {want} in {time.monotonic() - started:.1f}s")
    # The workloads follow the pools (the reconcile's side of the seam).
    wait_for(
        lambda: (
            kube_api.get("apps", "v1", "deployments", "default", f"{TD}-prefill")["spec"][
                "replicas"
            ]
            == want["prefill"]
        ),
        30,
        "prefill Deployment resized",
    )
    status = scaling_status(kube_api)
    assert status["mode"] == "Auto" and status["recommendation"] == "3:2"
    assert status["targets"] == want and status["binding"] == "demand"
    # Steps of at most maxStep: prefill went 1 -> 2 -> 3, never 1 -> 3.
    steps = [h["replicas"]["prefill"] for h in status["history"]]
    assert all(b - a <= 1 for a, b in zip([1, *steps], steps)), steps
    assert 2 in steps, steps
    decision = status["history"][-1]
    assert decision["demandRps"] == pytest.approx(DEMAND_RPS, rel=0.1)
    assert decision["hitRate"] == pytest.approx(HIT_RATE, rel=0.01)
    assert decision["meanInputTokens"] == pytest.approx(INPUT_TOKENS, rel=0.01)
    assert {p["role"] for p in status["pools"]} == {"prefill", "decode"}
    assert condition(kube_api, "ScalingSpecValid")["status"] == "True"
    # The tick that wrote 3:2 compared the pools deployed before it; the next, 3:2.
    wait_for(lambda: condition(kube_api, "DemandMet")["status"] == "True", 30, "DemandMet")
    assert condition(kube_api, "MetricsAvailable")["status"] == "True"
    assert events(kube_api, "Scaled"), "no Scaled event"
    wide = kubectl("get", "td", "-o", "wide").stdout.splitlines()
    assert "RECOMMENDED" in wide[0].split() and "3:2" in wide[1].split()

    # Demand falls: the target drops at once, the pools wait out the down window.
    router.rps = 20.0
    low = expected(20.0)
    assert low == {"prefill": 1, "decode": 1}
    wait_for(lambda: scaling_status(kube_api)["targets"] == low, 30, "the lower target")
    status = scaling_status(kube_api)
    assert pool_replicas(kube_api) == want and status["replicas"] == want
    assert any("waits for the target to stay lower" in h for h in status["held"]), status


def test_recommend_writes_status_only_and_off_leaves_the_pools(kube_api, kubectl, operator, router):
    want = expected()
    install_cluster(kube_api, router)
    kubectl("create", "-f", "-", stdin=deployment({"mode": "Recommend", "maxStep": 1}))
    wait_for(
        lambda: scaling_status(kube_api).get("targets") == want, 60, "a recommendation in status"
    )
    status = scaling_status(kube_api)
    # The target itself: maxStep paces what Auto writes, Recommend moves nothing.
    assert status["replicas"] == want
    assert status["recommendation"] == f"{want['prefill']}:{want['decode']}"
    recommended = {
        p["spec"]["role"]: p.get("status", {}).get("recommendedReplicas")
        for p in kube_api.list("tandem.dev", "v1alpha1", "enginepools", "default")
    }
    assert recommended == want
    # The deployed 1:1, not the plan, is compared with the demand.
    assert condition(kube_api, "DemandMet")["reason"] == "BelowDemand"
    # Several more decisions: the pools are never written, the recommendation
    # is posted once.
    decided = status["lastDecisionTime"]
    wait_for(lambda: len(scaling_status(kube_api)["history"]) >= 4, 30, "more decisions")
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}
    assert not events(kube_api, "Scaled")
    assert len(events(kube_api, "ScalingRecommended")) == 1
    assert decided <= scaling_status(kube_api)["lastDecisionTime"]

    kubectl("patch", "td", TD, "--type", "merge", "-p", '{"spec":{"scaling":{"mode":"Off"}}}')
    wait_for(
        lambda: condition(kube_api, "ScalingActive").get("reason") == "Off",
        30,
        "ScalingActive=False (Off)",
    )
    history = len(scaling_status(kube_api)["history"])
    time.sleep(3)  # three ticks of the timer
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}
    assert len(scaling_status(kube_api)["history"]) == history
    kubectl("scale", "enginepool/demo-decode", "--replicas", "5")
    time.sleep(3)
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 5}


def test_max_replicas_and_the_gpu_budget_bound_what_auto_writes(
    kube_api, kubectl, operator, router
):
    install_cluster(kube_api, router)
    # decode may not pass 1: the solver's 2 is held at 1 and the demand reported unmet.
    kubectl(
        "create",
        "-f",
        "-",
        stdin=deployment(
            {"mode": "Auto", "upCooldownSeconds": 0, "maxStep": 10}, decode={"maxReplicas": 1}
        ),
    )
    wait_for(
        lambda: pool_replicas(kube_api) == {"prefill": 3, "decode": 1},
        60,
        "decode held at maxReplicas",
    )
    wait_for(
        lambda: condition(kube_api, "DemandMet").get("reason") == "MaxReplicas",
        30,
        "DemandMet=False (MaxReplicas)",
    )
    assert "raise maxReplicas" in condition(kube_api, "DemandMet")["message"]
    assert events(kube_api, "MaxReplicas")

    # A budget of 3 GPUs: the budget-bound plan, shrinking at once (a budget cut).
    want = expected(budget=3)
    assert want == {"prefill": 2, "decode": 1}
    kubectl("patch", "td", TD, "--type", "merge", "-p", '{"spec":{"scaling":{"gpuBudget":3}}}')
    wait_for(lambda: pool_replicas(kube_api) == want, 60, f"budget plan {want}")
    wait_for(
        lambda: condition(kube_api, "DemandMet").get("reason") == "BudgetBound",
        30,
        "DemandMet=False (BudgetBound)",
    )
    time.sleep(2)  # later decisions stay within the budget
    assert pool_replicas(kube_api) == want
    assert scaling_status(kube_api)["history"][-1]["replicas"] == want


def test_a_metrics_scrape_failure_is_a_condition_not_a_crash(kube_api, kubectl, operator, router):
    install_cluster(kube_api, router)
    router.failing = True
    kubectl("create", "-f", "-", stdin=deployment({"mode": "Auto", "upCooldownSeconds": 0}))
    wait_for(
        lambda: condition(kube_api, "MetricsAvailable").get("reason") == "ScrapeFailed",
        60,
        "MetricsAvailable=False (ScrapeFailed)",
    )
    message = condition(kube_api, "MetricsAvailable")["message"]
    assert f"127.0.0.1:{router.port}" in message and "500" in message
    assert events(kube_api, "MetricsUnavailable")
    time.sleep(3)
    assert operator.proc.poll() is None
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}  # holds without metrics
    # The router answers again: decisions resume.
    router.failing = False
    wait_for(lambda: pool_replicas(kube_api) == expected(), 60, "scaled once metrics are back")
    assert condition(kube_api, "MetricsAvailable")["status"] == "True"


def test_a_missing_profile_is_a_condition_that_says_what_to_write(
    kube_api, kubectl, operator, router
):
    install_cluster(kube_api, router)
    kubectl(
        "create",
        "-f",
        "-",
        stdin=deployment(
            {"mode": "Auto", "profiles": {"prefill": "prefill-test", "decode": "no-such-profile"}}
        ),
    )
    wait_for(
        lambda: condition(kube_api, "ScalingSpecValid").get("status") == "False",
        60,
        "ScalingSpecValid=False",
    )
    message = condition(kube_api, "ScalingSpecValid")["message"]
    assert "ConfigMap no-such-profile" in message and "tandem profile --role decode" in message
    assert events(kube_api, "ScalingSpecInvalid")
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}
    # No profiles named at all: the condition says which to set; the rest still runs.
    kubectl("patch", "td", TD, "--type", "merge", "-p", '{"spec":{"scaling":{"profiles":null}}}')
    wait_for(
        lambda: (
            "scaling.profiles.prefill is not set"
            in condition(kube_api, "ScalingSpecValid").get("message", "")
        ),
        30,
        "ScalingSpecValid names the missing profiles",
    )
    assert len(events(kube_api, "ScalingSpecInvalid")) >= 2
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}
    assert kube_api.get("apps", "v1", "deployments", "default", f"{TD}-decode")
    # Profiles back, and a TTFT SLO no profile meets: the condition says what would.
    kubectl(
        "patch",
        "td",
        TD,
        "--type",
        "merge",
        "-p",
        json.dumps(
            {
                "spec": {
                    "scaling": {
                        "profiles": {"prefill": "prefill-test", "decode": "decode-test"},
                        "slo": {"ttftP90Ms": 10},
                    }
                }
            }
        ),
    )
    wait_for(
        lambda: condition(kube_api, "ScalingSpecValid").get("reason") == "SloUnattainable",
        30,
        "ScalingSpecValid=False (SloUnattainable)",
    )
    assert "ttft" in condition(kube_api, "ScalingSpecValid")["message"].lower()
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}


def test_a_context_the_pools_cannot_hold_is_a_condition_and_an_event_saying_what_to_change(
    kube_api, kubectl, operator, router
):
    install_cluster(kube_api, router)
    # The seed's GLM-5.3 figures: a 1M-token context on one GPU per replica.
    kubectl(
        "create",
        "-f",
        "-",
        stdin=deployment(
            {
                "mode": "Auto",
                "upCooldownSeconds": 0,
                "maxStep": 10,
                "slo": {"longestContextTokens": 2**20},
                "capacity": {
                    "layers": 95,
                    "kvKind": "mla",
                    "kvBytes": 1,
                    "latentDim": 576,
                    "gpuFreeGiB": 15,
                },
            }
        ),
    )
    wait_for(
        lambda: condition(kube_api, "ScalingSpecValid").get("reason") == "ContextDoesNotFit",
        60,
        "ScalingSpecValid=False (ContextDoesNotFit)",
    )
    message = condition(kube_api, "ScalingSpecValid")["message"]
    for role in ("prefill", "decode"):
        assert (
            f"the {role} pool cannot hold scaling.slo.longestContextTokens: persistent KV "
            f"53.4 GiB per GPU" in message
        )
        assert (
            f"PCP4 (4 GPUs per replica) brings persistent KV to 13.4 GiB per GPU and fits: "
            f"set it in spec.{role}.parallelism" in message
        )
    [event] = events(kube_api, "ScalingSpecInvalid")
    assert event["type"] == "Warning" and event["message"] == message
    assert pool_replicas(kube_api) == {"prefill": 1, "decode": 1}
    # A context that fits: the controller plans again.
    kubectl(
        "patch",
        "td",
        TD,
        "--type",
        "merge",
        "-p",
        '{"spec":{"scaling":{"slo":{"longestContextTokens":32768}}}}',
    )
    wait_for(
        lambda: condition(kube_api, "ScalingSpecValid").get("status") == "True",
        60,
        "ScalingSpecValid=True",
    )
    wait_for(lambda: pool_replicas(kube_api) == expected(), 60, f"pools at {expected()}")


@pytest.mark.parametrize(
    "scaling,fragment",
    [
        ({"slo": {"longestContextTokens": 8192}}, "longestContextTokens exceeds model.maxModelLen"),
        ({"upCooldownSeconds": 900}, "downCooldownSeconds must be at least"),
        ({"slo": {"itlP90Ms": 40, "interactivityP90": 25}}, "itlP90Ms or interactivityP90"),
        ({"headroom": 0.5}, "spec.scaling.headroom"),
        ({"prometheus": {"url": "prometheus:9090"}}, "spec.scaling.prometheus.url"),
    ],
)
def test_the_crd_refuses_scaling_fields_that_contradict_each_other(
    kube_api, kubectl, scaling, fragment
):
    refused = kubectl(
        "create",
        "-f",
        "-",
        check=False,
        stdin=yaml.safe_dump(
            {
                "apiVersion": "tandem.dev/v1alpha1",
                "kind": "TandemDeployment",
                "metadata": {"name": TD},
                "spec": {
                    "model": {"path": "/m", "maxModelLen": 4096},
                    "prefill": {},
                    "decode": {},
                    "scaling": {"mode": "Auto", **scaling},
                },
            }
        ),
    )
    assert refused.returncode != 0
    assert fragment in refused.stderr, refused.stderr


def test_auto_leaves_a_pool_an_hpa_scales_to_the_hpa(kube_api, kubectl, operator, router):
    install_cluster(kube_api, router)
    kube_api.install(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "decode-hpa", "namespace": "default"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "tandem.dev/v1alpha1",
                    "kind": "EnginePool",
                    "name": f"{TD}-decode",
                },
                "minReplicas": 1,
                "maxReplicas": 4,
            },
        }
    )
    kubectl(
        "create",
        "-f",
        "-",
        stdin=deployment({"mode": "Auto", "upCooldownSeconds": 0, "maxStep": 10}),
    )
    wait_for(
        lambda: pool_replicas(kube_api).get("prefill") == expected()["prefill"],
        60,
        "prefill scaled",
    )
    time.sleep(2)
    assert pool_replicas(kube_api)["decode"] == 1  # the HPA's, not written by the controller
    status = scaling_status(kube_api)
    assert status["targets"]["decode"] == expected()["decode"]
    assert any("decode" in h and "autoscaler" in h for h in status["held"]), status["held"]
    assert all("decode" not in e["message"] for e in events(kube_api, "Scaled"))


def test_a_fixed_spec_clears_spec_valid_at_once_without_metrics(kube_api, kubectl, tmp_path):
    # No router to scrape and no tick in the test's time: only the spec change acts.
    kube_api.install(
        profile_configmap(PREFILL, "prefill-test", "default"),
        profile_configmap(DECODE, "decode-test", "default"),
    )
    with running_operator(kube_api, tmp_path, scaling=600.0):
        kubectl(
            "create",
            "-f",
            "-",
            stdin=deployment(
                {
                    "mode": "Recommend",
                    "slo": {"longestContextTokens": 2**20},
                    "capacity": {
                        "layers": 95,
                        "kvKind": "mla",
                        "kvBytes": 1,
                        "latentDim": 576,
                        "gpuFreeGiB": 15,
                    },
                }
            ),
        )
        wait_for(
            lambda: condition(kube_api, "ScalingSpecValid").get("reason") == "ContextDoesNotFit",
            60,
            "ScalingSpecValid=False (ContextDoesNotFit)",
        )
        kubectl(
            "patch",
            "td",
            TD,
            "--type",
            "merge",
            "-p",
            '{"spec":{"scaling":{"slo":{"longestContextTokens":32768}}}}',
        )
        valid = wait_for(
            lambda: (
                condition(kube_api, "ScalingSpecValid").get("status") == "True"
                and condition(kube_api, "ScalingSpecValid")
            ),
            60,
            "ScalingSpecValid=True",
        )
        assert valid["observedGeneration"] == 2
        wait_for(lambda: td_status(kube_api).get("observedGeneration") == 2, 30, "generation 2")
