"""`python -m devcluster` as a user starts it: a real process, the real kubectl
against the kubeconfig it writes, SIGTERM to stop it. No mocks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.kube.plugin import REPO, kubectl_binary, wait_for

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: c, image: nginx:1.27}]}
"""


def test_help_says_what_it_is():
    out = subprocess.run(
        [sys.executable, "-m", "devcluster", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "a test bed, NOT a Kubernetes" in out and "--port" in out and "SIGTERM" in out


def test_it_serves_kubectl_until_sigterm(tmp_path: Path):
    proc = subprocess.Popen(
        # The API alone: test_kubelet.py runs the pods (on a bridge of its own).
        [
            sys.executable,
            "-m",
            "devcluster",
            "--state-dir",
            str(tmp_path),
            "--namespace",
            "team-a",
            "--no-kubelet",
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any(line.startswith("  export KUBECONFIG=") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"exited early: {''.join(lines)}"
            assert time.monotonic() < deadline, f"no kubeconfig printed: {''.join(lines)}"
            lines.append(line)
        printed = "".join(lines)
        match = re.search(r"export KUBECONFIG=(\S+)", printed)
        assert match is not None
        kubeconfig = Path(match.group(1))
        assert kubeconfig == tmp_path / "kubeconfig" and kubeconfig.exists()
        assert "not a Kubernetes" in printed

        def kubectl(*args: str) -> str:
            return subprocess.run(
                [kubectl_binary(), *args],
                env=dict(os.environ, KUBECONFIG=str(kubeconfig), KUBECACHEDIR=str(tmp_path / "kc")),
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout

        namespaces = {line.split()[0] for line in kubectl("get", "ns").splitlines()[1:]}
        assert {"default", "team-a"} <= namespaces
        assert "tandemdeployments.tandem.dev" in kubectl("get", "crd")
        # The kubeconfig's context is the namespace asked for.
        assert (
            "No resources found in team-a namespace"
            in subprocess.run(
                [kubectl_binary(), "get", "td"],
                env=dict(os.environ, KUBECONFIG=str(kubeconfig), KUBECACHEDIR=str(tmp_path / "kc")),
                capture_output=True,
                text=True,
                timeout=60,
            ).stderr
        )

        # The controllers run: a Deployment gets a pod bound to the node.
        subprocess.run(
            [kubectl_binary(), "create", "-f", "-"],
            input=DEPLOYMENT,
            env=dict(os.environ, KUBECONFIG=str(kubeconfig), KUBECACHEDIR=str(tmp_path / "kc")),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        wait_for(
            lambda: kubectl("get", "pods", "-o", "name").startswith("pod/web-"),
            30,
            "a pod for the Deployment",
        )
        assert kubectl("get", "nodes", "-o", "name").split() == ["node/devcluster-node"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert "devcluster: stopped" in proc.stdout.read()
        assert not kubeconfig.exists()  # it pointed at a server that is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
