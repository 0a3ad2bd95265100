"""Rooms stay small enough to live in: no module of gemcompile/ over 700 lines and no function over 100,
except Triton kernel files and @triton.jit kernels (a kernel with its launcher is one concept)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gemcompile"
FILES = sorted(PACKAGE.rglob("*.py"))
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 100


def _is_kernel_file(path: Path) -> bool:
    return path.stem.endswith("triton")


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


@pytest.mark.parametrize("path", [p for p in FILES if not _is_kernel_file(p)],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_700_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.name}: {lines} lines"


def test_no_function_over_100_lines():
    long = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_jit(node):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []
