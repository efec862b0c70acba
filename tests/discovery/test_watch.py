"""KubernetesPods against the fake API server over real HTTP, in process:
list, watch, relist after 410 Gone, into a real PodPool and routing core.
The pods' addresses lead nowhere: only the pod set is checked here
(test_router_discovery.py sends requests through a real router)."""

from __future__ import annotations

import asyncio

import pytest

from common.ports import free_port
from devcluster.apiserver import RunningApiServer, write_kubeconfig
from services.router.discovery import DiscoverySettings, KubernetesPods
from services.router.metrics import RouterMetrics
from services.router.pods import PodPool
from services.router.routing import RoutingCore, RoutingSettings
from tests.discovery.slices import Slices, endpoint, endpoint_slice

pytestmark = pytest.mark.timeout(60)


def source(kube_api, metrics: RouterMetrics, watch_timeout_s: float = 300.0) -> KubernetesPods:
    return KubernetesPods(
        DiscoverySettings(
            discovery="kubernetes",
            discovery_namespace="default",
            discovery_deployment="demo",
            kubeconfig=str(kube_api.kubeconfig),
            watch_timeout_s=watch_timeout_s,
        ),
        metrics,
        retry_s=0.1,
    )


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def pod_set(core: RoutingCore) -> dict[str, str]:
    return {p.name: "draining" if p.draining else "in" for p in core.report(0.0)}


def count(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


async def test_follows_slices_and_relists_after_410(kube_api):
    slices = Slices(kube_api)
    slices.put(
        endpoint_slice("demo-decode-a", "decode", 50061, [endpoint("10.0.0.1", "d-0", "unready")])
    )
    slices.put(
        endpoint_slice(
            "other-decode-a",
            "decode",
            50061,  # another deployment's
            [endpoint("10.0.0.9", "o-0")],
            deployment="other",
        )
    )
    metrics = RouterMetrics()
    pods = source(kube_api, metrics)
    core = RoutingCore(RoutingSettings())
    pool = PodPool(core, poll_interval_s=60.0, remove_grace_s=0.1)

    # initial() waits for a ready endpoint.
    first = asyncio.create_task(pods.initial())
    await asyncio.sleep(0.5)
    assert not first.done()
    slices.put(
        endpoint_slice(
            "demo-decode-a",
            "decode",
            50061,
            [endpoint("10.0.0.1", "d-0"), endpoint("10.0.0.2", "d-1")],
        )
    )
    specs = await asyncio.wait_for(first, 10)
    assert sorted(s.name for s in specs) == ["10.0.0.1:50061", "10.0.0.2:50061"]
    for spec in specs:
        pool.add_pod(spec)

    # Changes while nobody watches, then the history is compacted: the watch
    # that resumes from the old resourceVersion gets 410 and lists again.
    slices.put(
        endpoint_slice(
            "demo-decode-a",
            "decode",
            50061,
            [endpoint("10.0.0.1", "d-0", "terminating"), endpoint("10.0.0.2", "d-1")],
        )
    )
    slices.put(endpoint_slice("demo-prefill-a", "prefill", 50061, [endpoint("10.0.0.3", "p-0")]))
    kube_api.call(kube_api.store.compact)
    watching = asyncio.create_task(pods.watch(pool))
    try:
        await until(
            lambda: (
                pod_set(core)
                == {"10.0.0.1:50061": "draining", "10.0.0.2:50061": "in", "10.0.0.3:50061": "in"}
            )
        )
        assert count(metrics, "tandem_router_discovery_watch_restarts_total", reason="gone") == 1
        assert count(metrics, "tandem_router_discovery_lists_total") == 2

        # Live: the terminating pod goes, a slice is deleted, another arrives.
        slices.put(endpoint_slice("demo-decode-a", "decode", 50061, [endpoint("10.0.0.2", "d-1")]))
        slices.delete("demo-prefill-a")
        slices.put(endpoint_slice("demo-decode-b", "decode", 50062, [endpoint("10.0.0.4", "d-2")]))
        await until(lambda: pod_set(core) == {"10.0.0.2:50061": "in", "10.0.0.4:50062": "in"})
        assert pool.get("10.0.0.1:50061") is None
        changes = {
            c: count(metrics, "tandem_router_discovery_changes_total", change=c)
            for c in ("added", "draining", "removed")
        }
        assert changes == {"added": 2, "draining": 1, "removed": 2}
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await pool.close()


async def test_a_server_ended_watch_resumes_without_a_relist(kube_api):
    slices = Slices(kube_api)
    slices.put(endpoint_slice("demo-both-a", "both", 50061, [endpoint("10.0.0.1", "b-0")]))
    metrics = RouterMetrics()
    pods = source(kube_api, metrics, watch_timeout_s=1.0)
    core = RoutingCore(RoutingSettings())
    pool = PodPool(core, poll_interval_s=60.0, remove_grace_s=0.1)
    for spec in await pods.initial():
        pool.add_pod(spec)
    watching = asyncio.create_task(pods.watch(pool))
    try:
        await until(
            lambda: (
                count(metrics, "tandem_router_discovery_watch_restarts_total", reason="timeout")
                >= 2
            )
        )
        slices.put(
            endpoint_slice(
                "demo-both-a",
                "both",
                50061,
                [endpoint("10.0.0.1", "b-0"), endpoint("10.0.0.2", "b-1")],
            )
        )
        await until(lambda: len(pod_set(core)) == 2)
        assert count(metrics, "tandem_router_discovery_lists_total") == 1
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await pool.close()


async def test_an_unreachable_api_server_is_retried(tmp_path):
    """Connection refused: logged, counted and retried until the source is cancelled."""
    metrics = RouterMetrics()
    kubeconfig = write_kubeconfig(f"http://127.0.0.1:{free_port()}", tmp_path / "kubeconfig")
    pods = KubernetesPods(
        DiscoverySettings(
            discovery="kubernetes",
            discovery_namespace="default",
            discovery_deployment="demo",
            kubeconfig=str(kubeconfig),
        ),
        metrics,
        retry_s=0.05,
    )
    task = asyncio.create_task(pods.initial())
    await until(
        lambda: count(metrics, "tandem_router_discovery_watch_restarts_total", reason="error") >= 2
    )
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Proxy:
    """A TCP proxy the router reaches the API server through: stopping it is
    the API server becoming unreachable (listener closed, open watches cut);
    starting it again on the same port, possibly towards another server, is
    the API server back."""

    def __init__(self) -> None:
        self.port = free_port()
        self.target = ""
        self.server: asyncio.Server | None = None
        self.streams: set[asyncio.StreamWriter] = set()

    async def start(self, target_url: str) -> None:
        self.target = target_url
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.streams):
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target.removeprefix("http://").rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self.streams |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.streams -= {writer, up_writer}


