"""The operator in the chart's default mode (`--namespace=<ns>`: it watches one
namespace) as a real process against the local API server, with the real
kubectl. No mocks."""

from __future__ import annotations

from tests.kube.plugin import running_operator, wait_for

TD = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: demo, namespace: team-a}
spec:
  model: {path: /models/llama}
  prefill: {replicas: 1}
  decode: {replicas: 1}
"""


def test_the_operator_watching_one_namespace_reconciles_there(kube_api, kubectl, tmp_path):
    kubectl("create", "namespace", "team-a")
    kubectl("create", "-f", "-", stdin=TD)
    kubectl("create", "-f", "-", stdin=TD.replace("team-a", "default"))
    with running_operator(kube_api, tmp_path, namespace="team-a") as operator:

        def routers(namespace: str) -> list[str]:
            return [
                d["metadata"]["name"]
                for d in kube_api.list("apps", "v1", "deployments", namespace)
                if d["metadata"]["name"] == "demo-router"
            ]

        wait_for(lambda: routers("team-a"), 60, "the router Deployment in team-a")
        status = wait_for(
            lambda: kube_api.get(
                "tandem.dev", "v1alpha1", "tandemdeployments", "team-a", "demo"
            ).get("status"),
            60,
            "the TandemDeployment's status in team-a",
        )
        assert status["observedGeneration"] == 1
        operator.wait_passes()
        assert routers("default") == []  # outside its namespace: left alone
        assert "Traceback" not in operator.output()
