"""The operator's faults inside the chaos suite, under traffic, on the local
cluster (devcluster/, `tandem cluster up`): the chart rendered from
helm/examples/local-cpu.yaml (two operator replicas electing a leader over the
Lease `tandem-operator`, two routers sharing the managed Redis, 1 prefill +
1 decode engine, a decode pool that may grow to 2) and applied with kubectl;
the chaos harness's agentic replay (bench/chaos.py) through the router
Service's loopback port; two phases, each judged and printed as a row of the
chaos table (`judge`, `table`):

* ``operator_kill_reconcile``: the TandemDeployment's decode template set
  from 1 to 2 replicas; the leader SIGKILLed the moment it wrote the first
  half of that change (the EnginePool's count), before or while it scales the
  decode Deployment. Another leader (the standby, or the killed replica
  restarted by the kubelet: the same pod name is the same identity) must
  finish it: exactly one decode pod added, none removed, at most one update
  of the Deployment.
* ``operator_kill_scale_down``: `kubectl scale enginepool/tandem-decode
  --replicas 1` with streams in flight; the leader SIGKILLed the moment it
  recorded its decision (the deletion costs set, `tandem.dev/scale-down`),
  before the shrink; then the next leader SIGKILLed while the chosen pod
  drains (terminating: its preStop and the engine's drain). The leader after
  them must finish the drain: exactly one decode pod removed (not two: the
  decision applied once), the other not restarted, the scale-down record
  cleared, one `ScaledDown` Event, at most one `DeletionCostsSet`.

After each, the chaos promises: every request ended (no hang, no truncated
stream), failures counted by kind (none allowed), capacity back (every pod of
the release Ready, a leader, each pool at its EnginePool's count, every engine
SERVING and `available` on both routers) within the bound, no KV held on any
engine (`GetLoad`: nothing in flight, no KV block in use). Printed: the table,
then what each kill found (takeover times, who led, what the killed leader had
written).

Not in `make test` (marker `operator_chaos`: three vLLM engines for 6-15
minutes on 2 cores); `make chaos` runs it after the embedded stack's faults,
`make chaos-operator` alone. Needs root (the local cluster's pod network), as
the journey does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.chaos import (
    ENGINE_RECOVER_S,
    ChaosHarness,
    Fault,
    LoadShape,
    engines_serving,
    routers_see,
    table,
)
from common.kube import COMPONENT_ENGINE, LABEL_COMPONENT, LABEL_DEPLOYMENT, LABEL_POOL
from common.model import resolve_model
from devcluster.client import LocalCluster
from operators.controller import SCALE_DOWN, scale_down_record
from operators.manifests import DELETION_COST, GRPC_PORT, ROUTER_PORT
from tandem.workload.endpoint import served_model
from tests.helm import chart
from tests.localcluster import cluster_fixture

RELEASE = "tandem"
NAMESPACE = "default"
DECODE_POOL = f"{RELEASE}-decode"
PREFILL_POOL = f"{RELEASE}-prefill"
TD_API = "/apis/tandem.dev/v1alpha1"
# Its own bridge and addresses: a user's cluster (10.250), the journey (10.240),
# the profile Job (10.241), the live loop (10.246) and the kubelet tests
# (10.200-239) may run beside it.
BRIDGE = "tdopchaos"
POD_CIDR = "10.247.0.0/16"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},{LABEL_COMPONENT}=operator"
ROUTER_SELECTOR = f"{LABEL_DEPLOYMENT}={RELEASE},{LABEL_COMPONENT}=router"
ENGINE_SELECTOR = f"{LABEL_DEPLOYMENT}={RELEASE},{LABEL_COMPONENT}={COMPONENT_ENGINE}"
DECODE_SELECTOR = f"{LABEL_POOL}={DECODE_POOL}"
OPERATOR_METRICS_PORT = 9090  # the chart's --metrics-port
# Three engines, the store, Redis and two routers starting together on 2 cores.
INSTALL_DEADLINE_S = 900.0
# The chart leaves the operator's Lease at its defaults (15 s).
LEASE_DURATION_S = 15.0
# Past this the test fails rather than hang; the harness's own bounds come first.
DEADLINE_S = 1800.0
# The engines' KV lease (the engine host's default, which the chart keeps).
KV_LEASE_S = 10.0


# -- pure: what a phase's pods and Events say ------------------------------------------


def ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return not terminating(pod) and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def terminating(pod: dict) -> bool:
    return pod["metadata"].get("deletionTimestamp") is not None


def container_pid(pod: dict) -> int | None:
    """The pid of the pod's (first) running container, as the kubelet reports it."""
    for s in pod.get("status", {}).get("containerStatuses", []):
        if "running" in s.get("state", {}) and s.get("containerID", "").startswith("devcluster://"):
            return int(s["containerID"].removeprefix("devcluster://"))
    return None


