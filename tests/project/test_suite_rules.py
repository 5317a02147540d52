"""Rules the test suite keeps about itself: no test ends early and passes, having checked less than it is about (a
test that cannot check it on this machine says so with `pytest.skip` and its reason; a poll breaks out of its loop
and checks after it)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _own_nodes(function: ast.AST):
    """The nodes of `function`'s body, not of the functions, lambdas and classes defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def returns_in_tests(source: str) -> list[str]:
    """`name:line` of each `return` in a test function's own body (a helper defined inside it may return)."""
    return [f"{node.name}:{inner.lineno}" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
            for inner in _own_nodes(node) if isinstance(inner, ast.Return)]


def test_the_rule_finds_a_return_in_a_test_and_leaves_helpers_alone():
    # the fused-layer test as it was: one assertion, then a return on every CPU with AVX-512
    early = "def test_a(x):\n    assert x is not None\n    if not x:\n        return\n    assert x.run()\n"
    assert returns_in_tests(early) == ["test_a:4"]
    assert returns_in_tests("def test_b():\n    def inner():\n        return 1\n    assert inner()\n") == []
    assert returns_in_tests("def helper(x):\n    return x\n") == []
    assert returns_in_tests("class TestC:\n    def test_d(self):\n        return\n") == ["test_d:3"]


def test_no_test_returns_early():
    offenders = [f"{path.name}:{where}" for path in sorted(TESTS.rglob("test_*.py"))
                 for where in returns_in_tests(path.read_text())]
    assert not offenders, offenders


def test_tests_are_arranged_like_the_code():
    """Each test module sits in the folder of the layer or package it tests (README's layout names them), so that
    one layer's tests run alone; only the helpers the tests import by bare name stay at the top."""
    folders = sorted(path.name for path in TESTS.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert folders == ["actors", "benchmarks", "cli", "control", "engine", "ingress", "kernels", "predictor",
                       "project", "scheduling", "service"]
    assert not sorted(path.name for path in TESTS.glob("test_*.py")), "a test module at the top of tests/"
    assert all(any(TESTS.joinpath(folder).glob("test_*.py")) for folder in folders)
    readme = (TESTS.parent / "README.md").read_text()
    assert all(f"`{folder}/`" in readme for folder in folders), "the README's layout names every test folder"
