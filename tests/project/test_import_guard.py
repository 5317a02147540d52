"""The layering holds, by the rules of docs/architecture.md's "Layers" table, the one place they are written: each
row's modules import with the row's packages refused, and import from this repository only what the row allows;
every source folder has a row; no module imports itself through others.

The refusals run in a fresh interpreter whose import system refuses the named packages, so a new top-level import
anywhere on the path fails here with the chain that pulled it in.
"""

import ast
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LayerRule:
    paths: tuple[str, ...]  # folders ("workers/engine/") or files ("cluster/control/placement.py")
    refused: frozenset[str]  # top-level packages a fresh interpreter refuses while importing the row's modules
    allowed: tuple[str, ...]  # dotted prefixes of this repository's modules the row's files may import

    def files(self) -> list[Path]:
        return sorted(path for name in self.paths
                      for path in ((ROOT / name).glob("*.py") if name.endswith("/") else [ROOT / name]))


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def layer_rules(text: str) -> list[LayerRule]:
    """The rows of the "Layers" section's table: path | its job | refused at import | imports from this repository."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rules = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rules.append(LayerRule(tuple(_ticked(cells[0])), frozenset(_ticked(cells[2])), tuple(_ticked(cells[3]))))
    return rules


RULES = layer_rules((ROOT / "docs" / "architecture.md").read_text())
PACKAGES = sorted({path.split("/")[0] for rule in RULES for path in rule.paths})


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _import_refusing(modules: list[str], refused: list[str]) -> subprocess.CompletedProcess:
    program = textwrap.dedent(f"""
        import importlib, importlib.abc, sys, traceback
        REFUSED = {refused!r}

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in REFUSED:
                    raise ImportError(f"refused import of {{name}}")
                return None

        sys.meta_path.insert(0, Refuse())
        failed = False
        for module in {modules!r}:
            try:
                importlib.import_module(module)
            except ImportError:
                failed = True
                print(f"--- {{module}}:")
                traceback.print_exc(file=sys.stdout)
        sys.exit(1 if failed else 0)
    """)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)


def test_the_layers_table_is_read_and_names_every_source_folder():
    assert len(RULES) >= 10 and {"workers", "cluster", "kv_kernels", "benchmarks", "s3serve_cli"} <= set(PACKAGES)
    folders = {str(path.parent.relative_to(ROOT)) + "/" for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    rows = {path for rule in RULES for path in rule.paths}
    assert folders <= rows, f"source folders without a row in docs/architecture.md's Layers table: {folders - rows}"
    missing = [path for rule in RULES for path in rule.paths if not (ROOT / path).exists()]
    assert not missing, f"the Layers table names paths that do not exist: {missing}"


@pytest.mark.parametrize("refused", sorted({rule.refused for rule in RULES if rule.refused}, key=sorted),
                         ids=lambda refused: " ".join(sorted(refused)))
def test_each_layer_imports_with_its_refused_packages_absent(refused):
    modules = [_module_name(path) for rule in RULES if rule.refused >= refused for path in rule.files()]
    assert modules
    result = _import_refusing(modules, sorted(refused))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["policies", "scheduling_policy", "scheduler", "kv_cache_manager"])
def test_the_old_module_names_give_the_same_objects(name):
    import importlib

    old, new = importlib.import_module(f"workers.{name}"), importlib.import_module(f"workers.scheduling.{name}")
    public = [attr for attr in vars(new) if not attr.startswith("_")]
    assert public and all(getattr(old, attr, None) is getattr(new, attr) for attr in public)


@pytest.mark.parametrize("module", ["workers.engine.engine", "kv_kernels.reference"])
def test_the_guard_does_catch_a_module_that_needs_torch(module):
    result = _import_refusing([module], ["torch"])
    assert result.returncode == 1 and "refused import of torch" in result.stdout


def _imported_modules(path: Path) -> set[str]:
    """The modules of this repository a file imports anywhere (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name for name in names if name.split(".")[0] in PACKAGES}


def _allows(rule: LayerRule, module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in rule.allowed)


def test_each_layer_imports_from_this_repository_only_what_its_row_allows():
    offenders = {}
    for rule in RULES:
        for path in rule.files():
            bad = sorted(name for name in _imported_modules(path) if not _allows(rule, name))
            if bad:
                offenders.setdefault(str(path.relative_to(ROOT)), set()).update(bad)
    assert not offenders, f"imports against docs/architecture.md's Layers table: {offenders}"
    # the scan sees imports, across layers and inside functions
    assert {"workers.scheduling.length_probe", "predictor_service.hidden_probe"} <= _imported_modules(
        ROOT / "cluster" / "control" / "worker_probe.py")
    assert "workers.engine.engine" in _imported_modules(ROOT / "workers" / "actors" / "worker_actor.py")
    engine_rule = next(rule for rule in RULES if rule.paths == ("workers/engine/",))
    assert not _allows(engine_rule, "workers.actors.worker_actor") and _allows(engine_rule, "kv_kernels.layout")


def _module_graph(root: Path) -> dict[str, set[str]]:
    """Every source module (the packages, the tools and the tests' helpers, imported by bare name) -> the source
    modules it imports anywhere, inside functions and TYPE_CHECKING blocks too."""
    paths = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for package in PACKAGES for path in (root / package).rglob("*.py")}
    paths.update({path.stem: path for path in (root / "tests").rglob("*.py")})
    graph = {}
    for module, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from package import submodule` imports the submodule; any other name comes from the module
                imported.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths
                                else node.module for alias in node.names)
        graph[module] = {name for name in imported if name in paths and name != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another in a circle (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others():
    root = Path(__file__).resolve().parents[2]
    graph = _module_graph(root)
    assert {"workers.actors.worker_actor", "benchmarks.cluster_plan", "engine_driver"} <= set(graph)
    assert "workers.actors.rank_group" in graph["workers.actors.worker_actor"]  # imports inside functions are seen
    assert not _circles(graph)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
