"""Where a deployment's model weights come from (`model.source`), and the
download that fills a cache volume from the Hugging Face Hub.

    hf://org/name[@revision]   downloaded once into a cache volume
    pvc://claim[/path]         already on a PersistentVolumeClaim
    /local/path                a path inside the engine image (or a mounted volume)

Engines read weights under one mount (`MOUNT`): a Hub model at
`MOUNT/hf/org/name/revision` of the cache volume, a claim's path at
`MOUNT/path`. `python -m common.model_source SOURCE` downloads a Hub model
to its place under `MOUNT` (the download Job's command; `HF_TOKEN` from the
environment for gated models) and writes nothing for the other kinds.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

MOUNT = "/models"
HF, PVC, LOCAL = "hf", "pvc", "local"
_HF = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(?P<path>/.*)?$")
# The CRD's pattern for model.source: the three forms above, checked by the API server.
PATTERN = r"^(hf://[\w.-]+/[\w.-]+(@[\w./-]+)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|/.*)$"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # HF, PVC or LOCAL
    repo: str | None = None  # HF: org/name
    revision: str = "main"  # HF
    claim: str | None = None  # PVC
    path: str = ""  # PVC: inside the claim; LOCAL: the path itself

    @property
    def model_path(self) -> str:
        """Where the engines find the weights."""
        if self.kind == HF:
            return f"{MOUNT}/hf/{self.repo}/{self.revision}"
        if self.kind == PVC:
            return MOUNT + (self.path.rstrip("/") or "")
        return self.path

    @property
    def name(self) -> str:
        """The model's own name: the Hub id, else its path."""
        return self.repo if self.kind == HF and self.repo else self.model_path


def parse_source(text: str) -> ModelSource:
    """`text` as a ModelSource; ValueError naming the accepted forms."""
    if m := _HF.match(text):
        return ModelSource(HF, repo=m["repo"], revision=m["revision"] or "main")
    if m := _PVC.match(text):
        return ModelSource(PVC, claim=m["claim"], path=m["path"] or "")
    if text.startswith("/"):
        return ModelSource(LOCAL, path=text)
    raise ValueError(
        f"model source {text!r}: expected hf://org/name[@revision], pvc://claim[/path] "
        "or an absolute path"
    )


def download(source: ModelSource) -> str:
    """Fetch a Hub model into its place under MOUNT; returns that folder.
    Files already complete there are kept (a retried Job resumes)."""
    from huggingface_hub import snapshot_download

    assert source.kind == HF and source.repo
    return snapshot_download(
        repo_id=source.repo, revision=source.revision, local_dir=source.model_path
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m common.model_source SOURCE", file=sys.stderr)
        return 2
    try:
        source = parse_source(args[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if source.kind != HF:
        print(f"{args[0]}: nothing to download", file=sys.stderr)
        return 0
    print(f"downloaded {source.repo}@{source.revision} to {download(source)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
