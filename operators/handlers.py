"""kopf handlers: thin, each hands the owning TandemDeployment to controller.py.

Every trigger (the deployment itself, its EnginePools' replica counts or
deletion, any object the operator owns, an HPA, the periodic resync) runs
the same level-based reconcile; a per-deployment lock keeps two from
interleaving. `register` puts them in a kopf registry with the operator's
settings (the loops' intervals); nothing is registered or read at import time.

No handler needs a finalizer: owner references collect what a deleted
TandemDeployment owned, so `kubectl delete td` (or `helm uninstall`) returns
with the operator down. kopf puts a finalizer on every object that has a
timer or a mandatory delete handler, so the resync and the scaling ticks are
the operator's own loops over the deployments kopf indexes (`Periodic`), and
a deletion is seen as a watch event. Objects an older operator finalized lose
the finalizer when kopf next sees them (it removes one no handler requires).

Two kopf indexes stand in for listings: the TandemDeployments of each
namespace (which ones an HPA event may concern) and the HPAs of each
namespace (which pools another autoscaler scales); a third, of the
TandemProfiles, drives their resync (operators/profile_run.py), which also
runs on a profile's creation and on each change of its Job.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiException

from operators import controller, live, profile_run
from operators.kube import Kube
from operators.manifests import LABEL_DEPLOYMENT, MANAGED_BY
from operators.planner.simulate import Simulator
from operators.profile import KIND as PROFILE_KIND
from operators.profile import LABEL_PROFILE as PROFILE_LABEL
from operators.profile import RESOURCE as PROFILES
from operators.profile import parse_profile
from operators.settings import OperatorSettings
from operators.spec import API_VERSION, GROUP, VERSION, parse_pool

log = logging.getLogger(__name__)

OWNED = [
    ("apps", "v1", "deployments"),
    ("apps", "v1", "daemonsets"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "ingresses"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("batch", "v1", "jobs"),
]
TD = (GROUP, VERSION, "tandemdeployments")
# The indexes, by the names kopf passes them under.
DEPLOYMENTS_BY_NAMESPACE, HPAS_BY_NAMESPACE = "deployments_by_namespace", "hpas_by_namespace"
PROFILES_BY_NAMESPACE = "profiles_by_namespace"
HPA = ("autoscaling", "v2", "horizontalpodautoscalers")


class Events:
    """Posts the operator's Events (the controller's `Emit`) through its own
    client: kopf's `kopf.event` works only inside kopf's per-object tasks, not
    in the operator's loops. Each post runs as a task so that a reconcile never
    waits on one; a post that fails is logged, never retried."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.pending: set[asyncio.Task[None]] = set()

    def __call__(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        task = asyncio.get_running_loop().create_task(self.post(obj, type_, reason, message))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def post(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": meta["namespace"], "generateName": f"{meta['name']}."},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": MANAGED_BY},
            "reportingComponent": MANAGED_BY,
            "involvedObject": {
                "apiVersion": obj["apiVersion"],
                "kind": obj["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create(event)
        except ApiException as exc:
            log.warning("event %s on %s/%s not posted: %s", reason, obj["kind"], meta["name"], exc)

    async def close(self) -> None:
        await asyncio.gather(*self.pending, return_exceptions=True)


def _namespace(namespace: str | None) -> str:
    """Every resource the operator handles is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource without a namespace")
    return namespace


def _hpas(kwargs: Mapping[str, Any], namespace: str) -> list[dict[str, Any]]:
    index: kopf.Index[str, dict[str, Any]] = kwargs[HPAS_BY_NAMESPACE]
    return list(index.get(namespace, []))


Each = Callable[[Any, str, str], Awaitable[None]]  # (memo, namespace, name)


class Periodic:
    """Run `each` for every TandemDeployment kopf has indexed, every `seconds`
    (the first round after one interval). Deployments run side by side, so a
    slow one (a router that does not answer) delays no other; a failure is
    logged and the next round tries again."""

    def __init__(
        self,
        name: str,
        seconds: float,
        deployments: kopf.Index[str, str],
        each: Each,
        memo: Any,
    ) -> None:
        self.name, self.seconds, self.deployments = name, seconds, deployments
        self.each, self.memo = each, memo
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"tandem-{self.name}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.seconds)
            keys = sorted({(ns, n) for ns in self.deployments for n in self.deployments[ns]})
            await asyncio.gather(*(self.one(ns, n) for ns, n in keys))

    async def one(self, namespace: str, name: str) -> None:
        try:
            await self.each(self.memo, namespace, name)
        except Exception:
            log.exception("%s of %s/%s failed; the next round retries", self.name, namespace, name)


class Handlers:
    """The handlers of one operator process, with what they share: its
    settings and a lock per TandemDeployment. kopf passes each its indexes
    by name among the keyword arguments."""

    def __init__(self, settings: OperatorSettings, simulator: Simulator | None = None) -> None:
        self.settings = settings
        self.simulator = simulator  # checks decisions (scaling.simulation); None: no checks
        self.locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def reconcile(
        self, memo: Any, namespace: str, name: str, hpas: list[dict[str, Any]]
    ) -> None:
        async with self.locks[(namespace, name)]:
            body = await memo.kube.get(API_VERSION, "TandemDeployment", namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            await controller.reconcile_deployment(memo.kube, body, memo.events, hpas)

    async def startup(self, *, settings: kopf.OperatorSettings, memo: Any, **kwargs: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        # A deleted TandemDeployment keeps kopf's finalizer until the resync timer
        # has stopped; when a reconcile is running at that moment kopf looks again
        # only after this many seconds (its default, 60, held every deletion and
        # the operator's own shutdown for a minute whenever it met a running pass).
        settings.background.cancellation_polling = 1.0
        memo.kube = await Kube.connect(self.settings.kubeconfig)
        memo.metrics_sources = live.Sources()
        memo.events = Events(memo.kube)
        deployments: kopf.Index[str, str] = kwargs[DEPLOYMENTS_BY_NAMESPACE]
        memo.hpas = kwargs[HPAS_BY_NAMESPACE]
        memo.loops = [
            Periodic("resync", self.settings.resync_seconds, deployments, self.resync, memo),
            Periodic(
                "scaling", self.settings.scaling_seconds, deployments, self.scaling_tick, memo
            ),
            Periodic(
                "profiles",
                self.settings.resync_seconds,
                kwargs[PROFILES_BY_NAMESPACE],
                self.profile,
                memo,
            ),
        ]
        for loop in memo.loops:
            loop.start()

    async def resync(self, memo: Any, namespace: str, name: str) -> None:
        """The periodic full pass (what no watch event triggers: a router
        turning ready, a pod draining)."""
        hpas: kopf.Index[str, dict[str, Any]] = memo.hpas
        await self.reconcile(memo, namespace, name, list(hpas.get(namespace, [])))

    async def deployment_changed(
        self, *, name: str, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        ns = _namespace(namespace)
        await self.reconcile(memo, ns, name, _hpas(kwargs, ns))
        # The scaling spec's validity too, without waiting for a tick or a metric.
        async with self.locks[(ns, name)]:
            body = await memo.kube.get(API_VERSION, "TandemDeployment", ns, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            await live.check_spec(memo.kube, body, memo.events, time.time())

    async def scaling_tick(self, memo: Any, ns: str, name: str) -> None:
        """The rate-matching controller's decision (operators/live.py)."""
        hpas: kopf.Index[str, dict[str, Any]] = memo.hpas
        async with self.locks[(ns, name)]:
            body = await memo.kube.get(API_VERSION, "TandemDeployment", ns, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                await memo.metrics_sources.forget(ns, name)
                return
            try:
                await live.tick(
                    memo.kube,
                    body,
                    memo.metrics_sources,
                    memo.events,
                    time.time(),
                    list(hpas.get(ns, [])),
                    self.simulator,
                )
            except ApiException as exc:
                # The next tick decides again from what is there; no retry backoff.
                log.warning("scaling tick of %s/%s failed: %s", ns, name, exc)
                memo.events(
                    body,
                    "Warning",
                    "ScalingError",
                    f"API error {exc.status} ({exc.reason}); the next decision retries",
                )

    async def pool_scaled(
        self, *, spec: kopf.Spec, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        ns = _namespace(namespace)
        await self.reconcile(memo, ns, parse_pool(spec).deployment, _hpas(kwargs, ns))

    async def pool_event(
        self, *, spec: kopf.Spec, namespace: str | None, memo: Any, type: str | None, **kwargs: Any
    ) -> None:
        """A deleted EnginePool is put back at once (at its workload's size)."""
        if type == "DELETED":
            ns = _namespace(namespace)
            await self.reconcile(memo, ns, parse_pool(spec).deployment, _hpas(kwargs, ns))

    async def owned_changed(
        self,
        *,
        labels: Mapping[str, str],
        namespace: str | None,
        memo: Any,
        type: str | None,
        **kwargs: Any,
    ) -> None:
        """An object the operator owns changed: a foreign edit is put back at once."""
        if type is None:  # the initial listing: the resume handler covers it
            return
        ns = _namespace(namespace)
        await self.reconcile(memo, ns, labels[LABEL_DEPLOYMENT], _hpas(kwargs, ns))

    async def autoscaler_changed(self, *, namespace: str | None, memo: Any, **kwargs: Any) -> None:
        """An HPA changed: each TandemDeployment of its namespace sees whether it
        now conflicts (its target may have moved off one deployment's pool)."""
        ns = _namespace(namespace)
        deployments: kopf.Index[str, str] = kwargs[DEPLOYMENTS_BY_NAMESPACE]
        memo.hpas = kwargs[HPAS_BY_NAMESPACE]
        for name in sorted(set(deployments.get(ns, []))):
            await self.reconcile(memo, ns, name, _hpas(kwargs, ns))

    async def profile(self, memo: Any, namespace: str, name: str) -> None:
        """Move a TandemProfile on (operators/profile_run.py), under its
        deployment's lock: one profile per pool starts at a time."""
        body = await memo.kube.get(API_VERSION, "TandemProfile", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        deployment = parse_profile(body["spec"]).deployment
        async with self.locks[(namespace, deployment)]:
            body = await memo.kube.get(API_VERSION, "TandemProfile", namespace, name)
            if body is None:
                return
            try:
                await profile_run.reconcile_profile(memo.kube, body, memo.events)
            except ApiException as exc:
                log.warning(
                    "profile %s/%s: API error, the resync retries: %s", namespace, name, exc
                )

    async def profile_changed(
        self, *, name: str, namespace: str | None, memo: Any, **_: Any
    ) -> None:
        await self.profile(memo, _namespace(namespace), name)

    async def profile_job_changed(
        self, *, meta: Mapping[str, Any], namespace: str | None, memo: Any, **_: Any
    ) -> None:
        """A profile Job moved: its TandemProfile (its owner) reads the outcome at once."""
        for owner in meta.get("ownerReferences", []):
            if owner.get("kind") == PROFILE_KIND:
                await self.profile(memo, _namespace(namespace), owner["name"])


async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


async def cleanup(*, memo: Any, **_: Any) -> None:
    for loop in memo.loops:
        await loop.stop()
    await memo.metrics_sources.close()
    await memo.events.close()
    await memo.kube.close()


async def deployment_event(
    *, name: str, namespace: str | None, memo: Any, type: str | None, **_: Any
) -> None:
    """A deleted deployment: close its metrics source (its router scrape client)."""
    if type == "DELETED":
        await memo.metrics_sources.forget(_namespace(namespace), name)


def deployments_by_namespace(*, name: str, namespace: str | None, **_: Any) -> dict[str, str]:
    return {_namespace(namespace): name}


def hpas_by_namespace(
    *, body: kopf.Body, namespace: str | None, **_: Any
) -> dict[str, dict[str, Any]]:
    # A copy: the index keeps it after kopf moves on to the next event.
    return {
        _namespace(namespace): {
            "metadata": copy.deepcopy(dict(body.metadata)),
            "spec": copy.deepcopy(dict(body.spec)),
        }
    }


def profiles_by_namespace(*, name: str, namespace: str | None, **_: Any) -> dict[str, str]:
    return {_namespace(namespace): name}


def register(
    settings: OperatorSettings, simulator: Simulator | None = None
) -> kopf.OperatorRegistry:
    """Every handler of the operator, in a registry for `kopf.operator`;
    `simulator` checks scaling decisions (`tandem operator` gives sim's)."""
    registry = kopf.OperatorRegistry()
    h = Handlers(settings, simulator)
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(id="startup", registry=registry)(h.startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.index(*TD, id=DEPLOYMENTS_BY_NAMESPACE, registry=registry)(deployments_by_namespace)
    kopf.index(*HPA, id=HPAS_BY_NAMESPACE, registry=registry)(hpas_by_namespace)
    # Ids as kopf derived them from the module-level functions these were
    # (kopf keeps a handler's progress under its id).
    for on in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on(*TD, id="deployment_changed", registry=registry)(h.deployment_changed)
    kopf.on.event(*TD, id="deployment_event", registry=registry)(deployment_event)
    kopf.on.field(
        GROUP, VERSION, "enginepools", field="spec.replicas", id="pool_scaled", registry=registry
    )(h.pool_scaled)
    kopf.on.event(GROUP, VERSION, "enginepools", id="pool_event", registry=registry)(h.pool_event)
    for group, version, plural in OWNED:
        kopf.on.event(
            group,
            version,
            plural,
            id=f"owned-{plural}",
            registry=registry,
            labels={"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_DEPLOYMENT: kopf.PRESENT},
        )(h.owned_changed)
    kopf.on.event(*HPA, id="autoscaler_changed", registry=registry)(h.autoscaler_changed)
    kopf.index(*PROFILES, id=PROFILES_BY_NAMESPACE, registry=registry)(profiles_by_namespace)
    for on in (kopf.on.resume, kopf.on.create):
        on(*PROFILES, id="profile_changed", registry=registry)(h.profile_changed)
    kopf.on.event(
        "batch",
        "v1",
        "jobs",
        id="profile-job",
        registry=registry,
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, PROFILE_LABEL: kopf.PRESENT},
    )(h.profile_job_changed)
    return registry
