"""The local cluster (devcluster/) as its tests drive it: `tandem cluster up`
and `down`, the real kubectl for what a user does, and the API server read
over plain HTTP for what a test polls (one kubectl process per poll costs
seconds of CPU on a loaded machine, and kubectl's own 120 s were seen to run
out there). Starting one needs root (the process kubelet makes network
namespaces): without it `up` fails, and the test with it, naming why."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.harness import tandem_cli
from tests.kube.plugin import kubectl_binary

# kubectl and `tandem cluster` steps: ample for a machine under a load of 50+.
COMMAND_TIMEOUT_S = 300.0


def up(state: Path, bridge: str, pod_cidr: str) -> LocalCluster:
    """`tandem cluster up` on a bridge and addresses of the caller's own (a
    user's cluster and other tests may run beside it); fails with its error."""
    started = tandem_cli(
        "cluster",
        "up",
        "--state-dir",
        str(state),
        "--bridge",
        bridge,
        "--pod-cidr",
        pod_cidr,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert started.returncode == 0, f"tandem cluster up failed:\n{started.stderr}"
    return LocalCluster(state)


def down(state: Path) -> subprocess.CompletedProcess:
    return tandem_cli("cluster", "down", "--state-dir", str(state), timeout=COMMAND_TIMEOUT_S)


class LocalCluster:
    """A running local cluster: kubectl (in `namespace` when given), its API
    server over HTTP, the loopback ports of its Services, its log."""

    def __init__(self, state: Path, namespace: str = "default") -> None:
        self.state = state
        self.namespace = namespace
        self.kubeconfig = state / "kubeconfig"
        config = yaml.safe_load(self.kubeconfig.read_text())
        self.api = httpx.Client(
            base_url=config["clusters"][0]["cluster"]["server"], timeout=COMMAND_TIMEOUT_S
        )

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        """kubectl's output; with `check`, a failure fails the test with its error."""
        result = subprocess.run(
            [kubectl_binary(), "--cache-dir", str(self.state / "kc"), "-n", self.namespace, *args],
            env=dict(os.environ, KUBECONFIG=str(self.kubeconfig)),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def get(self, path: str, api: str = "/api/v1", **params: str) -> dict | None:
        """`path` in the namespace (e.g. "pods/x"; `api` "/apis/tandem.dev/v1alpha1"
        for a custom resource); None when it is not there."""
        response = self.api.get(f"{api}/namespaces/{self.namespace}/{path}", params=params)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def pod(self, name: str) -> dict | None:
        return self.get(f"pods/{name}")

    def pods(self, selector: str = "") -> list[dict]:
        found = self.get("pods", **({"labelSelector": selector} if selector else {}))
        return (found or {}).get("items", [])

    def services(self) -> dict:
        """The loopback port of each Service port and Ingress, as the kubelet wrote them."""
        try:
            return json.loads((self.state / "services.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def log(self) -> str:
        return (self.state / "devcluster.log").read_text(errors="replace")

    def wait(self, what: Callable[[], object], timeout: float = 20.0, name: str = "") -> object:
        """`what()` once it is true; on timeout the test fails with the pods and the log."""
        deadline = time.monotonic() + timeout
        while not (result := what()):
            if time.monotonic() > deadline:
                pods = self.kubectl("get", "pods", "-o", "wide", check=False)
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {name or what}\n{pods}\n"
                    f"--- devcluster log ---\n{self.log()[-5000:]}"
                )
            time.sleep(0.5)
        return result

    def close(self) -> None:
        self.api.close()


def cluster_fixture(bridge: str, pod_cidr: str, scope: str = "function") -> Any:
    """A pytest fixture (assign it to a module-level name) that brings a local
    cluster up on the bridge and addresses of its test module's own (a user's
    cluster and other tests may run beside it) and down afterwards."""

    @pytest.fixture(scope=scope)
    def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        state = tmp_path_factory.mktemp("cluster")
        try:
            running = up(state, bridge, pod_cidr)
            yield running
            running.close()
        finally:
            down(state)

    return cluster
