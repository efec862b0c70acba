"""The operator's Kubernetes client: any kind by apiVersion and kind, dicts in and out.

Built on kubernetes_asyncio's ApiClient (its configuration, auth and
transport); its typed APIs need one method per kind and its dynamic client
returns error Statuses instead of raising on a 409, so objects go through
`ApiClient.call_api` with their REST path here. Every non-2xx answer raises
`kubernetes_asyncio.client.ApiException` (`.status` 404, 409, 422 ...).
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from common.kube import api_client

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# The kinds the operator reads or writes, and their REST plural.
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Event": "events",
    "Deployment": "deployments",
    "DaemonSet": "daemonsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Ingress": "ingresses",
    "RoleBinding": "rolebindings",
    "EndpointSlice": "endpointslices",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "LeaderWorkerSet": "leaderworkersets",
    "TandemDeployment": "tandemdeployments",
    "EnginePool": "enginepools",
    "TandemProfile": "tandemprofiles",
    "Lease": "leases",
    "Job": "jobs",
}


def path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{PLURALS[kind]}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        """In the cluster: the pod's service account; otherwise a kubeconfig."""
        return cls(await api_client(kubeconfig))

    async def close(self) -> None:
        await self.api.close()

    async def _call(
        self,
        method: str,
        url: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        return await self.api.call_api(
            url,
            method,
            query_params=query or [],
            body=body,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self._call(
                "GET", path(api_version, kind, namespace, name)
            )
            return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        found = await self._call("GET", path(api_version, kind, namespace), query=query)
        items: list[dict[str, Any]] = found.get("items", [])
        return items

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        created: dict[str, Any] = await self._call(
            "POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
        )
        return created

    async def replace(self, obj: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        meta = obj["metadata"]
        replaced: dict[str, Any] = await self._call(
            "PUT",
            path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource),
            body=obj,
        )
        return replaced

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict[str, Any]:
        patched: dict[str, Any] = await self._call(
            "PATCH",
            path(api_version, kind, namespace, name, subresource),
            body=body,
            content_type=content_type,
        )
        return patched

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        try:
            await self._call("DELETE", path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status != 404:
                raise
