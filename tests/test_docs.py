"""The README and docs/ name things that exist. Reads the Markdown files and
the tree; runs nothing.

MkDocs (`make docs`) checks the links between the pages of docs/; it cannot
check what they name outside docs/. This test does: the README's first
screen shows the two commands a newcomer needs and both are Makefile
targets; every relative link in the README resolves; and, in the README and
every page of docs/, each repository path written as inline code exists,
each `python -m MODULE` names a module of the tree, and each `make TARGET`
is a Makefile target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FIRST_SCREEN_LINES = 24
TOP_FOLDERS = (
    "services",
    "operators",
    "common",
    "kernels",
    "bench",
    "tandem",
    "devcluster",
    "tests",
    "helm",
    "docker",
    "protos",
    "docs",
)
# Benchmarks write their runs there; git ignores it, so a fresh clone has none.
NOT_IN_TREE = ("bench/results",)

INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PYTHON_M = re.compile(r"python -m ([\w.]+)")
# `make X` in inline code or at the start of a line (code blocks); not prose.
MAKE = re.compile(r"(?:^|`)make ([a-z][\w-]*)", re.MULTILINE)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.MULTILINE))


def repo_paths(text: str) -> list[str]:
    """Inline-code spans that are paths under a top-level folder (placeholders
    such as `<dir>` and globs are not paths)."""
    found = []
    for span in INLINE_CODE.findall(text):
        if "/" in span and span.split("/")[0] in TOP_FOLDERS and not re.search(r"[<>*{}$ ]", span):
            found.append(span.rstrip("/"))
    return found


def module_exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_first_screen_shows_make_run_and_make_test():
    first_screen = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    commands = re.findall(r"^(make \S+)", first_screen, flags=re.MULTILINE)
    assert commands == ["make run", "make test"], commands
    targets = makefile_targets()
    assert {"run", "test"} <= targets


def test_readme_links_resolve():
    broken = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_modules_and_targets_exist(page: Path):
    text = page.read_text()
    missing = [
        f"path {p}"
        for p in repo_paths(text)
        if not p.startswith(NOT_IN_TREE) and not (ROOT / p).exists()
    ]
    missing += [
        f"module {m}"
        for m in PYTHON_M.findall(text)
        if m.split(".")[0] in TOP_FOLDERS and not module_exists(m)
    ]
    targets = makefile_targets()
    missing += [f"make target {t}" for t in MAKE.findall(text) if t not in targets]
    assert not missing, missing


def test_the_checks_see_what_they_check():
    """Guards the scans above against matching nothing."""
    text = "\n".join(page.read_text() for page in PAGES)
    assert len(repo_paths(text)) > 50
    assert len(PYTHON_M.findall(text)) > 10
    assert len(MAKE.findall(text)) > 10
    assert repo_paths("see `services/router/` and `bench/results/<time>-x/`") == ["services/router"]
