"""Where the router's engine pods come from.

A ``PodSource`` names the pods there are at start (``initial``) and then
keeps the pool's pod set current (``watch``) through ``PodPool.add_pod``,
``remove_pod`` and ``set_draining``. ``StaticPods`` is the list from the
command line (``--prefill``, ``--decode``, ``--engine``, ``--kv-events``),
fixed for the router's lifetime. ``KubernetesPods`` follows the EndpointSlices
of a TandemDeployment's engine pools (the operator's headless Services): an
endpoint that becomes ready joins the pool (its pool name from the slice's
``tandem.dev/pool`` label, for request classes), one that is terminating (or no
longer ready) drains — its streams finish, it gets no new requests — and one
that is gone leaves the pool.

The pure part (``slice_endpoints``, ``merge_endpoints``, ``plan_changes``)
turns EndpointSlices and the pool's pod set into changes; ``KubernetesPods``
does the list-and-watch around it: it lists once, watches from the list's
resourceVersion (bookmarks keep it fresh), watches again when the server ends a
watch, and lists again after 410 Gone or any error.

An unreachable API server changes nothing in the pool: the router keeps
routing to the pods it last knew (an engine that died meanwhile fails its
requests and health checks as it would anyway) and says so in
``tandem_router_discovery_up`` (0) and
``tandem_router_discovery_last_sync_timestamp_seconds`` (when the pod set
was last confirmed). The list once it answers again brings the pool back in
line with what is there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiException

from common.kube import (
    LABEL_POOL,
    LABEL_ROLE,
    PORT_GRPC,
    PORT_KV_EVENTS,
    PORT_KV_REPLAY,
    api_client,
    engine_selector,
    own_namespace,
)
from common.roles import Role
from common.router import DiscoverySettings
from services.router.metrics import RouterMetrics
from services.router.pods import PodPool
from services.router.routing import PodSpec

log = logging.getLogger(__name__)


class PodSource(Protocol):
    async def initial(self) -> list[PodSpec]:
        """The pods there are now (the router asks them what model they serve)."""
        ...

    async def watch(self, pool: PodPool) -> None:
        """Keep ``pool``'s pod set current until cancelled."""
        ...


class StaticPods:
    def __init__(self, pods: list[PodSpec]) -> None:
        self._pods = pods

    async def initial(self) -> list[PodSpec]:
        return list(self._pods)

    async def watch(self, pool: PodPool) -> None:
        """A fixed list: nothing changes."""


# ----- pure core: EndpointSlices → the pod set ---------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One engine endpoint of an EndpointSlice, as the router uses it."""

    spec: PodSpec
    ready: bool  # takes new requests
    terminating: bool
    pod: str = ""  # the Kubernetes pod's name (targetRef), for logs


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def slice_endpoints(endpoint_slice: Mapping[str, Any]) -> list[Endpoint]:
    """The engine endpoints of one EndpointSlice. A slice without the gRPC
    port or the role label names no engines; an endpoint's first address is
    its pod's."""
    labels = (endpoint_slice.get("metadata") or {}).get("labels") or {}
    role_label = labels.get(LABEL_ROLE)
    ports = {
        p.get("name"): p.get("port") for p in endpoint_slice.get("ports") or [] if p.get("port")
    }
    if role_label not in tuple(Role) or PORT_GRPC not in ports:
        return []
    role = Role(role_label)
    out = []
    for ep in endpoint_slice.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        ip = addresses[0]
        conditions = ep.get("conditions") or {}
        terminating = bool(conditions.get("terminating"))
        # Kubernetes: a nil `ready` means ready, unless terminating.
        ready = conditions.get("ready", True) is not False and not terminating
        events = (
            f"tcp://{_host_port(ip, ports[PORT_KV_EVENTS])}" if PORT_KV_EVENTS in ports else None
        )
        replay = (
            f"tcp://{_host_port(ip, ports[PORT_KV_REPLAY])}"
            if events and PORT_KV_REPLAY in ports
            else None
        )
        spec = PodSpec(
            _host_port(ip, ports[PORT_GRPC]), role, events, replay, labels.get(LABEL_POOL, "")
        )
        out.append(Endpoint(spec, ready, terminating, (ep.get("targetRef") or {}).get("name", "")))
    return out


