"""Imports point down only (docs/design.md, "Layers"), read from every module's
source with `ast`; nothing is imported or run.

Rules, each checked over every first-party module (lazy imports inside
functions included):

1. Layers, top to bottom: ``bench`` → ``tandem`` (the launcher) and ``sim``
   (the cluster simulator) →
   ``services``, ``operators``, ``devcluster`` → ``kernels`` → ``common``. A module imports
   its own package and the layers below it, never one above (``tests`` sit
   above everything and are exempt from this rule). ``bench`` is not part of
   the product: it may import anything, and no product package (``tandem``
   included) imports it; only tests do. ``kernels`` is a compute library the
   data path calls (the store connector packs blocks with it), so it sits
   below the services and imports none of them.
2. ``services``, ``operators`` and ``devcluster`` (the local stand-in for
   Kubernetes, no part of Tandem's control plane) share a layer and do not
   import each other (modules of ``services`` import each other freely).
3. No module edits ``sys.path`` (tests neither): imports resolve from the
   repository root.
4. No ``from x import _name`` across modules outside tests: an underscore name
   belongs to its module.
5. ``sim`` shares the launcher's layer: it drives the routing core and the
   planner (below) with traffic from ``tandem.workload`` (the trace format and
   generator, which ``tandem profile`` and ``bench`` use too), and the launcher's
   ``tandem sim`` calls it. So that no cycle forms, ``sim`` imports nothing of
   ``tandem`` but ``tandem.workload``, and nothing of ``tandem`` but ``tandem.cli``
   imports ``sim``.
6. A test module never imports another test file (``test_*``) or a conftest:
   what several test files share lives in a helper module (``tests.helpers``;
   ``tests.planner.synthetic`` for the planner's synthetic profiles).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Rank of each top-level package; a module imports only ranks at or below its own.
RANK = {
    "common": 0,
    "kernels": 1,
    "services": 2,
    "operators": 2,
    "devcluster": 2,
    "tandem": 3,
    "sim": 3,
    "bench": 4,
    "tests": 5,
}
SAME_LAYER_APART = {"services", "operators", "devcluster"}
SHARED_TEST_HELPERS = "tests.helpers"
GENERATED = ("common/proto/",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def first_party_files() -> list[Path]:
    files = []
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED) and "__pycache__" not in rel:
                files.append(path)
    return files


def imports(tree: ast.AST, module: str, is_package: bool):
    """(line, imported module, names) for every import; relative imports
    resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target, [alias.name for alias in node.names]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sys_path_edits(tree: ast.AST):
    """Lines that change sys.path: sys.path.insert/append/extend/..., an
    assignment to sys.path, site.addsitedir."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            is_addsitedir = (
                node.func.attr == "addsitedir"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "site"
            )
            if is_sys_path(node.func.value) or is_addsitedir:
                yield node.lineno
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if is_sys_path(target) or (
                    isinstance(target, ast.Subscript) and is_sys_path(target.value)
                ):
                    yield node.lineno


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What `source` (the module `module`) breaks, one line per finding."""
    tree = ast.parse(source)
    top = module.split(".")[0]
    found = [f"line {line}: edits sys.path" for line in sys_path_edits(tree)]
    for line, target, names in imports(tree, module, is_package):
        target_top = target.split(".")[0]
        if target_top not in RANK or target_top == top:
            pass
        elif top != "tests" and RANK[target_top] > RANK[top]:
            found.append(f"line {line}: {top} imports {target} from a layer above it")
        elif top in SAME_LAYER_APART and target_top in SAME_LAYER_APART:
            found.append(f"line {line}: {top} imports {target} (same layer, kept apart)")
        elif (top, target_top) == ("sim", "tandem") and not _within(target, "tandem.workload"):
            found.append(f"line {line}: sim imports {target}; of tandem only tandem.workload")
        elif (top, target_top) == ("tandem", "sim") and module != "tandem.cli":
            found.append(f"line {line}: {module} imports {target}; of tandem only tandem.cli")
        if top == "tests" and target_top == "tests":
            modules = [target, *(f"{target}.{n}" for n in names)]
            for imported in modules:
                leaf = imported.rpartition(".")[2]
                if leaf == "conftest" or leaf.startswith("test_"):
                    found.append(
                        f"line {line}: imports {imported}; what tests share "
                        f"belongs in a helper module ({SHARED_TEST_HELPERS})"
                    )
        if top == "tests" or target_top not in RANK or target == module:
            continue
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"line {line}: imports the private name {name} from {target}")
    return found