def restarts(pod: dict) -> int:
    return sum(s.get("restartCount", 0) for s in pod.get("status", {}).get("containerStatuses", []))


def pool_change(
    before: dict[str, int], after: dict[str, int], added: int, removed: int
) -> list[str]:
    """What is wrong with a pool going from the pods `before` to `after`
    (name → restart count) when exactly `added` pods should have come and
    `removed` gone, and the pods that stayed should not have restarted."""
    out = []
    new, gone = sorted(set(after) - set(before)), sorted(set(before) - set(after))
    if len(new) != added:
        out.append(f"{len(new)} pod(s) added, not {added}: {new}")
    if len(gone) != removed:
        out.append(f"{len(gone)} pod(s) removed, not {removed}: {gone}")
    restarted = sorted(n for n in set(before) & set(after) if after[n] != before[n])
    if restarted:
        out.append(f"restarted: {restarted}")
    return out


def new_events(
    before: set[str], events: list[dict], reason: str, involved: str, text: str = ""
) -> list[dict]:
    """Events not in `before` (by name) with this reason, about `involved`,
    whose message holds `text`."""
    return [
        e
        for e in events
        if e["metadata"]["name"] not in before
        and e.get("reason") == reason
        and e.get("involvedObject", {}).get("name") == involved
        and text in e.get("message", "")
    ]


def leader_flag(metrics_text: str) -> bool:
    """Whether an operator replica's metrics say it holds the Lease."""
    return any(
        line.startswith("tandem_operator_leader ") and float(line.split()[1]) == 1.0
        for line in metrics_text.splitlines()
    )


# -- the harness over the local cluster ---------------------------------------------------


