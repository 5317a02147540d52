"""The layering holds: pure decision modules and cross-process messages import with torch, Ray and Redis absent,
the router and controller modules load no torch, the serving packages import one another only in DESIGN's
direction, and never the CLI or the benchmarks.

Each check runs in a fresh interpreter whose import system refuses the named packages, so a
new top-level import anywhere on the path fails here with the chain that pulled it in.
"""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Decisions (pure: no Ray, Redis or torch), and the messages the router and controller read.
PURE_MODULES = [
    "workers.policies",
    "workers.sglang_ratio",
    "workers.scheduling_policy",
    "workers.planning_rule",
    "workers.preemption",
    "workers.length_distribution",
    "workers.repetition",
    "workers.scheduler",
    "workers.kv_cache_manager",
    "workers.length_probe",
    "workers.kv_peak",
    "workers.sequence",
    "workers.sampling_params",
    "workers.engine_config",
    "workers.setting",
    "workers.worker_settings",
    "workers.work_types",
    "workers.step_output",
    "workers.grammar",
    "workers.model_support",
    "cluster.control.placement",
    "cluster.control.routing",
    "cluster.control.scaling",
    "cluster.control.messages",
    "cluster.control.rebound",
    "cluster.control.rebalance",
    "predictor_service.label_stats",
    "predictor_service.probe_files",
    "cluster.control.worker_probe",
]
# Processes that never run a model: Ray and Redis are fine there, torch is not.
NO_TORCH_MODULES = [
    "cluster.config",
    "cluster.control.controller",
    "cluster.ingress.router",
    "cluster.ingress.generation",
    "workers.worker_actor",  # the controller imports it to start workers
]


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


def test_pure_modules_import_without_torch_ray_or_redis():
    result = _import_refusing(PURE_MODULES, ["torch", "ray", "redis", "transformers", "triton", "deepspeed"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_router_and_controller_modules_import_without_torch():
    result = _import_refusing(NO_TORCH_MODULES, ["torch", "transformers", "triton", "deepspeed"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module", ["workers.engine", "kv_kernels.reference"])
def test_the_guard_does_catch_a_module_that_needs_torch(module):
    result = _import_refusing([module], ["torch"])
    assert result.returncode == 1 and "refused import of torch" in result.stdout


SERVING_PACKAGES = ["cluster", "workers", "kv_kernels", "predictor_service", "deploy"]
TOOL_PACKAGES = {"benchmarks", "s3serve_cli"}


def _imported_top_levels(path: Path) -> set[str]:
    """Top-level packages a file imports anywhere (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_serving_packages_never_import_the_cli_or_the_benchmarks():
    root = Path(__file__).resolve().parents[1]
    offenders = {str(path.relative_to(root)): sorted(_imported_top_levels(path) & TOOL_PACKAGES)
                 for package in SERVING_PACKAGES for path in (root / package).rglob("*.py")}
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"serving code imports the CLI or the benchmarks: {offenders}"
    assert _imported_top_levels(root / "s3serve_cli" / "bench.py") & TOOL_PACKAGES  # the scan sees such imports


# DESIGN's import direction: kv_kernels <-- workers <-- cluster --> predictor_service (deploy and the tools on top).
FORBIDDEN_IMPORTS = {
    "kv_kernels": {"workers", "cluster", "predictor_service", "deploy"},
    "workers": {"cluster", "predictor_service", "deploy"},
    "predictor_service": {"workers", "cluster", "deploy"},
    "cluster": {"deploy"},
    "benchmarks": {"s3serve_cli"},  # the service's start and stop are cluster.service's, not the CLI's
}


def test_serving_packages_import_one_another_only_in_the_design_direction():
    root = Path(__file__).resolve().parents[1]
    offenders = {str(path.relative_to(root)): sorted(_imported_top_levels(path) & forbidden)
                 for package, forbidden in FORBIDDEN_IMPORTS.items() for path in (root / package).rglob("*.py")}
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"imports against DESIGN's direction: {offenders}"
    assert _imported_top_levels(root / "cluster" / "control" / "worker_probe.py") >= {"workers", "predictor_service"}


def _module_graph(root: Path) -> dict[str, set[str]]:
    """Every source module (the packages, the tools and the tests' helpers, imported by bare name) -> the source
    modules it imports anywhere, inside functions and TYPE_CHECKING blocks too."""
    paths = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for package in (*SERVING_PACKAGES, *TOOL_PACKAGES) for path in (root / package).rglob("*.py")}
    paths.update({path.stem: path for path in (root / "tests").glob("*.py")})
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
    root = Path(__file__).resolve().parents[1]
    graph = _module_graph(root)
    assert {"workers.worker_actor", "benchmarks.cluster_plan", "engine_driver"} <= set(graph)
    assert "workers.rank_group" in graph["workers.worker_actor"]  # imports inside functions are seen
    assert not _circles(graph)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
