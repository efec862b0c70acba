"""A small client of the API server for the kubelet: requests, and informers
(list, then watch from the list's resourceVersion, relist on 410 or a broken
stream) that keep a cache and call back on every change."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

log = logging.getLogger("devcluster.kubelet")


class Api:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type}
        async with self.session.request(
            method,
            self.url + path,
            data=data,
            headers=headers,
            params=params,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text) if text else None
            except ValueError:
                return resp.status, text

    async def get(self, path: str) -> dict | None:
        status, obj = await self.request("GET", path)
        return obj if status == 200 else None

    async def patch_status(self, namespace: str, name: str, status: dict) -> None:
        code, body = await self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {"status": status},
            "application/merge-patch+json",
        )
        if code not in (200, 404):
            log.warning("pod %s/%s: status not written: %s %s", namespace, name, code, body)


def object_key(obj: dict) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


class Informer:
    """A cache of one kind's objects kept up to date by a watch."""

    def __init__(
        self,
        api: Api,
        path: str,
        on_change: Callable[[], None],
        field_selector: str | None = None,
    ) -> None:
        self.api = api
        self.path = path
        self.field_selector = field_selector
        self.items: dict[tuple[str, str], dict] = {}
        self.on_change = on_change
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"informer {self.path}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._list_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (the server restarts, a stream breaks)
                log.debug("watch %s: %r; listing again", self.path, exc)
                await asyncio.sleep(0.5)

    async def _list_and_watch(self) -> None:
        params = {"fieldSelector": self.field_selector} if self.field_selector else {}
        status, body = await self.api.request("GET", self.path, params=params)
        if status != 200:
            raise RuntimeError(f"list {self.path}: {status} {body}")
        self.items = {object_key(o): o for o in body["items"]}
        self.synced.set()
        self.on_change()
        params = {
            **params,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": body["metadata"]["resourceVersion"],
        }
        async with self.api.session.get(self.api.url + self.path, params=params) as resp:
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    return  # 410 Gone: list again
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self.items.pop(object_key(obj), None)
                else:
                    self.items[object_key(obj)] = obj
                self.on_change()
