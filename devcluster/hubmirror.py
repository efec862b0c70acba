"""A Hugging Face Hub mirror of local model folders, for the local cluster.

The Hub cannot be reached from these machines, as from an air-gapped
cluster: there, `model.hubEndpoint` (the download Job's `HF_ENDPOINT`)
points huggingface_hub at a mirror inside the network. This is one for the
local cluster: each `--repo org/name=DIR` serves DIR as the Hub serves a
model repository at one commit, with the endpoints huggingface_hub's
`snapshot_download` calls, so the real client downloads through it
unchanged:

    GET      /api/models/{org}/{name}/revision/{revision}   repo_info: id, sha, siblings
    GET      /api/models/{org}/{name}/tree/{revision}       list_repo_tree (recursive or not)
    HEAD|GET /{org}/{name}/resolve/{revision}/{path}        a file, with the Hub's headers

`revision` is `main` or the commit, a hash of the folder's file list and
contents. Files of 10 MiB or more are stored as the Hub stores weights, in
Git LFS: their ETag is the content's SHA-256 (computed once at start: a few
seconds per GB) and the tree lists their LFS pointer; smaller files' ETag is
their git blob id. Errors are the Hub's: 404 with `X-Error-Code`
RepoNotFound, RevisionNotFound or EntryNotFound, which huggingface_hub turns
into its own exceptions. Ranges (a resumed download) are served. No
authentication, no xet, no datasets or spaces, no pagination (a tree is one
page).

    python -m devcluster.hubmirror --repo HuggingFaceTB/SmolLM2-135M-Instruct=DIR --port 8080

On the local cluster it runs as a pod (`mirror_objects`: a Deployment and
a Service, the folders mounted from the host); its image maps to this
checkout there, so it does not run on a real cluster.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

log = logging.getLogger(__name__)

LFS_THRESHOLD = 10 * 1024 * 1024
LFS_SPEC = "https://git-lfs.github.com/spec/v1"
PORT = 8080
# Where the pod of `mirror_objects` mounts the i-th folder.
MOUNT = "/mirror"
# huggingface_hub's own state in a folder it downloaded into: not the model's.
SKIPPED = {".cache"}


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class RepoFile:
    path: str  # relative, with /
    local: Path
    size: int
    oid: str  # git blob id (of the LFS pointer for an LFS file)
    sha256: str | None  # LFS files only
    pointer_size: int | None

    @property
    def etag(self) -> str:
        return self.sha256 or self.oid

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": self.path, "size": self.size}
        entry["oid"] = self.oid
        if self.sha256 is not None:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry


def scan_file(root: Path, local: Path) -> RepoFile:
    rel = local.relative_to(root).as_posix()
    size = local.stat().st_size
    if size < LFS_THRESHOLD:
        return RepoFile(rel, local, size, _git_blob_id(local.read_bytes()), None, None)
    sha = _sha256(local)
    pointer = f"version {LFS_SPEC}\noid sha256:{sha}\nsize {size}\n".encode()
    return RepoFile(rel, local, size, _git_blob_id(pointer), sha, len(pointer))


@dataclass(frozen=True)
class Repo:
    repo_id: str
    files: dict[str, RepoFile]
    commit: str

    @classmethod
    def scan(cls, repo_id: str, root: Path) -> Repo:
        if not root.is_dir():
            raise ValueError(f"{repo_id}: {root} is not a folder")
        files = {
            f.path: f
            for local in sorted(root.rglob("*"))
            if local.is_file() and not SKIPPED & set(local.relative_to(root).parts)
            for f in [scan_file(root, local)]
        }
        listing = "".join(f"{f.path}\0{f.oid}\n" for f in files.values())
        return cls(repo_id, files, hashlib.sha1(listing.encode()).hexdigest())

    def knows(self, revision: str) -> bool:
        return revision in ("main", self.commit)

    def tree(self, recursive: bool) -> list[dict[str, Any]]:
        if recursive:
            return [f.tree_entry() for f in self.files.values()]
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        for f in self.files.values():
            top, _, rest = f.path.partition("/")
            if not rest:
                out.append(f.tree_entry())
            elif top not in folders:
                folders.add(top)
                oid = hashlib.sha1(f"{self.commit}/{top}".encode()).hexdigest()
                out.append({"type": "directory", "path": top, "size": 0, "oid": oid})
        return out


def _hub_error(code: str, message: str) -> Response:
    return JSONResponse(
        {"error": message},
        status_code=404,
        headers={"X-Error-Code": code, "X-Error-Message": message},
    )


def app(repos: Mapping[str, Repo]) -> Starlette:
    def repo_at(request: Request) -> tuple[Repo | None, Response | None]:
        repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
        repo = repos.get(repo_id)
        if repo is None:
            return None, _hub_error("RepoNotFound", f"Repository {repo_id} not found")
        revision = request.path_params["revision"]
        if not repo.knows(revision):
            return None, _hub_error(
                "RevisionNotFound", f"Invalid rev id: {revision} (this mirror: main, {repo.commit})"
            )
        return repo, None

    async def repo_info(request: Request) -> Response:
        repo, error = repo_at(request)
        if repo is None:
            assert error is not None
            return error
        return JSONResponse(
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": repo.commit,
                "private": False,
                "gated": False,
                "disabled": False,
                "siblings": [{"rfilename": path} for path in repo.files],
            }
        )

    async def tree(request: Request) -> Response:
        repo, error = repo_at(request)
        if repo is None:
            assert error is not None
            return error
        recursive = request.query_params.get("recursive", "").lower() in ("1", "true")
        return JSONResponse(repo.tree(recursive))

    async def resolve(request: Request) -> Response:
        repo, error = repo_at(request)
        if repo is None:
            assert error is not None
            return error
        f = repo.files.get(request.path_params["path"])
        if f is None:
            response = _hub_error("EntryNotFound", f"{request.path_params['path']} not found")
            response.headers["X-Repo-Commit"] = repo.commit
            return response
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{f.etag}"'}
        if f.sha256 is not None:
            headers |= {"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)}
        return FileResponse(f.local, headers=headers)

    async def health(request: Request) -> Response:
        return JSONResponse({r.repo_id: r.commit for r in repos.values()})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/api/models/{org}/{name}/revision/{revision}", repo_info),
            Route("/api/models/{org}/{name}/tree/{revision}", tree),
            Route("/{org}/{name}/resolve/{revision}/{path:path}", resolve, methods=["GET", "HEAD"]),
        ]
    )


def parse_repo(text: str) -> tuple[str, Path]:
    """`org/name=DIR`."""
    repo_id, sep, folder = text.partition("=")
    if not sep or repo_id.count("/") != 1 or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: expected org/name=DIR")
    return repo_id, Path(folder)


def mirror_objects(
    repos: Mapping[str, Path], name: str = "hub-mirror", port: int = PORT
) -> list[dict[str, Any]]:
    """A Deployment running the mirror over the host folders `repos` (read-only
    hostPath volumes) and its Service: `HF_ENDPOINT=http://<name>:<port>`."""
    labels = {"app.kubernetes.io/name": name}
    volumes = [
        {"name": f"repo-{i}", "hostPath": {"path": str(folder)}}
        for i, folder in enumerate(repos.values())
    ]
    container = {
        "name": "mirror",
        "image": "ghcr.io/tandem-serving/tandem:latest",
        "command": [
            "python",
            "-m",
            "devcluster.hubmirror",
            f"--port={port}",
            *(f"--repo={repo}={MOUNT}/{i}" for i, repo in enumerate(repos)),
        ],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1},
        "volumeMounts": [
            {"name": v["name"], "mountPath": f"{MOUNT}/{i}", "readOnly": True}
            for i, v in enumerate(volumes)
        ],
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [container], "volumes": volumes},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "selector": labels,
                "ports": [{"name": "http", "port": port, "targetPort": "http"}],
            },
        },
    ]


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m devcluster.hubmirror",
        description="Serve local model folders as the Hugging Face Hub serves model repos "
        "(for HF_ENDPOINT / model.hubEndpoint).",
    )
    parser.add_argument(
        "--repo",
        type=parse_repo,
        action="append",
        required=True,
        metavar="ORG/NAME=DIR",
        help="serve DIR as the model repo ORG/NAME (repeatable)",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    repos = {}
    for repo_id, folder in args.repo:
        repo = Repo.scan(repo_id, folder)
        log.info("%s: %d files at commit %s (%s)", repo_id, len(repo.files), repo.commit, folder)
        repos[repo_id] = repo
    uvicorn.run(app(repos), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
