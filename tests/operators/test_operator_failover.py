"""Two operator replicas (`python -m operators`, real processes, leader
election over a Lease) against the fake API server; the leader is SIGKILLed
at exact points of its work and the standby finishes it.

The kill points are writes: the test watches the fake API server's commits
in process and kills the leader the moment a chosen write lands, before the
leader sees the answer. No kube-controller-manager runs, so the test plays
the ReplicaSet controller's part (it removes the pod with the lowest
controller.kubernetes.io/pod-deletion-cost once the Deployment shrinks) and
serves one router's /metrics (the loads the deletion costs come from).

Last, the API server goes away: the leader, unable to renew its Lease,
exits non-zero.

Measured (printed): leader SIGKILL → the standby leads, and → the drain
resumed (the Deployment shrunk by the new leader).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from devcluster.store import Subscription
from operators import manifests
from operators.controller import SCALE_DOWN, scale_down_record
from operators.drain import LIVE_BLOCKS_METRIC
from operators.handlers import OWNED
from operators.reconcile import RENDERED_HASH
from operators.spec import parse, with_defaults
from tests.kube.plugin import start_operator, wait_for

pytestmark = pytest.mark.timeout(240)

TD = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: demo}
spec:
  model: {path: /models/llama}
  prefill: {replicas: 1}
  decode: {replicas: 3}
"""
HOST = "127.0.0.1"
DECODE_PODS = {"demo-decode-a": 50071, "demo-decode-b": 50072, "demo-decode-c": 50073}


class KillOn:
    """SIGKILLs a process the moment a write matching `when` is committed (in
    the fake API server's loop, before its answer goes out)."""

    def __init__(self, kube_api, plural: tuple[str, str, str], when, pid: int) -> None:
        self.when, self.pid = when, pid
        self.killed_at: float | None = None
        self.api = kube_api
        self.sub = Subscription(kube_api.store.kind(*plural), queue=self)  # type: ignore[arg-type]
        kube_api.call(kube_api.store.subscriptions.add, self.sub)

    def put_nowait(self, event) -> None:
        if self.killed_at is None and self.when(event):
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()

    def remove(self) -> None:
        self.api.call(self.api.store.subscriptions.discard, self.sub)


def router_metrics(live_blocks: dict[str, int]) -> str:
    """A router's exposition of the live session blocks per engine address."""
    lines = [f"# TYPE {LIVE_BLOCKS_METRIC} gauge"]
    lines += [f'{LIVE_BLOCKS_METRIC}{{pod="{pod}"}} {n}' for pod, n in live_blocks.items()]
    return "\n".join(lines) + "\n"


class Router:
    """One router's /metrics: per engine address, the live session blocks.
    Counts the scrapes."""

    def __init__(self) -> None:
        self.live_blocks: dict[str, int] = {}
        self.scrapes = 0
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                router.scrapes += 1
                body = router_metrics(router.live_blocks).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def create_pod(kube_api, name: str, labels: dict, ports: dict[str, int]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "tandem",
                    "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
                }
            ]
        },
        "status": {"phase": "Running", "podIP": HOST, "podIPs": [{"ip": HOST}]},
    }
    kind = kube_api.store.kind("", "v1", "pods")
    kube_api.call(lambda: kube_api.store.create(kind, "default", pod))


def deployment(kube_api, name: str) -> dict | None:
    found = [
        d
        for d in kube_api.list("apps", "v1", "deployments", "default")
        if d["metadata"]["name"] == name
    ]
    return found[0] if found else None


def pool(kube_api) -> dict:
    return kube_api.get("tandem.dev", "v1alpha1", "enginepools", "default", "demo-decode")


def events(kube_api, reason: str, message: str = "") -> list[dict]:
    return [
        e
        for e in kube_api.list("", "v1", "events", "default")
        if e.get("reason") == reason and message in e.get("message", "")
    ]


def owned(kube_api) -> dict[tuple[str, str], dict]:
    """Every object the operator made for `demo`, by (kind, name)."""
    selector = (
        f"{manifests.LABEL_DEPLOYMENT}=demo,app.kubernetes.io/managed-by={manifests.MANAGED_BY}"
    )
    kinds = [*OWNED, ("tandem.dev", "v1alpha1", "enginepools")]
    out: dict[tuple[str, str], dict] = {}
    for key in kinds:
        for obj in kube_api.list(*key, "default", selector):
            ref = (obj["kind"], obj["metadata"]["name"])
            assert ref not in out, f"{ref} twice"
            out[ref] = obj
    return out


def rendered(td: dict) -> set[tuple[str, str]]:
    """(kind, name) of every object the operator renders for the TandemDeployment."""
    spec = parse(with_defaults(td["spec"]))
    owner = manifests.Owner("TandemDeployment", "demo", td["metadata"]["uid"])
    objs = manifests.shared_objects("demo", "default", spec, owner)
    objs += manifests.engine_pools("demo", "default", spec, owner)
    for role in spec.roles:
        objs += manifests.pool_workload("demo", "default", spec, role, 1, owner)
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def leader_of(*replicas):
    return wait_for(
        lambda: next((r for r in replicas if r.proc.poll() is None and r.leading()), None),
        60,
        "a leader",
    )