def merge_endpoints(slices: Mapping[str, Mapping[str, Any]]) -> dict[str, Endpoint]:
    """Every engine endpoint by gRPC address. While a pod moves between
    slices it may be listed twice: ready wins."""
    merged: dict[str, Endpoint] = {}
    for key in sorted(slices):
        for ep in slice_endpoints(slices[key]):
            seen = merged.get(ep.spec.name)
            if seen is None or (ep.ready and not seen.ready):
                merged[ep.spec.name] = ep
    return merged


@dataclass(frozen=True)
class PodChanges:
    add: list[PodSpec] = field(default_factory=list)
    drain: list[str] = field(default_factory=list)
    undrain: list[str] = field(default_factory=list)  # ready again after not being ready
    remove: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.add or self.drain or self.undrain or self.remove)


def plan_changes(present: Mapping[str, bool], endpoints: Mapping[str, Endpoint]) -> PodChanges:
    """From the pool's pods (address → drained by discovery) and the endpoints
    there are now: which pods to add, drain, take back and remove. A pod not
    in the pool joins only once ready; one listed but not ready drains (its
    streams finish); one no longer listed leaves."""
    changes = PodChanges()
    for address, ep in endpoints.items():
        drained = present.get(address)
        if drained is None:
            if ep.ready:
                changes.add.append(ep.spec)
        elif ep.ready and drained:
            changes.undrain.append(address)
        elif not ep.ready and not drained:
            changes.drain.append(address)
    changes.remove.extend(a for a in present if a not in endpoints)
    return changes


# ----- I/O: list and watch -------------------------------------------------------


