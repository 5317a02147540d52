"""No import circle anywhere in the project's own modules: the source packages, the benchmarks and the tests.

The graph is read from the source (every `import`, at module level or inside a function: a circle
that only closes at run time is still one). `from package import module` depends on that module;
a module's own parent packages are not edges, since importing any submodule initialises them.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "cluster", "benchmarks", "predictor_service", "kv_kernels", "s3serve_cli", "deploy")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "tests").glob("*.py"):  # tests import their helpers by bare name (tests/ is on the path)
        modules[path.stem] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            names_only = len(submodules) < len(node.names)
            found.update(submodules | ({node.module} if names_only else set()))
    return found & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = _imports(path, modules) - parents - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert {"workers.scheduler", "cluster.ingress.router", "benchmarks.policy_bench", "policy_driver"} <= graph.keys()
    assert "workers.scheduling_policy" in graph["workers.scheduler"]
    assert "policy_driver" in graph["test_policies"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_project():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that reach each other): " + "; ".join(
        " <-> ".join(component) for component in found)
