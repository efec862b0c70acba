"""reconcile.apply against the fake API server: a concurrent write between its read
and its write gets 409, and the retry keeps both changes (none is lost)."""

from __future__ import annotations

import asyncio

from operators import controller, reconcile
from operators.kube import Kube
from operators.spec import API_VERSION


class RacingKube(Kube):
    """Kube whose first replace is preceded by someone else's write to the object
    (`race_patch`, to `race_subresource` when set)."""

    racer: Kube
    race_patch: dict = {"metadata": {"labels": {"team": "search"}}}
    race_subresource: str | None = None
    raced = 0

    async def replace(self, obj: dict, subresource: str | None = None) -> dict:
        if not self.raced:
            self.raced += 1
            meta = obj["metadata"]
            await self.racer.patch(
                obj["apiVersion"],
                obj["kind"],
                meta["namespace"],
                meta["name"],
                self.race_patch,
                subresource=self.race_subresource,
            )
        return await super().replace(obj, subresource)


def config_map(value: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "settings",
            "namespace": "default",
            "labels": {"app.kubernetes.io/managed-by": "tandem-operator"},
        },
        "data": {"mode": value},
    }


def test_a_conflict_is_retried_and_nothing_is_lost(kube_api):
    async def run() -> tuple[reconcile.Applied, reconcile.Applied, int]:
        racer = await Kube.connect(str(kube_api.kubeconfig))
        kube = await Kube.connect(str(kube_api.kubeconfig))
        racing = RacingKube(kube.api)
        racing.racer = racer
        try:
            first = await reconcile.apply(racing, config_map("a"))
            second = await reconcile.apply(racing, config_map("b"))
            return first, second, racing.raced
        finally:
            await racer.close()
            await kube.close()

    first, second, raced = asyncio.run(run())
    assert first.action == "created" and second.action == "updated" and raced == 1
    stored = kube_api.get("", "v1", "configmaps", "default", "settings")
    assert stored["data"] == {"mode": "b"}  # the operator's change
    assert stored["metadata"]["labels"]["team"] == "search"  # the other writer's
    writes = [int(stored["metadata"]["resourceVersion"])]
    assert writes[0] > int(first.obj["metadata"]["resourceVersion"]) + 1  # two writes landed


def test_an_unchanged_object_is_not_written(kube_api):
    async def run() -> list[str]:
        kube = await Kube.connect(str(kube_api.kubeconfig))
        try:
            return [(await reconcile.apply(kube, config_map("a"))).action for _ in range(3)]
        finally:
            await kube.close()

    assert asyncio.run(run()) == ["created", "unchanged", "unchanged"]


def engine_pool(max_replicas: int) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "EnginePool",
        "metadata": {
            "name": "demo-decode",
            "namespace": "default",
            "labels": {"app.kubernetes.io/managed-by": "tandem-operator"},
        },
        "spec": {
            "deployment": "demo",
            "role": "decode",
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": max_replicas,
        },
    }


def test_kubectl_scale_racing_a_pool_update_is_kept(kube_api):
    """`kubectl scale` landing between the operator's read of a pool and its write
    (here: the template's maxReplicas changed) keeps its count."""

    async def run() -> tuple[list[str], int]:
        racer = await Kube.connect(str(kube_api.kubeconfig))
        kube = await Kube.connect(str(kube_api.kubeconfig))
        racing = RacingKube(kube.api)
        racing.racer = racer
        racing.race_patch = {"spec": {"replicas": 3}}
        racing.race_subresource = "scale"
        try:
            created = await controller._ensure_pool(racing, engine_pool(4), 2, None)
            updated = await controller._ensure_pool(racing, engine_pool(5), 2, None)
            return [created["spec"]["replicas"], updated["spec"]["maxReplicas"]], racing.raced
        finally:
            await racer.close()
            await kube.close()

    (created, max_replicas), raced = asyncio.run(run())
    assert created == 2 and max_replicas == 5 and raced == 1
    stored = kube_api.get("tandem.dev", "v1alpha1", "enginepools", "default", "demo-decode")
    assert stored["spec"]["replicas"] == 3  # the scale's count, not the template's 2