class ClusterChaos(ChaosHarness):
    """The chaos phases against the chart on the local cluster: the load goes
    to the router Service's loopback port; full capacity is every pod of the
    release Ready and as many engines as the pools ask for."""

    def __init__(self, cluster: LocalCluster, model_dir: str, shape: LoadShape) -> None:
        super().__init__(model_dir, shape, KV_LEASE_S)
        self.cluster = cluster
        self.notes: list[str] = []
        # What the running phase saw before its fault: decode pods → restarts,
        # Event names, the phase's start.
        self.decode_before: dict[str, int] = {}
        self.events_before: set[str] = set()
        self.kills: list[float] = []
        self.costs: dict[str, int] = {}  # decode pod → deletion cost, as first set
        # What a fault does beside the phase after its injection returns.
        self.steps: list[asyncio.Task[None]] = []

    # -- reading the cluster (off the event loop: the replay streams on it) --------
    async def pods(self, selector: str) -> list[dict]:
        return await asyncio.to_thread(self.cluster.pods, selector)

    async def get(self, path: str, api: str = "/api/v1", **params: str) -> dict | None:
        return await asyncio.to_thread(self.cluster.get, path, api, **params)

    async def kubectl(self, *args: str) -> str:
        return await asyncio.to_thread(self.cluster.kubectl, *args)

    async def decode_pods(self) -> dict[str, int]:
        return {p["metadata"]["name"]: restarts(p) for p in await self.pods(DECODE_SELECTOR)}

    async def events(self) -> list[dict]:
        return ((await self.get("events")) or {}).get("items", [])

    async def pool(self, role: str = "decode") -> dict:
        found = await self.get(f"enginepools/{RELEASE}-{role}", TD_API)
        assert found is not None, f"no EnginePool {RELEASE}-{role}"
        return found

    async def workload_replicas(self, role: str = "decode") -> int | None:
        found = await self.get(f"deployments/{RELEASE}-{role}", "/apis/apps/v1")
        return None if found is None else found["spec"].get("replicas")

    async def leader(self) -> dict | None:
        """The operator pod whose replica says it leads (its metrics), if any."""
        async with httpx.AsyncClient(timeout=2) as c:
            for pod in await self.pods(OPERATOR_SELECTOR):
                ip = pod.get("status", {}).get("podIP")
                if not ip or terminating(pod):
                    continue
                try:
                    text = (await c.get(f"http://{ip}:{OPERATOR_METRICS_PORT}/metrics")).text
                except httpx.HTTPError:
                    continue
                if leader_flag(text):
                    return pod
        return None

    async def engine_addresses(self) -> dict[str, str]:
        return {
            p["metadata"]["name"]: f"{p['status']['podIP']}:{GRPC_PORT}"
            for p in await self.pods(ENGINE_SELECTOR)
            if not terminating(p) and p.get("status", {}).get("podIP")
        }

    async def router_urls(self) -> list[str]:
        return [
            f"http://{p['status']['podIP']}:{ROUTER_PORT}"
            for p in await self.pods(ROUTER_SELECTOR)
            if not terminating(p) and p.get("status", {}).get("podIP")
        ]

    def service_url(self) -> str | None:
        return self.cluster.service_url(f"{RELEASE}-router")

    async def capacity_full(self) -> bool:
        release = await self.pods(f"app.kubernetes.io/instance={RELEASE}")
        if not release or not all(ready(p) for p in release):
            return False
        operators = await self.pods(OPERATOR_SELECTOR)
        if len(operators) != 2 or await self.leader() is None:
            return False
        for role in ("prefill", "decode"):
            want = (await self.pool(role))["spec"]["replicas"]
            engines = await self.pods(f"{LABEL_POOL}={RELEASE}-{role}")
            if len(engines) != want or not all(ready(p) for p in engines):
                return False
        addresses = list((await self.engine_addresses()).values())
        routers = await self.router_urls()
        if len(routers) != 2 or not await engines_serving(addresses):
            return False
        if not await routers_see(routers, addresses):
            return False
        url = self.service_url()
        try:
            async with httpx.AsyncClient(timeout=2) as c:
                return url is not None and (await c.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def start(self) -> None:
        """Returns once the release serves at full capacity."""
        if not await self._until(self.capacity_full, INSTALL_DEADLINE_S):
            raise AssertionError(
                "the release did not reach full capacity within "
                f"{INSTALL_DEADLINE_S:g}s\n{self.cluster.kubectl('get', 'pods', check=False)}"
            )
        url = self.service_url()
        assert url is not None
        self.urls = [url]
        self.model = await asyncio.to_thread(served_model, url)

    # -- the operator's faults --------------------------------------------------------
    async def begin(self, phase: str) -> None:
        """What the phase compares against: the decode pods, the Events so far."""
        self.notes.append(f"{phase}:")
        self.decode_before = await self.decode_pods()
        self.events_before = {e["metadata"]["name"] for e in await self.events()}

    async def watch_for(
        self, path: str, api: str, params: dict[str, str], when: Callable[[dict], bool]
    ) -> asyncio.Task[dict]:
        """Lists `path`, then hands back a task that watches from that list's
        resourceVersion (so nothing written after the list is missed) and
        ends with the first object `when` holds for."""
        listed = await self.get(path, api, **params)
        assert listed is not None
        base = str(self.cluster.api.base_url).rstrip("/")
        query = {
            **params,
            "watch": "true",
            "resourceVersion": listed["metadata"]["resourceVersion"],
        }
        url = f"{base}{api}/namespaces/{NAMESPACE}/{path}"

        async def watch() -> dict:
            async with (
                httpx.AsyncClient(timeout=None) as c,
                c.stream("GET", url, params=query) as response,
            ):
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.strip():
                        event = json.loads(line)
                        if event.get("type") in ("ADDED", "MODIFIED") and when(event["object"]):
                            return event["object"]
            raise RuntimeError(f"the watch of {path} ended")

        return asyncio.create_task(watch())

    def kill(self, pod: dict, why: str) -> None:
        pid = container_pid(pod)
        if pid is None:
            raise RuntimeError(f"operator pod {pod['metadata']['name']} has no running container")
        os.killpg(pid, signal.SIGKILL)
        self.kills.append(time.monotonic())
        self.notes.append(f"  SIGKILL leader {pod['metadata']['name']} (pid {pid}) {why}")
        self.follow(self._takeover(pod["metadata"]["name"], pid, time.monotonic()))

    def follow(self, step: Coroutine[Any, Any, None]) -> None:
        """Runs `step` beside the phase; `followed` says how the steps ended."""
        self.steps.append(asyncio.create_task(step))

    async def followed(self) -> list[str]:
        """Waits for the steps; what failed in them."""
        out = []
        for step in self.steps:
            try:
                await step
            except RuntimeError as exc:
                out.append(str(exc))
        self.steps.clear()
        return out

    async def close(self) -> None:
        for step in self.steps:
            step.cancel()
        await asyncio.gather(*self.steps, return_exceptions=True)

    async def _takeover(self, killed: str, killed_pid: int, at: float) -> None:
        """Notes when a process other than the killed one leads."""
        while time.monotonic() - at < LEASE_DURATION_S + 120:
            pod = await self.leader()
            if pod is not None and container_pid(pod) != killed_pid:
                name = pod["metadata"]["name"]
                who = "the killed replica, restarted" if name == killed else "the other replica"
                self.notes.append(
                    f"    -> {name} leads {time.monotonic() - at:.1f}s after the kill ({who})"
                )
                return
            await asyncio.sleep(0.2)
        self.notes.append(f"    -> no leader within {LEASE_DURATION_S + 120:g}s of the kill")


async def kill_mid_reconcile(h: ClusterChaos) -> None:
    """Returns at the kill; what the killed leader had applied is noted after."""
    await h.begin("operator_kill_reconcile")
    leader = await h.leader()
    if leader is None:
        raise RuntimeError("fault not injected: no leader")
    copied = await h.watch_for(
        "enginepools",
        TD_API,
        {"fieldSelector": f"metadata.name={DECODE_POOL}"},
        lambda pool: pool["spec"]["replicas"] == 2,
    )
    patch = json.dumps({"spec": {"decode": {"replicas": 2}}})
    await h.kubectl("patch", "td", RELEASE, "--type", "merge", "-p", patch)
    try:
        await asyncio.wait_for(copied, 60)
    except TimeoutError:
        raise RuntimeError("fault not injected: the leader did not copy the count") from None
    h.kill(leader, "on its write of EnginePool/tandem-decode replicas 1 -> 2")

    async def applied_before() -> None:
        await asyncio.sleep(1)
        h.notes.append(
            f"  the decode Deployment at {await h.workload_replicas()} replica(s) 1 s after "
            "the kill (1: the kill came before the scale-up was applied)"
        )

    h.follow(applied_before())


async def scaled_up(h: ClusterChaos) -> bool:
    return await h.workload_replicas() == 2 and (await h.pool())["spec"]["replicas"] == 2


async def verify_scaled_up(h: ClusterChaos) -> list[str]:
    out = await h.followed()
    out += pool_change(h.decode_before, await h.decode_pods(), added=1, removed=0)
    updates = new_events(
        h.events_before, await h.events(), "Updated", RELEASE, f"Deployment/{DECODE_POOL}"
    )
    if len(updates) > 1:
        out.append(f"the decode Deployment updated {len(updates)} times")
    if SCALE_DOWN in (await h.pool())["metadata"].get("annotations", {}):
        out.append("a scale-down recorded on the pool")
    return out


async def kill_mid_scale_down(h: ClusterChaos) -> None:
    """Returns at the first kill; the second (mid-drain) follows beside the phase."""
    await h.begin("operator_kill_scale_down")
    deadline = time.monotonic() + 120
    while h.load is None or h.load.streaming == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("fault not injected: no stream with tokens within 120s")
        await asyncio.sleep(0.05)
    leader = await h.leader()
    if leader is None:
        raise RuntimeError("fault not injected: no leader")
    decided = await h.watch_for(
        "enginepools",
        TD_API,
        {"fieldSelector": f"metadata.name={DECODE_POOL}"},
        lambda pool: bool((scale_down_record(pool) or {}).get("costsSet")),
    )
    await h.kubectl("scale", f"enginepool/{DECODE_POOL}", "--replicas", "1")
    try:
        await asyncio.wait_for(decided, 60)
    except TimeoutError:
        raise RuntimeError("fault not injected: no scale-down decision recorded") from None
    h.kill(leader, "on its write of the scale-down record (deletion costs set)")
    h.follow(kill_mid_drain(h))


async def kill_mid_drain(h: ClusterChaos) -> None:
    """The deletion costs as the killed leader set them; then, once the chosen
    pod is terminating and a replica leads again (the record still there),
    that leader killed too."""
    h.costs = {
        p["metadata"]["name"]: int(p["metadata"].get("annotations", {}).get(DELETION_COST, 0))
        for p in await h.pods(DECODE_SELECTOR)
    }
    await asyncio.sleep(1)
    h.notes.append(
        f"  deletion costs {h.costs}; the decode Deployment at {await h.workload_replicas()} "
        "replica(s) 1 s after the kill (2: the kill came before the shrink)"
    )
    deadline = time.monotonic() + LEASE_DURATION_S + 120
    while time.monotonic() < deadline:
        draining = [p for p in await h.pods(DECODE_SELECTOR) if terminating(p)]
        if SCALE_DOWN not in (await h.pool())["metadata"].get("annotations", {}):
            h.notes.append("  the scale-down finished before a second leader: no second kill")
            return
        if draining and (second := await h.leader()) is not None:
            h.kill(second, f"while {draining[0]['metadata']['name']} drains")
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("no leader while the chosen pod drained")


async def scaled_down(h: ClusterChaos) -> bool:
    pool = await h.pool()
    return (
        await h.workload_replicas() == 1
        and SCALE_DOWN not in pool["metadata"].get("annotations", {})
        and not pool.get("status", {}).get("drainingCount")
    )


async def verify_scaled_down(h: ClusterChaos) -> list[str]:
    out = await h.followed()
    after = await h.decode_pods()
    out += pool_change(h.decode_before, after, added=0, removed=1)
    removed = sorted(set(h.decode_before) - set(after))
    if len(removed) == 1 and h.costs and h.costs.get(removed[0]) != min(h.costs.values()):
        out.append(f"{removed[0]} removed, not the cheapest ({h.costs})")
    events = await h.events()
    done = new_events(h.events_before, events, "ScaledDown", DECODE_POOL, "2 -> 1")
    if len(done) != 1:
        out.append(f"{len(done)} ScaledDown Events, not 1")
    marked = new_events(h.events_before, events, "DeletionCostsSet", DECODE_POOL)
    if len(marked) > 1:
        out.append(f"deletion costs set {len(marked)} times")
    return out


RECONCILE = Fault(
    "operator_kill_reconcile",
    kill_mid_reconcile,
    recover_s=ENGINE_RECOVER_S,  # the new decode engine loads vLLM
    recovered=scaled_up,
    verify=verify_scaled_up,
)
SCALE_DOWN_FAULT = Fault(
    "operator_kill_scale_down",
    kill_mid_scale_down,
    # Two takeovers (a lease and an operator's start each), the drain
    # (preStop, streams ending) and a pass after it (resync 10 s).
    recover_s=2 * LEASE_DURATION_S + 180,
    recovered=scaled_down,
    verify=verify_scaled_down,
)


# -- the run ---------------------------------------------------------------------------


def values(tmp_path: Path) -> dict:
    """local-cpu.yaml with its hostPaths on this machine (the model as `tandem
    model` prepared it, the store's disk tier under tmp) and two operator
    replicas, said outright."""
    model = resolve_model(None)
    v = chart.example("local-cpu")
    v["model"]["path"] = f"/models/{model.name}"
    v["model"]["volume"]["hostPath"] = str(model.parent)
    v["kvStore"]["disk"]["hostPath"] = str(tmp_path / "kv")
    v["operator"]["replicas"] = 2
    return v


cluster = cluster_fixture(BRIDGE, POD_CIDR)


@pytest.mark.stack
@pytest.mark.operator_chaos
async def test_operator_killed_mid_reconcile_and_mid_scale_down(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    docs = [
        d
        for d in chart.render(values(tmp_path), release=RELEASE, namespace=NAMESPACE)
        if "helm.sh/hook" not in d["metadata"].get("annotations", {})
    ]
    # The custom resources last, as Helm installs them.
    docs.sort(key=lambda d: d["apiVersion"].startswith("tandem.dev/"))
    manifest = tmp_path / "release.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    cluster.kubectl("apply", "-f", str(manifest))
    h = ClusterChaos(
        cluster,
        str(resolve_model(None)),
        # Sessions enough for a phase that waits minutes for an engine to load.
        LoadShape(concurrency=3, sessions=80, deadline_s=180.0, lead_s=8.0, tail_s=8.0),
    )
    started = time.monotonic()
    try:
        async with asyncio.timeout(DEADLINE_S):
            await h.start()
            print(f"\n[operator chaos] install -> full capacity {time.monotonic() - started:.0f}s")
            rows = await h.run([RECONCILE, SCALE_DOWN_FAULT])
    finally:
        await h.close()
        print("\n".join(h.notes))
        with contextlib.suppress(OSError):
            load = os.getloadavg()
            print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("\n" + table(rows))
    assert all(r.requests > 0 for r in rows), table(rows)
    assert not any(r.violations for r in rows), table(rows) + "\n" + "\n".join(h.notes)
    assert len(h.kills) >= 2, h.notes


# -- the judging, without a cluster ------------------------------------------------------


def test_pool_change_names_pods_added_removed_or_restarted():
    before = {"d-a": 0, "d-b": 0}
    assert pool_change(before, {"d-a": 0}, added=0, removed=1) == []
    assert pool_change(before, {"d-a": 0, "d-b": 0, "d-c": 0}, added=1, removed=0) == []
    assert pool_change(before, {}, added=0, removed=1) == [
        "2 pod(s) removed, not 1: ['d-a', 'd-b']"
    ]
    assert pool_change(before, {"d-a": 1}, added=0, removed=1) == ["restarted: ['d-a']"]
    assert pool_change(before, {"d-a": 0, "d-b": 0, "d-c": 0, "d-d": 0}, added=1, removed=0) == [
        "2 pod(s) added, not 1: ['d-c', 'd-d']"
    ]


def test_new_events_counts_only_the_phases_own():
    def event(name: str, reason: str, about: str, message: str) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "reason": reason,
            "involvedObject": {"name": about},
            "message": message,
        }

    events = [
        event("e1", "ScaledDown", DECODE_POOL, "decode pool 2 -> 1: ..."),
        event("e2", "ScaledDown", DECODE_POOL, "decode pool 2 -> 1: ..."),
        event("e3", "ScaledDown", PREFILL_POOL, "prefill pool 2 -> 1: ..."),
        event("e4", "DeletionCostsSet", DECODE_POOL, "..."),
    ]
    assert [
        e["metadata"]["name"]
        for e in new_events({"e1"}, events, "ScaledDown", DECODE_POOL, "2 -> 1")
    ] == ["e2"]
    assert new_events(set(), events, "ScaledDown", DECODE_POOL, "3 -> 2") == []


def test_the_leader_is_read_from_the_operators_metrics():
    assert leader_flag("# TYPE tandem_operator_leader gauge\ntandem_operator_leader 1.0\n")
    assert not leader_flag("tandem_operator_leader 0.0\n")
    assert not leader_flag("tandem_operator_leader_acquired_total 3.0\n")


def test_a_pods_pid_is_its_running_containers():
    pod = {
        "status": {
            "containerStatuses": [
                {"state": {"running": {}}, "containerID": "devcluster://4242", "restartCount": 2}
            ]
        }
    }
    assert container_pid(pod) == 4242 and restarts(pod) == 2
    pod["status"]["containerStatuses"][0]["state"] = {"waiting": {}}
    assert container_pid(pod) is None