def test_leader_killed_mid_reconcile_then_mid_scale_down(kube_api, kubectl, tmp_path):
    # Three replicas: one leads, two stand by (one per kill).
    replicas = [start_operator(kube_api, tmp_path, name=f"op-{n}") for n in "abc"]
    router = Router()
    try:
        for r in replicas:
            r.wait_ready()
        first = leader_of(*replicas)
        assert sum(r.leading() for r in replicas) == 1

        # 1. Killed mid-reconcile: the moment its second Deployment is created.
        created: list[str] = []

        def second_deployment(event) -> bool:
            if event.type == "ADDED":
                created.append(event.obj["metadata"]["name"])
            return len(created) == 2

        hook = KillOn(kube_api, ("apps", "v1", "deployments"), second_deployment, first.proc.pid)
        kubectl("create", "-f", "-", stdin=TD)
        wait_for(lambda: hook.killed_at, 60, "the first kill")
        hook.remove()
        killed = hook.killed_at
        half_made = sorted(owned(kube_api))
        second = leader_of(*replicas)
        assert second is not first
        print(
            f"\nkilled mid-reconcile with {len(half_made)} objects made; standby leads "
            f"{time.monotonic() - killed:.2f}s after the SIGKILL"
        )
        td = kube_api.get("tandem.dev", "v1alpha1", "tandemdeployments", "default", "demo")
        want = rendered(td)
        wait_for(lambda: set(owned(kube_api)) == want, 60, "every object made")

        def versions() -> dict:
            return {ref: o["metadata"]["resourceVersion"] for ref, o in owned(kube_api).items()}

        def settled() -> bool:
            before = versions()
            second.wait_passes()  # a whole pass that changed nothing
            return versions() == before

        wait_for(settled, 90, "a pass that changes nothing")
        now = owned(kube_api)
        assert all(RENDERED_HASH in o["metadata"]["annotations"] for o in now.values())
        assert len(half_made) < len(want)

        # 2. Killed mid-scale-down: the moment it records the deletion costs as set,
        # before the Deployment shrinks.
        labels = manifests.pool_selector("demo", "decode")
        for name, port in DECODE_PODS.items():
            create_pod(kube_api, name, labels, {"grpc": port})
        create_pod(
            kube_api,
            "demo-router-0",
            {manifests.LABEL_DEPLOYMENT: "demo", manifests.LABEL_COMPONENT: "router"},
            {"http": router.port},
        )
        # b is cheapest now (fewest live blocks); should anyone ask again later,
        # a would be.
        router.live_blocks = {f"{HOST}:50071": 50, f"{HOST}:50072": 5, f"{HOST}:50073": 90}

        def costs_recorded(event) -> bool:
            record = scale_down_record(event.obj) or {}
            return bool(record.get("costsSet"))

        hook = KillOn(
            kube_api, ("tandem.dev", "v1alpha1", "enginepools"), costs_recorded, second.proc.pid
        )
        kubectl("scale", "enginepool/demo-decode", "--replicas", "2")
        wait_for(lambda: hook.killed_at, 60, "the second kill")
        hook.remove()
        killed = hook.killed_at
        router.live_blocks = {f"{HOST}:50071": 0, f"{HOST}:50072": 500, f"{HOST}:50073": 90}
        assert deployment(kube_api, "demo-decode")["spec"]["replicas"] == 3
        third = leader_of(*replicas)
        assert third not in (first, second)
        leads = time.monotonic() - killed
        wait_for(
            lambda: deployment(kube_api, "demo-decode")["spec"]["replicas"] == 2, 60, "the shrink"
        )
        resumed = time.monotonic() - killed
        print(
            f"killed mid-scale-down; standby leads {leads:.2f}s after the SIGKILL, "
            f"the drain resumed (Deployment shrunk) {resumed:.2f}s after it"
        )

        # The ReplicaSet controller's part: the cheapest pod goes.
        pods = {
            p["metadata"]["name"]: int(p["metadata"]["annotations"][manifests.DELETION_COST])
            for p in kube_api.list("", "v1", "pods", "default", "tandem.dev/role=decode")
        }
        assert pods == {"demo-decode-a": 50, "demo-decode-b": 5, "demo-decode-c": 90}
        kind = kube_api.store.kind("", "v1", "pods")
        kube_api.call(lambda: kube_api.store.delete(kind, "default", "demo-decode-b"))
        wait_for(
            lambda: SCALE_DOWN not in pool(kube_api)["metadata"].get("annotations", {}),
            60,
            "the scale-down complete",
        )
        wait_for(lambda: events(kube_api, "ScaledDown"), 30, "the ScaledDown event")
        time.sleep(1.0)  # an Event posted twice would have landed by now

        # One decision, applied once: the loads were read once (by the killed
        # leader), the pods' costs are that reading's, one shrink, one report.
        assert router.scrapes == 1
        assert len(events(kube_api, "DeletionCostsSet")) <= 1
        assert len(events(kube_api, "ScaledDown")) == 1
        assert "3 -> 2" in events(kube_api, "ScaledDown")[0]["message"]
        assert len(events(kube_api, "Updated", "Deployment/demo-decode")) == 1
        assert deployment(kube_api, "demo-decode")["spec"]["replicas"] == 2

        # 3. Cut off from the API server, the leader gives up within its renew
        # deadline and exits non-zero (Kubernetes restarts it as a standby).
        cut = time.monotonic()
        kube_api.stop()
        assert third.proc.wait(30) == 1
        print(f"leader exited {time.monotonic() - cut:.1f}s after the API server went")
        assert "leadership lost" in third.output()
    finally:
        router.close()
        for r in replicas:
            r.stop(kill=True)
        for r in replicas:
            print(f"\n--- {r.log.name} (exit {r.proc.returncode}) ---\n{r.output()[-6000:]}")
