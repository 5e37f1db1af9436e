"""DESIGN.md's import rules, checked against every module's imports (parsed, not run).

- everything may import ``polyinfer``, which imports none of the parts;
- the router and specdec know no HTTP and import neither proxy nor engine;
- the engine imports neither proxy, router nor optimizer;
- loadgen imports only ``polyinfer``;
- the optimizer does not import the proxy;
- no part imports bench/ or tests/.

Every import counts: top-level, inside functions, under ``TYPE_CHECKING``, and
``importlib.import_module`` / ``__import__`` calls whose name is a literal.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("polyinfer", "proxy", "router", "specdec", "engine", "optimizer", "loadgen")
NOT_PARTS = ("bench", "tests")
HTTP = ("aiohttp", "httptools", "requests", "httpx")

# part -> the top-level names its modules must not import
FORBIDDEN: dict[str, frozenset[str]] = {
    "polyinfer": frozenset(PARTS[1:]),
    "router": frozenset({"proxy", "engine", *HTTP}),
    "specdec": frozenset({"proxy", "engine", *HTTP}),
    "engine": frozenset({"proxy", "router", "optimizer"}),
    "loadgen": frozenset(set(PARTS) - {"polyinfer", "loadgen"}),
    "optimizer": frozenset({"proxy"}),
    "proxy": frozenset(),
}


def imported_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted module name) for every import the module makes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def violations(part: str, source: str, path: str) -> list[str]:
    banned = FORBIDDEN[part] | set(NOT_PARTS)
    return [f"{path}:{line}: {part} imports {name}"
            for line, name in imported_names(ast.parse(source, path))
            if name.split(".")[0] in banned]


def modules(part: str) -> list[Path]:
    return sorted(p for p in (ROOT / part).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("part", PARTS)
def test_part_imports_follow_design(part: str) -> None:
    found = [v for p in modules(part)
             for v in violations(part, p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


def test_every_part_has_modules() -> None:
    assert all(modules(part) for part in PARTS)


@pytest.mark.parametrize(("part", "source", "expected"), [
    ("router", "from engine.model import Llama\n", ["x.py:1: router imports engine.model"]),
    ("specdec", "def f():\n    import proxy.pool\n", ["x.py:2: specdec imports proxy.pool"]),
    ("engine", "import importlib\nm = importlib.import_module('router.base')\n",
     ["x.py:2: engine imports router.base"]),
    ("loadgen", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy import errors\n",
     ["x.py:3: loadgen imports proxy"]),
    ("polyinfer", "from bench.sim import fleet\n", ["x.py:1: polyinfer imports bench.sim"]),
    ("router", "import aiohttp\n", ["x.py:1: router imports aiohttp"]),
    ("optimizer", "from polyinfer.config import CompiledConfig\nfrom loadgen import client\n", []),
])
def test_the_checker_sees_each_kind_of_import(part: str, source: str, expected: list[str]) -> None:
    assert violations(part, source, "x.py") == expected
