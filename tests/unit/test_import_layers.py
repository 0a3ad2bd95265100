"""The package's floors, read from the code: no import cycle, and no module imports a floor above it.

Floors, lowest first (a module may import its own floor and those below):
  config, version, env                plain values (env: the GEMCOMPILE_* switches)
  lowering/                            the custom ops and their kernels: imports only lowering/ (and env)
  models/                              GEM-ref and its synthetic data
  runtime/distributed/plan.py          the pure parallel plan (no torch.distributed calls)
  passes/                              graph rewrites: may add lowering/ and the pure plan
  backend, explain, api                the compiler front end
  runtime/tables/                      tables trained on their looked-up rows (imports only lowering/)
  runtime/distributed/ (the rest)      the plan applied under torchrun
  runtime/training/                    the training loop, its config, report, metrics, checkpoints, bench
  cli                                  the command line

Imports inside functions count as well: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gemcompile"

# module prefix -> prefixes it may import (besides itself); the first matching row rules a module
ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("gemcompile.config", ()),
    ("gemcompile.version", ()),
    ("gemcompile.env", ()),
    ("gemcompile.lowering", ("gemcompile.env",)),
    ("gemcompile.models", ()),
    ("gemcompile.runtime.distributed.plan", ("gemcompile.config", "gemcompile.version")),
    ("gemcompile.passes", ("gemcompile.lowering", "gemcompile.runtime.distributed.plan", "gemcompile.config",
                           "gemcompile.version", "gemcompile.env")),
    ("gemcompile.backend", ("gemcompile.passes", "gemcompile.config", "gemcompile.version")),
    ("gemcompile.explain", ("gemcompile.backend", "gemcompile.passes", "gemcompile.runtime.distributed.plan",
                            "gemcompile.config", "gemcompile.version")),
    ("gemcompile.api", ("gemcompile.backend", "gemcompile.config")),
    ("gemcompile.runtime.tables", ("gemcompile.runtime.tables", "gemcompile.lowering")),
    ("gemcompile.runtime.distributed", ("gemcompile.runtime.distributed", "gemcompile.runtime.tables", "gemcompile.lowering",
                                        "gemcompile.models", "gemcompile.config", "gemcompile.version")),
    ("gemcompile.runtime.training", ("gemcompile",)),
    ("gemcompile.runtime", ()),  # runtime/__init__.py: a docstring of the floors, nothing imported
    ("gemcompile.cli", ("gemcompile",)),
    ("gemcompile", ("gemcompile.api", "gemcompile.config", "gemcompile.explain", "gemcompile.version")),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The gemcompile modules `name` imports, module-level and function-local."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return _imports_in(path.read_text(), name, package)


def _imports_in(source: str, name: str, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _rule(name: str) -> tuple[str, tuple[str, ...]]:
    for prefix, allowed in ALLOWED:
        if _within(name, prefix):
            return prefix, allowed
    raise AssertionError(f"{name}: no floor in ALLOWED; add its row")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_only_its_floor_and_below(name):
    prefix, allowed = _rule(name)
    upward = sorted(t for t in GRAPH[name]
                    if not _within(t, prefix) and not any(_within(t, a) for a in allowed)
                    and not (name == prefix and t.startswith(name + ".")))  # a package may import its children
    assert not upward, f"{name} ({prefix}) imports a floor above it: {upward}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan); a package importing its own
    children is not a cycle."""
    edges = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"p": {"p.x"}, "p.x": {"p"}}) == []


def test_the_walk_sees_function_local_and_relative_imports():
    source = (
        "def f():\n"
        "    from gemcompile.explain import explain\n"
        "    from ..backend import GemBackend\n"
        "    from . import config\n"
    )
    found = _imports_in(source, "gemcompile.passes.x", "gemcompile.passes")
    assert {"gemcompile.explain", "gemcompile.backend", "gemcompile.passes"} <= found
