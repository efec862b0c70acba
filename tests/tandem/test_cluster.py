"""`tandem cluster up|status|down` as a user runs them: real processes, the
real kubectl against the kubeconfig `up` prints. No mocks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.harness import tandem_cli
from common.procs import Proc
from tests.kube.plugin import kubectl_binary


def tandem(*args: str) -> subprocess.CompletedProcess:
    return tandem_cli(*args, timeout=180)


def test_up_without_controllers(tmp_path: Path):
    state = ["--state-dir", str(tmp_path)]
    up = tandem("cluster", "up", "--no-controllers", "--no-kubelet", *state)
    try:
        assert up.returncode == 0, up.stderr
        nodes = subprocess.run(
            [kubectl_binary(), "get", "nodes", "-o", "name"],
            env=dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig")),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert nodes == []
        log = json.loads((tmp_path / "cluster.json").read_text())["log"]
        assert "controllers off" in Path(log).read_text()
    finally:
        assert tandem("cluster", "down", *state).returncode == 0


def test_up_status_down(tmp_path: Path):
    state = ["--state-dir", str(tmp_path)]
    # The API alone: tests/devcluster/test_kubelet.py runs pods through `up`.
    up = tandem("cluster", "up", *state, "--no-kubelet")
    try:
        assert up.returncode == 0, up.stderr
        assert "not a Kubernetes" in up.stdout
        assert f"export KUBECONFIG={tmp_path / 'kubeconfig'}" in up.stdout
        pid = json.loads((tmp_path / "cluster.json").read_text())["pid"]

        names = subprocess.run(
            [kubectl_binary(), "get", "ns", "-o", "name"],
            env=dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig")),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert "namespace/default" in names
        nodes = subprocess.run(
            [kubectl_binary(), "get", "nodes", "-o", "name"],
            env=dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig")),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert nodes == ["node/devcluster-node"]  # the controllers run

        status = tandem("cluster", "status", *state)
        assert status.returncode == 0 and "v1.32" in status.stdout
        again = tandem("cluster", "up", *state)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = tandem("cluster", "down", *state)
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not Proc(name="devcluster", argv=[], log="", pid=pid).alive()
    assert not (tmp_path / "cluster.json").exists()
    assert not (tmp_path / "kubeconfig").exists()
    assert tandem("cluster", "status", *state).returncode == 1