async def test_an_unreachable_api_server_keeps_the_pool_and_says_so(kube_api, tmp_path):
    slices = Slices(kube_api)
    slices.put(
        endpoint_slice(
            "demo-decode-a",
            "decode",
            50061,
            [endpoint("10.0.0.1", "d-0"), endpoint("10.0.0.2", "d-1")],
        )
    )
    proxy = Proxy()
    await proxy.start(kube_api.url)
    metrics = RouterMetrics()
    pods = KubernetesPods(
        DiscoverySettings(
            discovery="kubernetes",
            discovery_namespace="default",
            discovery_deployment="demo",
            kubeconfig=str(write_kubeconfig(f"http://127.0.0.1:{proxy.port}", tmp_path / "kc")),
        ),
        metrics,
        retry_s=0.1,
    )
    core = RoutingCore(RoutingSettings())
    pool = PodPool(core, poll_interval_s=60.0, remove_grace_s=0.1)
    for spec in await pods.initial():
        pool.add_pod(spec)
    watching = asyncio.create_task(pods.watch(pool))
    other = None
    try:
        known = {"10.0.0.1:50061": "in", "10.0.0.2:50061": "in"}
        assert pod_set(core) == known
        assert count(metrics, "tandem_router_discovery_up") == 1
        synced = count(metrics, "tandem_router_discovery_last_sync_timestamp_seconds")
        assert synced > 0

        await proxy.stop()
        await until(lambda: count(metrics, "tandem_router_discovery_up") == 0)
        await until(
            lambda: (
                count(metrics, "tandem_router_discovery_watch_restarts_total", reason="error") >= 3
            )
        )
        assert pod_set(core) == known  # served from what it last knew
        assert count(metrics, "tandem_router_discovery_last_sync_timestamp_seconds") == synced

        # Back, as a new API server whose slices moved on: the pool follows it.
        other = RunningApiServer(bookmark_interval=0.5).start()
        Slices(other).put(
            endpoint_slice(
                "demo-decode-a",
                "decode",
                50061,
                [endpoint("10.0.0.2", "d-1"), endpoint("10.0.0.3", "d-2")],
            )
        )
        await proxy.start(other.url)
        await until(lambda: pod_set(core) == {"10.0.0.2:50061": "in", "10.0.0.3:50061": "in"})
        assert count(metrics, "tandem_router_discovery_up") == 1
        assert count(metrics, "tandem_router_discovery_last_sync_timestamp_seconds") > synced
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await pool.close()
        if other is not None:
            other.stop()


async def test_an_unexpected_failure_keeps_the_watch_alive(kube_api):
    """A failure none of the known cases name (here, applying a change) is
    logged, counted and followed by a new list; the watch never dies silently,
    which would leave the router blind to new pods while reporting it is up."""
    slices = Slices(kube_api)
    slices.put(endpoint_slice("demo-decode-a", "decode", 50061, [endpoint("10.0.0.1", "d-0")]))
    metrics = RouterMetrics()
    pods = source(kube_api, metrics)
    core = RoutingCore(RoutingSettings())
    pool = PodPool(core, poll_interval_s=60.0, remove_grace_s=0.1)
    for spec in await asyncio.wait_for(pods.initial(), 10):
        pool.add_pod(spec)

    apply = pods._apply
    failures = []

    async def apply_failing_once(target: PodPool) -> None:
        if not failures:
            failures.append(1)
            raise KeyError("an unexpected failure")
        await apply(target)

    pods._apply = apply_failing_once  # type: ignore[method-assign]
    watching = asyncio.create_task(pods.watch(pool))
    try:
        slices.put(endpoint_slice("demo-decode-b", "decode", 50062, [endpoint("10.0.0.2", "d-1")]))
        await until(lambda: pod_set(core) == {"10.0.0.1:50061": "in", "10.0.0.2:50062": "in"})
        assert not watching.done()
        assert count(metrics, "tandem_router_discovery_watch_restarts_total", reason="error") >= 1
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await pool.close()
