"""A benchmark script (benchmarks/<name>.py) loaded as a module, for the tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None, register: bool = False) -> ModuleType:
    """benchmarks/<name>.py as a fresh module named ``module_name`` (default ``<name>_under_test``); the
    benchmarks folder goes on sys.path for the scripts' own imports (harness, sibling scripts). ``register``
    puts it in sys.modules first (dataclasses and pickling look it up there)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(module_name or f"{name}_under_test", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