class KubernetesPods:
    """The engine pods of one TandemDeployment, from its pools' EndpointSlices."""

    def __init__(
        self, settings: DiscoverySettings, metrics: RouterMetrics, retry_s: float = 1.0
    ) -> None:
        assert settings.discovery_deployment
        self._namespace = settings.discovery_namespace or own_namespace()
        self._selector = engine_selector(settings.discovery_deployment)
        self._kubeconfig = settings.kubeconfig
        self._watch_timeout_s = settings.watch_timeout_s
        self._metrics = metrics
        self._retry_s = retry_s
        self._api: client.ApiClient | None = None
        self._slices: dict[str, dict[str, Any]] = {}
        self._rv: str | None = None  # None: list before watching
        self._drained: set[str] = set()

    async def _client(self) -> client.DiscoveryV1Api:
        if self._api is None:
            self._api = await api_client(self._kubeconfig)
        return client.DiscoveryV1Api(self._api)

    async def initial(self) -> list[PodSpec]:
        """The ready engine pods; waits until there is at least one."""
        log.info(
            "discovery: following EndpointSlices %s in namespace %s",
            self._selector,
            self._namespace,
        )

        async def any_ready() -> bool:
            if any(ep.ready for ep in merge_endpoints(self._slices).values()):
                return True
            log.info("discovery: waiting for a ready engine endpoint (%s)", self._selector)
            return False

        try:
            await self._follow(any_ready)
        except BaseException:
            await self._close()
            raise
        return [ep.spec for ep in merge_endpoints(self._slices).values() if ep.ready]

    async def watch(self, pool: PodPool) -> None:
        async def apply() -> bool:
            await self._apply(pool)
            return False

        try:
            # What changed since initial() returned, if it did.
            await self._follow(apply, changed=self._rv is not None)
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _apply(self, pool: PodPool) -> None:
        endpoints = merge_endpoints(self._slices)
        present = {p.address: p.address in self._drained for p in pool.pods}
        changes = plan_changes(present, endpoints)
        for spec in changes.add:
            pool.add_pod(spec)
            self._metrics.discovery_changes.labels("added").inc()
            log.info(
                "discovery: pod %s ready, added as %s (%s)",
                endpoints[spec.name].pod,
                spec.name,
                spec.role,
            )
        for address in changes.drain:
            pool.set_draining(address)
            self._drained.add(address)
            self._metrics.discovery_changes.labels("draining").inc()
            log.info(
                "discovery: pod %s %s: draining %s",
                endpoints[address].pod,
                "terminating" if endpoints[address].terminating else "not ready",
                address,
            )
        for address in changes.undrain:
            pool.set_draining(address, False)
            self._drained.discard(address)
            self._metrics.discovery_changes.labels("ready_again").inc()
            log.info(
                "discovery: pod %s ready again: %s takes new requests",
                endpoints[address].pod,
                address,
            )
        for address in changes.remove:
            self._drained.discard(address)
            self._metrics.discovery_changes.labels("removed").inc()
            log.info("discovery: endpoint %s gone: removing it", address)
            await pool.remove_pod(address)
        if changes.add:
            await pool.poll_once()  # new pods take work now, not at the next poll

    async def _list(self, api: client.DiscoveryV1Api) -> None:
        # Raw: the slices stay the dicts the watch events carry.
        response: Any = await api.list_namespaced_endpoint_slice(
            self._namespace,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=30,
        )
        try:
            found = await response.json()
        finally:
            response.release()
        self._slices = {self._key(s): s for s in found.get("items") or []}
        self._rv = found["metadata"]["resourceVersion"]
        self._metrics.discovery_lists.inc()
        self._synced()

    def _synced(self) -> None:
        """The API server just confirmed the pod set."""
        self._metrics.discovery_up.set(1)
        self._metrics.discovery_last_sync.set(time.time())

    def _lost(self) -> None:
        self._rv = None
        self._metrics.discovery_up.set(0)

    @staticmethod
    def _key(endpoint_slice: Mapping[str, Any]) -> str:
        return str(endpoint_slice["metadata"]["name"])

    async def _follow(
        self, on_change: Callable[[], Awaitable[bool]], changed: bool = False
    ) -> None:
        """List (when needed) and watch, calling ``on_change`` first if
        ``changed``, after the list and after every change, until it returns
        True."""
        api = await self._client()
        while True:
            try:
                if changed:
                    changed = False
                    if await on_change():
                        return
                if self._rv is None:
                    await self._list(api)
                    if await on_change():
                        return
                if await self._watch_once(api, on_change):
                    return
            except ApiException as exc:
                if exc.status == 410:
                    self._rv = None
                    self._metrics.discovery_restarts.labels("gone").inc()
                    log.info("discovery: watch history expired (410 Gone): listing again")
                    continue
                self._lost()
                self._metrics.discovery_restarts.labels("error").inc()
                log.warning(
                    "discovery: API server answered %s %s: keeping the %d known "
                    "endpoint(s), listing again in %gs",
                    exc.status,
                    exc.reason,
                    len(merge_endpoints(self._slices)),
                    self._retry_s,
                )
                await asyncio.sleep(self._retry_s)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self._lost()
                self._metrics.discovery_restarts.labels("error").inc()
                log.warning(
                    "discovery: EndpointSlice watch failed (%s: %s): keeping the %d known "
                    "endpoint(s), listing again in %gs",
                    type(exc).__name__,
                    exc,
                    len(merge_endpoints(self._slices)),
                    self._retry_s,
                )
                await asyncio.sleep(self._retry_s)
            except Exception:
                # Anything else (a malformed object, a failure applying a
                # change): a dead watch would leave the router blind to pods
                # while it still looks healthy, so list again instead.
                self._lost()
                self._metrics.discovery_restarts.labels("error").inc()
                log.exception(
                    "discovery: unexpected failure following EndpointSlices: keeping the "
                    "%d known endpoint(s), listing again in %gs",
                    len(merge_endpoints(self._slices)),
                    self._retry_s,
                )
                await asyncio.sleep(self._retry_s)

    async def _watch_once(
        self, api: client.DiscoveryV1Api, on_change: Callable[[], Awaitable[bool]]
    ) -> bool:
        """One watch from ``self._rv`` until the server ends it; True once
        ``on_change`` is."""
        async with watch.Watch(return_type="object") as stream:
            async for event in stream.stream(
                api.list_namespaced_endpoint_slice,
                self._namespace,
                label_selector=self._selector,
                resource_version=self._rv,
                allow_watch_bookmarks=True,
                timeout_seconds=int(self._watch_timeout_s),
                _request_timeout=self._watch_timeout_s + 30,
            ):
                obj = event["raw_object"]
                kind = event["type"]
                self._rv = obj["metadata"]["resourceVersion"]
                self._synced()
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self._slices.pop(self._key(obj), None)
                else:
                    self._slices[self._key(obj)] = obj
                self._metrics.discovery_events.labels(kind.lower()).inc()
                if await on_change():
                    return True
        self._metrics.discovery_restarts.labels("timeout").inc()
        return False


def pod_source(
    settings: DiscoverySettings, static: list[PodSpec], metrics: RouterMetrics
) -> PodSource:
    """The source ``--discovery`` names."""
    if settings.kubernetes:
        return KubernetesPods(settings, metrics)
    return StaticPods(static)
