"""Pytest fixtures for control-plane tests against the fake API server.

Import the ones a test folder needs from its conftest.py:

    from tests.kube.plugin import kube_api, kubectl  # noqa: F401

* `kube_api` — a fresh `RunningApiServer` (devcluster/apiserver.py) on loopback
  with Tandem's CRDs (operators/crds/) installed and a kubeconfig written
  (`kube_api.kubeconfig`); read and write it over HTTP, or directly with
  `kube_api.get/list/install/call`.
* `kube_api_with_controllers` — the same with devcluster's controllers
  running (Deployments get ReplicaSets and pods, Services EndpointSlices; no
  kubelet: a test writes pod status itself). `kube_api` runs none, since
  most tests write objects and expect nothing to act on them.
* `kubectl` — runs the real `kubectl` against it: `kubectl("get", "td")` returns
  the CompletedProcess; `check=False` lets a test look at a refusal.
* `start_operator(kube_api, tmp_path)` starts `python -m operators` against it
  (a real process, stopped by the returned handle's `stop()`); with
  `namespace="x"` it watches that namespace only, as the chart runs it;
  a short Lease (`TEST_LEASE`); `args` adds flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from common.ports import free_ports
from devcluster.apiserver import RunningApiServer
from devcluster.client import kubectl_binary

REPO = Path(__file__).resolve().parents[2]
CRDS = sorted((REPO / "operators" / "crds").glob("*.yaml"))


@contextmanager
def _api_server(tmp_path: Path, controllers: bool) -> Iterator[RunningApiServer]:
    server = RunningApiServer(bookmark_interval=0.5, controllers=controllers).start()
    try:
        server.install_files(*CRDS)
        server.kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube_api(tmp_path: Path) -> Iterator[RunningApiServer]:
    with _api_server(tmp_path, controllers=False) as server:
        yield server


@pytest.fixture
def kube_api_with_controllers(tmp_path: Path) -> Iterator[RunningApiServer]:
    with _api_server(tmp_path, controllers=True) as server:
        yield server


@pytest.fixture
def kubectl(kube_api: RunningApiServer) -> Callable[..., subprocess.CompletedProcess]:
    binary = kubectl_binary()

    def run(
        *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            # A cache per server: kubectl keeps discovery per host:port for
            # hours, and a later fake server on a reused port serves other kinds.
            [
                binary,
                "--kubeconfig",
                str(kube_api.kubeconfig),
                "--cache-dir",
                str(kube_api.kubeconfig.parent / "kubectl-cache"),
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    return run


class OperatorProcess:
    def __init__(
        self, proc: subprocess.Popen, log: Path, health_port: int, metrics_port: int
    ) -> None:
        self.proc = proc
        self.log = log
        self.health_url = f"http://127.0.0.1:{health_port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def reconciles(self) -> int:
        """Reconcile passes finished so far (tandem_operator_reconciles_total, any result)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=30).text
        return int(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "tandem_operator_reconciles"
                for sample in family.samples
                if sample.name.endswith("_total")
            )
        )

    def leading(self) -> bool:
        """Whether this replica holds the operator's Lease (tandem_operator_leader)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(self.metrics_url, timeout=5).text
        except httpx.HTTPError:
            return False
        return any(
            sample.value == 1
            for family in text_string_to_metric_families(text)
            if family.name == "tandem_operator_leader"
            for sample in family.samples
        )

    def wait_passes(self, count: int = 2, timeout: float = 120.0) -> None:
        """Until `count` more reconcile passes have finished. Passes of one
        deployment run one at a time, so with count >= 2 at least one whole
        pass began after this call: what the caller did before is seen."""
        target = self.reconciles() + count
        wait_for(
            lambda: self.reconciles() >= target,
            timeout,
            f"{count} reconcile passes of the operator",
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until kopf's liveness endpoint answers (the operator is watching)."""
        import httpx

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the operator exited: {self.output()[-3000:]}")
            try:
                return httpx.get(self.health_url, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout, "the operator's liveness endpoint")

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


# Tests stop and restart operators often: a short Lease, so the next one leads
# within seconds of a SIGKILLed one (the defaults would take 15 s).
TEST_LEASE = (
    "--lease-duration-seconds",
    "3",
    "--lease-renew-deadline-seconds",
    "2",
    "--lease-retry-seconds",
    "0.5",
)


def start_operator(
    api: RunningApiServer,
    tmp_path: Path,
    resync: float = 2.0,
    name: str = "operator",
    scaling: float = 15.0,
    namespace: str | None = None,
    args: tuple[str, ...] = (),
) -> OperatorProcess:
    log = tmp_path / f"{name}.log"
    health_port, metrics_port = free_ports(2)
    env = dict(os.environ, KUBECONFIG=str(api.kubeconfig), TANDEM_LOG_LEVEL="INFO")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "operators",
            "--health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--resync-seconds",
            str(resync),
            "--scaling-seconds",
            str(scaling),
            *([] if namespace is None else ["--namespace", namespace]),
            *TEST_LEASE,
            *args,
        ],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return OperatorProcess(proc, log, health_port, metrics_port)


@contextmanager
def running_operator(
    api: RunningApiServer, tmp_path: Path, **kwargs: Any
) -> Iterator[OperatorProcess]:
    """``start_operator``, ready; stopped after. Its log is printed on the way
    out (pytest shows it only for a failed test: what the operator did)."""
    proc = start_operator(api, tmp_path, **kwargs)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        print(f"\n--- operator log (exit {proc.proc.returncode}) ---\n{proc.output()[-20000:]}")


def wait_for(
    predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition"
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