def test_every_module_imports_down_only():
    problems = []
    for path in first_party_files():
        module = module_name(path)
        for problem in violations(path.read_text(), module, path.name == "__init__.py"):
            problems.append(f"{path.relative_to(ROOT)} {problem}")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_every_layer():
    """The check above looks at real files: every present layer has modules."""
    seen = {module_name(p).split(".")[0] for p in first_party_files()}
    assert {"common", "services", "bench", "tandem", "devcluster", "tests"} <= seen


@pytest.mark.parametrize(
    "module, source",
    [
        ("services.router.app", "from tandem.cli import main"),
        ("services.engine.server", "import bench.harness"),
        ("common.ports", "from services.stack import Stack"),
        ("tandem.cli", "def f():\n    from bench.cli import main"),
        ("tandem.profile", "from bench.harness import log"),
        ("operators.planner.profiling", "from tandem.workload import runs"),
        ("services.router.app", "from operators.planner import solve"),
        ("kernels.packed", "import services.engine"),
        ("kernels.packing", "from operators.planner import solve"),
        ("bench.harness", "import tests.conftest"),
        ("devcluster.apiserver", "from operators.kube import PLURALS"),
        ("devcluster.store", "import services.stack"),
        ("operators.kube", "from devcluster.store import Store"),
        ("common.ports", "import devcluster"),
        ("bench.cli", "import sys\nsys.path.insert(0, 'tests')"),
        ("tests.stack.test_x", "import sys\nsys.path = ['x']"),
        ("bench.cli", "from bench.router_overhead import _log"),
        ("bench.agentx.embedded", "from ..cli import _log"),
        ("tests.stack.test_x", "from tests.conftest import MODEL_NAME"),
        ("tests.stack.test_x", "from tests.stack.test_pd_identity import LONG_CONTEXT"),
        ("tests.router.test_x", "from .test_admission import FakeRouter"),
        ("tests.router.conftest", "from tests import conftest"),
        ("sim.cluster", "from tandem.cli import main"),
        ("sim.cluster", "from tandem import profile"),
        ("tandem.profile", "from sim.cluster import Simulation"),
        ("sim.cluster", "import bench.harness"),
    ],
)
def test_the_rules_catch(module, source):
    assert violations(source, module), f"{module}: {source!r} should be refused"


@pytest.mark.parametrize(
    "module, source",
    [
        ("tandem.cli", "from services.stack import Stack\nfrom operators.planner import solver"),
        ("bench.cli", "from tandem.workload.replay import Replayer\nfrom tandem import profile"),
        ("bench.cli", "from services.stack import Stack\nfrom common.procs import Proc"),
        ("services.router.pd", "from services.kvstore.retention import RetentionHint"),
        ("services.engine.sampling", "from common.proto import engine_pb2 as pb"),
        ("common.procs", "import grpc\nfrom common.ports import free_port"),
        ("tests.router.test_x", "from tandem.cli import main\nfrom services.x import _y"),
        ("bench.agentx.sweep", "from . import report\nfrom .crosscheck import crosscheck"),
        ("services.engine.server", "from services.engine.server import _private_here"),
        ("bench.cli", "from bench.harness import __doc__"),
        ("tests.stack.test_x", "from tests.helpers import MODEL_NAME\nfrom tests import helpers"),
        ("tests.planner.test_x", "from tests.planner.synthetic import ramp_profile"),
        ("services.kvstore.packing", "from kernels import pack_blocks"),
        ("kernels.packing", "from common.ports import free_port"),
        ("tandem.cli", "from devcluster.apiserver import RunningApiServer"),
        ("devcluster.__main__", "from common.ports import free_port"),
        ("tests.kube.plugin", "from devcluster.apiserver import RunningApiServer"),
        ("sim.cluster", "from tandem.workload.generate import generate"),
        ("sim.cluster", "from services.router.routing import RoutingCore"),
        ("sim.costs", "from operators.planner.profiles import EngineProfile"),
        ("tandem.cli", "def f():\n    from sim.cli import main"),
    ],
)
def test_the_rules_allow(module, source):
    assert not violations(source, module)
