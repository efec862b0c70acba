"""kopf handlers: thin, each hands the owning TandemDeployment to controller.py.

Every trigger (the deployment itself, its EnginePools' replica counts, any
object the operator owns, an HPA, a periodic timer) runs the same level-based
reconcile; a per-deployment lock keeps two from interleaving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiException

from operators import controller, scaling
from operators.kube import Kube
from operators.manifests import LABEL_DEPLOYMENT, MANAGED_BY
from operators.spec import API_VERSION, GROUP, VERSION

log = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("TANDEM_OPERATOR_RESYNC_SECONDS", "30"))
SCALING_SECONDS = float(os.environ.get("TANDEM_OPERATOR_SCALING_SECONDS", "15"))
_locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
OWNED = [("apps", "v1", "deployments"), ("apps", "v1", "daemonsets"), ("", "v1", "services"),
         ("", "v1", "configmaps"), ("", "v1", "serviceaccounts"),
         ("policy", "v1", "poddisruptionbudgets"), ("networking.k8s.io", "v1", "ingresses"),
         ("rbac.authorization.k8s.io", "v1", "rolebindings")]


def _emit(obj: dict, type_: str, reason: str, message: str) -> None:
    kopf.event(obj, type=type_, reason=reason, message=message[:1024])


async def reconcile(kube: Kube, namespace: str, name: str) -> None:
    async with _locks[(namespace, name)]:
        body = await kube.get(API_VERSION, "TandemDeployment", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        await controller.reconcile_deployment(kube, body, _emit)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # A deleted TandemDeployment keeps kopf's finalizer until the resync timer
    # has stopped; when a reconcile is running at that moment kopf looks again
    # only after this many seconds (its default, 60, held every deletion and
    # the operator's own shutdown for a minute whenever it met a running pass).
    settings.background.cancellation_polling = 1.0
    memo.kube = await Kube.connect(os.environ.get("KUBECONFIG"))
    memo.metrics_sources = scaling.Sources()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.metrics_sources.close()
    await memo.kube.close()


@kopf.on.resume(GROUP, VERSION, "tandemdeployments")
@kopf.on.create(GROUP, VERSION, "tandemdeployments")
@kopf.on.update(GROUP, VERSION, "tandemdeployments")
async def deployment_changed(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(memo.kube, namespace, name)


@kopf.timer(GROUP, VERSION, "tandemdeployments", interval=RESYNC_SECONDS, initial_delay=1)
async def resync(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(memo.kube, namespace, name)


@kopf.timer(GROUP, VERSION, "tandemdeployments", interval=SCALING_SECONDS,
            initial_delay=SCALING_SECONDS)
async def scaling_tick(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """The rate-matching controller's decision (operators/scaling.py)."""
    async with _locks[(namespace, name)]:
        body = await memo.kube.get(API_VERSION, "TandemDeployment", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            await memo.metrics_sources.forget(namespace, name)
            return
        try:
            await scaling.tick(memo.kube, body, memo.metrics_sources, _emit, time.time())
        except ApiException as exc:
            # The next tick decides again from what is there; no retry backoff.
            log.warning("scaling tick of %s/%s failed: %s", namespace, name, exc)
            _emit(body, "Warning", "ScalingError",
                  f"API error {exc.status} ({exc.reason}); the next decision retries")


@kopf.on.delete(GROUP, VERSION, "tandemdeployments", optional=True)
async def deployment_deleted(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Close the deleted deployment's metrics source (its router scrape client)."""
    await memo.metrics_sources.forget(namespace, name)


@kopf.on.field(GROUP, VERSION, "enginepools", field="spec.replicas")
async def pool_scaled(spec: kopf.Spec, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(memo.kube, namespace, spec["deployment"])


async def owned_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                        type: str | None, **_: Any) -> None:
    """An object the operator owns changed: a foreign edit is put back at once."""
    if type is None:  # the initial listing: the resume handler covers it
        return
    await reconcile(memo.kube, namespace, labels[LABEL_DEPLOYMENT])


for _group, _version, _plural in OWNED:
    kopf.on.event(_group, _version, _plural, id=f"owned-{_plural}",
                  labels={"app.kubernetes.io/managed-by": MANAGED_BY,
                          LABEL_DEPLOYMENT: kopf.PRESENT})(owned_changed)


@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers")
async def autoscaler_changed(namespace: str, memo: kopf.Memo, **_: Any) -> None:
    for td in await memo.kube.list(API_VERSION, "TandemDeployment", namespace):
        await reconcile(memo.kube, namespace, td["metadata"]["name"])
