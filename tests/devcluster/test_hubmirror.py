"""The Hub mirror (devcluster/hubmirror.py) as huggingface_hub meets it: the
real `snapshot_download`, pointed at the mirror on loopback, fetches a model
folder byte for byte (a large file as an LFS blob), keeps what it already
has, and fails on an unknown repo, revision or file with the client's own
exceptions."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from common.ports import free_port
from devcluster.hubmirror import LFS_THRESHOLD, Repo, app, mirror_objects

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model")
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (root / "model.safetensors").write_bytes(os.urandom(LFS_THRESHOLD + 12345))
    # huggingface_hub's bookkeeping in a folder it filled is not served.
    (root / ".cache").mkdir()
    (root / ".cache" / "state").write_text("x")
    return root


@pytest.fixture(scope="module")
def mirror(model_dir: Path) -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(
            app({REPO: Repo.scan(REPO, model_dir)}),
            host="127.0.0.1",
            port=free_port(),
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the mirror did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=10)


def download(mirror: str, tmp_path: Path, repo: str = REPO, revision: str = "main") -> Path:
    return Path(
        snapshot_download(
            repo_id=repo,
            revision=revision,
            endpoint=mirror,
            local_dir=tmp_path / "out",
            cache_dir=tmp_path / "hub-cache",
        )
    )


def test_snapshot_download_fetches_the_folder_through_the_mirror(
    mirror: str, model_dir: Path, tmp_path: Path
):
    got = download(mirror, tmp_path)
    served = ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert (
        sorted(
            p.relative_to(got).as_posix()
            for p in got.rglob("*")
            if p.is_file() and ".cache" not in p.parts
        )
        == served
    )
    for name in served:
        assert (got / name).read_bytes() == (model_dir / name).read_bytes(), name
    # The big file is an LFS blob, as weights are on the Hub: its ETag is its SHA-256.
    head = httpx.head(f"{mirror}/{REPO}/resolve/main/model.safetensors")
    repo = Repo.scan(REPO, model_dir)
    assert head.headers["X-Linked-Etag"].strip('"') == repo.files["model.safetensors"].sha256
    assert head.headers["X-Repo-Commit"] == repo.commit
    # Again (a retried Job): what is complete is kept, not fetched anew.
    mtime = (got / "model.safetensors").stat().st_mtime_ns
    assert download(mirror, tmp_path, revision=repo.commit) == got
    assert (got / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_resumed_download_gets_the_rest_of_a_file(mirror: str, model_dir: Path):
    ranged = httpx.get(
        f"{mirror}/{REPO}/resolve/main/model.safetensors", headers={"Range": "bytes=100-199"}
    )
    assert ranged.status_code == 206
    assert ranged.content == (model_dir / "model.safetensors").read_bytes()[100:200]


def test_unknown_repos_revisions_and_files_fail_as_on_the_hub(mirror: str, tmp_path: Path):
    with pytest.raises(RepositoryNotFoundError):
        download(mirror, tmp_path, repo="nobody/nothing")
    with pytest.raises(RevisionNotFoundError):
        download(mirror, tmp_path, revision="v9")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(
            REPO, "missing.bin", endpoint=mirror, local_dir=tmp_path, cache_dir=tmp_path / "c"
        )


def test_a_mirror_that_is_down_fails_the_download(tmp_path: Path):
    with pytest.raises(LocalEntryNotFoundError):
        download(f"http://127.0.0.1:{free_port()}", tmp_path)


def test_the_mirror_runs_as_a_deployment_and_service_over_host_folders(model_dir: Path):
    deployment, service = mirror_objects({REPO: model_dir})
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert f"--repo={REPO}=/mirror/0" in container["command"]
    assert pod["volumes"] == [{"name": "repo-0", "hostPath": {"path": str(model_dir)}}]
    assert {"mountPath": "/mirror/0", "readOnly": True}.items() <= container["volumeMounts"][
        0
    ].items()
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
