"""A fake Kubernetes API server over real HTTP, for kopf, kubectl and Kubernetes clients.

kmock (by kopf's author) provides the HTTP side: its aiohttp `Server`, and its
`KubernetesScaffold` for API discovery (`/version`, `/api`, `/apis`,
`/apis/{group}/{version}` built from `resources`) and errors as `kind: Status`.
kmock's `KubernetesEmulator` is not used: it stores objects as plain JSON,
merges every PATCH as a dict whatever its content type, and mutates objects
in a hook that cannot be extended; there is no seam for resourceVersion,
generation or subresources. So the resource endpoints are served here from
`store.Store`, which keeps Kubernetes' semantics (see its docstring), and
this module adds what clients rely on over HTTP:

* lists with `kind: XList` and a real `metadata.resourceVersion`; label and
  field selectors;
* watches: from a resourceVersion (410 Gone as an ERROR event once it is older
  than the kept history), the initial ADDED events without one, BOOKMARK events
  with `allowWatchBookmarks`, `timeoutSeconds`, objects entering and leaving a
  label selector as ADDED/DELETED;
* `/status` and `/scale` subresources (`autoscaling/v1 Scale`);
* `Table` responses (what `kubectl get` asks for): kubectl's columns for the
  built-in kinds, the CRD's printer columns for custom resources (tables.py);
* `fieldValidation` (Strict refuses unknown fields, Warn prunes them with a
  `Warning` header, Ignore prunes them);
* CRDs: POSTing one serves its kinds at once, with discovery;
* the protobuf bodies of kubectl's typed generators for the kinds in
  protobuf.py (`kubectl create namespace` and its kin);
* `/api/v1/namespaces` itself, which kmock's path parser cannot split;
* `pods/{name}/log` (`kubectl logs`) from the process kubelet's files (podlogs.py).

Use `RunningApiServer` (or the pytest fixtures in tests/kube/plugin.py) and
`write_kubeconfig()` to point kubectl, kopf or a client at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from devcluster import podlogs, protobuf, tables
from devcluster.kinds import Kind
from devcluster.store import (
    FIELD_VALIDATION,
    ApiError,
    Event,
    Store,
    Subscription,
    bad_request,
)

Json = Any

# The Kubernetes release whose schemas validate the built-in kinds (store.py);
# the server reports it, so clients and Helm's kubeVersion checks agree with it.
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0+devcluster",
    "gitCommit": "",
    "gitTreeState": "clean",
    "buildDate": "2024-12-11T00:00:00Z",
    "goVersion": "",
    "compiler": "",
    "platform": "linux/amd64",
}


def query_bool(value: str | None) -> bool:
    """A boolean query parameter as the API server reads one: absent, empty,
    "0" or any case of "false" is false, anything else true (clients send
    "true", "1" or Python's "True")."""
    return bool(value) and value != "0" and value.lower() != "false"


def _parse_path(path: str) -> tuple[str, str, list[str]] | None:
    """(group, version, rest) for /api/v1/... and /apis/{g}/{v}/...; None otherwise."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        return "", parts[1], parts[2:]
    if len(parts) >= 3 and parts[0] == "apis":
        return parts[1], parts[2], parts[3:]
    return None


def _split_rest(rest: list[str]) -> tuple[str | None, str, str | None, str | None]:
    """(namespace, plural, name, subresource) from the path after group/version."""
    if rest[0] == "namespaces" and len(rest) == 3 and rest[2] in ("status", "finalize"):
        return None, "namespaces", rest[1], rest[2]
    if rest[0] == "namespaces" and len(rest) >= 3:
        ns, plural, *more = rest[1:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        return None, "namespaces", rest[1], None
    else:
        ns, plural, more = None, rest[0], rest[1:]
    name = more[0] if more else None
    sub = "/".join(more[1:]) or None
    return ns, plural, name, sub


@attrs.define(kw_only=True)
class FakeApiServer(kmock.KubernetesScaffold):
    """kmock's Kubernetes scaffold serving a `Store` with Kubernetes semantics."""

    history: int = 1000
    bookmark_interval: float = 1.0
    validate_builtins: bool = True
    # kmock records every request (iterating the handler lists them: tests check
    # RBAC with it); a server that runs for hours (python -m devcluster) keeps none.
    keep_requests: bool = True
    # Where the process kubelet writes container logs (podlogs.py); None: no kubelet.
    pod_log_dir: Path | None = None
    store: Store = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = Store(history=self.history, validate_builtins=self.validate_builtins)
        self.store.on_kinds_changed = self._publish_kinds
        self._publish_kinds()

    def _publish_kinds(self) -> None:
        served = {kmock.resource(*k.key) for k in self.store.kinds.values()}
        for res in list(self.resources):
            if res not in served:
                del self.resources[res]
        for kind in self.store.kinds.values():
            self.resources[kmock.resource(*kind.key)] = kmock.ResourceInfo(
                kind=kind.kind,
                singular=kind.singular or kind.kind.lower(),
                shortnames=set(kind.short_names),
                verbs=kind.verbs(),
                subresources=kind.subresources,
                namespaced=kind.namespaced,
            )

    async def __call__(self, raw_request: Any) -> Any:
        # kmock decodes every body as text, so a protobuf body (kubectl's typed
        # generators send one) is decoded here first; and its path parser fails
        # on /api/v1/namespaces. Both are served without it.
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            try:
                body = protobuf.decode(await raw_request.read())
            except (protobuf.ProtobufError, UnicodeDecodeError) as exc:
                return await self._render_error(ApiError(415, "UnsupportedMediaType", str(exc), {}))
            return await self._serve_raw(raw_request, json.dumps(body).encode())
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_raw(raw_request, await raw_request.read())
        parts = raw_request.path.strip("/").split("/")
        if (
            parts[:3] == ["api", "v1", "namespaces"]
            and parts[4:5] == ["pods"]
            and parts[6:] == ["log"]
        ):
            try:
                return await podlogs.serve(
                    self.store, self.pod_log_dir, raw_request, parts[3], parts[5]
                )
            except ApiError as exc:
                return await self._render_error(exc)
        try:
            return await super().__call__(raw_request)
        finally:
            if not self.keep_requests:
                self._requests.clear()

    async def _serve_raw(self, raw_request: Any, body: bytes) -> Any:
        request = kmock.Request(
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
        )
        if self.keep_requests:
            self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as exc:  # noqa: BLE001  (a Status body, as kmock's own path does)
            return await self._render_error(exc)

    async def _render_error(self, exc: Exception) -> Any:
        if isinstance(exc, ApiError):
            # kmock fills empty details with a traceback; a user reads this body.
            return aiohttp.web.json_response(_status_object(exc), status=exc.status)
        return await super()._render_error(exc)

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        return dict(SERVER_VERSION)

    async def _handle(self, request: kmock.Request) -> Any:
        path = request.url.path
        parsed = _parse_path(path)
        warnings: list[str] = []
        try:
            if path.startswith("/openapi/v3"):
                payload, status = self._openapi_v3(path), 200
            elif parsed is None or not parsed[2]:
                return await super()._handle(request)  # discovery, /version
            else:
                payload, status = await self._serve(request, *parsed, warnings)
        except ApiError as exc:
            return await self._render_error(exc)
        # Watches too are JSON (a stream of objects): clients pick their decoder by it.
        headers = {"Content-Type": "application/json"}
        if warnings:
            # Each warning a `299` warn-value, comma-joined as HTTP allows; kubectl
            # prints each as "Warning: ...".
            headers["Warning"] = ", ".join(
                '299 - "' + w.replace("\\", "\\\\").replace('"', '\\"') + '"' for w in warnings
            )
        return await kmock.Response(status=status, payload=payload, headers=headers)(request)

    async def _serve_version(self, request: kmock.Request) -> Any:
        """APIResourceList for /api/v1 and /apis/{group}/{version}, subresources included."""
        parsed = _parse_path(request.url.path)
        assert parsed is not None
        group, version, _ = parsed
        kinds = [k for k in self.store.kinds.values() if (k.group, k.version) == (group, version)]
        if not kinds:
            raise kmock.KubernetesResourceNotFoundError()
        resources = []
        for kind in kinds:
            resources.append(
                {
                    "name": kind.plural,
                    "singularName": kind.singular or kind.kind.lower(),
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": sorted(kind.verbs()),
                    "shortNames": list(kind.short_names),
                    "categories": list(kind.categories),
                }
            )
            for sub in sorted(kind.subresources):
                resources.append(
                    {
                        "name": f"{kind.plural}/{sub}",
                        "singularName": "",
                        "namespaced": kind.namespaced,
                        "group": "autoscaling" if sub == "scale" else kind.group,
                        "version": "v1" if sub == "scale" else kind.version,
                        "kind": "Scale" if sub == "scale" else kind.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _openapi_v3(self, path: str) -> dict:
        """Just enough OpenAPI v3 for kubectl to see server-side field validation.

        kubectl validates on the server (sending `fieldValidation=Strict`) when the
        group-version's document lists that parameter on the kind's PATCH; the
        schemas themselves are applied here by the store.
        """
        gvs = sorted({(k.group, k.version) for k in self.store.kinds.values()})

        def gv_path(group: str, version: str) -> str:
            return f"apis/{group}/{version}" if group else f"api/{version}"

        if path.rstrip("/") == "/openapi/v3":
            return {
                "paths": {
                    gv_path(g, v): {
                        "serverRelativeURL": f"/openapi/v3/{gv_path(g, v)}?hash={self.store.rv}"
                    }
                    for g, v in gvs
                }
            }
        wanted = path[len("/openapi/v3/") :].strip("/")
        match = [(g, v) for g, v in gvs if gv_path(g, v) == wanted]
        if not match:
            raise ApiError(404, "NotFound", f"no OpenAPI document for {wanted}", {})
        group, version = match[0]
        paths = {}
        for kind in self.store.kinds.values():
            if (kind.group, kind.version) != (group, version):
                continue
            prefix = f"/{gv_path(group, version)}/"
            prefix += "namespaces/{namespace}/" if kind.namespaced else ""
            gvk = {"group": group, "version": version, "kind": kind.kind}
            operation = {
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [
                    {
                        "name": "fieldValidation",
                        "in": "query",
                        "schema": {"type": "string", "uniqueItems": True},
                    }
                ],
                "responses": {"200": {"description": "OK"}},
            }
            paths[f"{prefix}{kind.plural}/{{name}}"] = {"patch": operation, "put": operation}
            paths[f"{prefix}{kind.plural}"] = {"post": operation}
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "fake"},
            "paths": paths,
            "components": {"schemas": {}},
        }

    async def _serve(
        self,
        request: kmock.Request,
        group: str,
        version: str,
        rest: list[str],
        warnings: list[str],
    ) -> tuple[Any, int]:
        store = self.store
        namespace, plural, name, sub = _split_rest(rest)
        kind = store.kind(group, version, plural)
        if not kind.namespaced and namespace is not None:
            raise ApiError(404, "NotFound", f"{plural} is not namespaced", {})
        params = request.params
        method = request.method.value.upper()
        if sub not in (None, "status", "scale"):
            raise ApiError(404, "NotFound", f"unknown subresource {sub!r}", {})
        if sub == "scale" and kind.scale is None:
            raise ApiError(404, "NotFound", f"{plural} has no scale subresource", {})
        if sub == "status" and not kind.status:
            raise ApiError(404, "NotFound", f"{plural} has no status subresource", {})
        body = self._body(request) if method in ("POST", "PUT", "PATCH", "DELETE") else None
        # Kubernetes' default since 1.27 is Warn: unknown fields pruned, each one reported.
        validation = params.get("fieldValidation") or "Warn"
        if validation not in FIELD_VALIDATION:
            raise bad_request(
                f'fieldValidation must be one of "Ignore", "Warn" or "Strict", not "{validation}"'
            )

        if method == "GET" and name is None:
            if query_bool(params.get("watch")):
                return self._watch(kind, namespace, params), 200
            items = store.list(
                kind, namespace, params.get("labelSelector"), params.get("fieldSelector")
            )
            if self._wants_table(request):
                return tables.table(kind, items, str(store.rv)), 200
            return {
                "apiVersion": kind.api_version,
                "kind": kind.list_kind,
                "metadata": {"resourceVersion": str(store.rv)},
                "items": items,
            }, 200
        if method == "GET":
            obj = store.get(kind, namespace, name)
            if sub == "scale":
                return store.scale_of(kind, obj), 200
            if self._wants_table(request):
                return tables.table(kind, [obj], str(store.rv)), 200
            return obj, 200
        if method == "POST" and name is None:
            if not isinstance(body, dict):
                raise bad_request("the body of a create must be an object")
            dry = (
                "All" in params.getall("dryRun", [])
                if hasattr(params, "getall")
                else params.get("dryRun") == "All"
            )
            return store.create(kind, namespace, body, dry, validation, warnings), 201
        if method == "PUT" and name is not None:
            if not isinstance(body, dict):
                raise bad_request("the body of an update must be an object")
            if sub == "scale":
                return store.replace_scale(kind, namespace, name, body), 200
            return store.replace(kind, namespace, name, body, sub, validation, warnings), 200
        if method == "PATCH" and name is not None:
            content_type = request.headers.get("Content-Type", "application/merge-patch+json")
            patched = store.patch(
                kind, namespace, name, body, content_type, sub, validation, warnings
            )
            return patched, 200
        if method == "DELETE" and name is not None:
            options = dict(body) if isinstance(body, dict) else {}
            for key in ("propagationPolicy", "gracePeriodSeconds"):
                if key in params:
                    value = params[key]
                    options[key] = int(value) if key == "gracePeriodSeconds" else value
            return store.delete(kind, namespace, name, options), 200
        if method == "DELETE":
            items = store.delete_collection(
                kind,
                namespace,
                params.get("labelSelector"),
                params.get("fieldSelector"),
                body if isinstance(body, dict) else None,
            )
            return {
                "apiVersion": kind.api_version,
                "kind": kind.list_kind,
                "metadata": {"resourceVersion": str(store.rv)},
                "items": items,
            }, 200
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here", {})

    @staticmethod
    def _body(request: kmock.Request) -> Json:
        if not request.body:
            return None
        try:
            return json.loads(request.body)
        except ValueError:
            try:
                return yaml.safe_load(request.body)
            except yaml.YAMLError:
                raise bad_request("the request body is neither JSON nor YAML") from None

    # ---- watch ---------------------------------------------------------------

    async def _watch(self, kind: Kind, namespace: str | None, params: Any) -> AsyncIterator[Any]:
        store = self.store
        labels_ok, fields_ok = store.matchers(
            params.get("labelSelector"), params.get("fieldSelector"), kind.field_selectors
        )
        bookmarks = query_bool(params.get("allowWatchBookmarks"))
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        rv_param = params.get("resourceVersion") or ""

        def visible(obj: dict | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            return labels_ok(meta.get("labels")) and fields_ok(obj)

        sub = Subscription(kind)
        try:
            # Read the backlog and subscribe with no await in between: nothing is missed.
            if rv_param in ("", "0"):
                backlog = [
                    Event(int(o["metadata"]["resourceVersion"]), "ADDED", o)
                    for o in store.list(kind, namespace)
                ]
            else:
                backlog = list(store.events_since(kind, int(rv_param)))
            store.subscriptions.add(sub)
        except ApiError as exc:
            yield b""
            yield {"type": "ERROR", "object": _status_object(exc)}
            return
        try:
            yield b""  # send the headers now: the client sees the watch open
            last_rv = store.rv if rv_param in ("", "0") else int(rv_param)
            for event in backlog:
                out = _translate(event, visible)
                if out is not None:
                    yield out
                last_rv = max(last_rv, event.rv)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                wait = self.bookmark_interval if bookmarks else None
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        return
                    wait = left if wait is None else min(wait, left)
                try:
                    event = await asyncio.wait_for(sub.queue.get(), wait)
                except TimeoutError:
                    # Events reach the queue as they are written: empty, every
                    # event up to store.rv was sent. An event can also land while
                    # the timeout cancels the get; then it goes first.
                    if bookmarks and sub.queue.empty():
                        yield {
                            "type": "BOOKMARK",
                            "object": {
                                "apiVersion": kind.api_version,
                                "kind": kind.kind,
                                "metadata": {"resourceVersion": str(max(last_rv, store.rv))},
                            },
                        }
                    continue
                if event.rv <= last_rv:
                    continue
                last_rv = event.rv
                out = _translate(event, visible)
                if out is not None:
                    yield out
        finally:
            store.subscriptions.discard(sub)

    # ---- tables --------------------------------------------------------------

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    # ---- direct access for tests ----------------------------------------------

    def install(self, *documents: dict) -> None:
        """Create objects (CRDs included) as if POSTed; call on the server's loop."""
        for doc in documents:
            group, _, version = doc["apiVersion"].rpartition("/")
            kind = next(
                k
                for k in self.store.kinds.values()
                if k.kind == doc["kind"] and k.group == group and k.version == version
            )
            self.store.create(kind, doc.get("metadata", {}).get("namespace"), doc)


def _translate(event: Event, visible) -> dict | None:
    """One stored event as a selector-filtered watch event (or None)."""
    now, before = visible(event.obj if event.type != "DELETED" else None), visible(event.old)
    if event.type == "DELETED":
        return {"type": "DELETED", "object": event.obj} if visible(event.obj) else None
    if event.type == "ADDED":
        return {"type": "ADDED", "object": event.obj} if now else None
    if now and before:
        return {"type": "MODIFIED", "object": event.obj}
    if now:
        return {"type": "ADDED", "object": event.obj}
    if before:
        return {"type": "DELETED", "object": event.obj}
    return None


def _status_object(exc: ApiError) -> dict:
    status = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": exc.status,
        "reason": exc.reason,
        "message": exc.message,
    }
    if exc.details:
        status["details"] = exc.details
    return status


def load_yaml_documents(*paths: str | Path) -> list[dict]:
    docs: list[dict] = []
    for path in paths:
        with open(path) as f:
            docs.extend(d for d in yaml.safe_load_all(f) if d)
    return docs


class RunningApiServer:
    """A FakeApiServer served on loopback from its own thread and event loop.

    Tests (sync or async), kubectl and subprocesses reach it over HTTP at
    `url`; `call(fn, *args)` runs `fn` on the server's loop (the store is not
    thread-safe) and returns its result. With `controllers=True` the
    controllers of devcluster/controllers run on that loop too.
    """

    def __init__(self, controllers: bool = False, **options: Any) -> None:
        self._options = options
        self._controllers = controllers
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fake-apiserver", daemon=True)
        self.handler: FakeApiServer | None = None
        self.controllers: Any = None  # a ControllerManager when controllers=True
        self.url = ""
        self.kubeconfig: Path | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        try:
            self._stop = asyncio.Event()
            handler = FakeApiServer(**self._options)
            async with handler, kmock.Server(handler) as server:
                self.handler = handler
                self.url = str(server.url).rstrip("/")
                if self._controllers:
                    from devcluster.controllers import ControllerManager

                    self.controllers = ControllerManager(handler.store)
                    self.controllers.start()
                self._ready.set()
                await self._stop.wait()
                if self.controllers is not None:
                    await self.controllers.stop()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise

    def start(self) -> RunningApiServer:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or not self.url:
            raise RuntimeError(f"fake API server did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    @property
    def store(self) -> Store:
        assert self.handler is not None
        return self.handler.store

    def install(self, *documents: dict) -> None:
        assert self.handler is not None
        self.call(self.handler.install, *documents)

    def install_files(self, *paths: str | Path) -> None:
        self.install(*load_yaml_documents(*paths))

    def get(self, group: str, version: str, plural: str, namespace: str | None, name: str) -> dict:
        return self.call(
            lambda: self.store.get(self.store.kind(group, version, plural), namespace, name)
        )

    def list(
        self,
        group: str,
        version: str,
        plural: str,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> list[dict]:
        return self.call(
            lambda: self.store.list(
                self.store.kind(group, version, plural), namespace, label_selector
            )
        )

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        return write_kubeconfig(self.url, path, namespace)

    def __enter__(self) -> RunningApiServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_kubeconfig(url: str, path: str | Path, namespace: str = "default") -> Path:
    """A kubeconfig whose current context talks to `url` (plain HTTP, no credentials)."""
    path = Path(path)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [
            {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
        ],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running(**options: Any) -> Iterator[RunningApiServer]:
    server = RunningApiServer(**options).start()
    try:
        yield server
    finally:
        server.stop()
