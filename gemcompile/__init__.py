"""gemcompile: train padded recommendation models with jagged, block and low-precision kernels.

The public API, nothing else: ``gem_compile``, ``GemConfig``, ``explain`` (and the ``ExplainReport``
it returns).
"""

import importlib
import sys
import types

import gemcompile.lowering  # noqa: F401  (registers the torch.ops.gemcompile ops; cheap)
from gemcompile.config import GemConfig
from gemcompile.version import __version__

__all__ = ["ExplainReport", "GemConfig", "__version__", "explain", "gem_compile"]

# gem_compile and explain load the compiler stack (Dynamo, Inductor's pattern matcher, the passes: ~3.5 s
# of a 2-core CPU): imported on first use, so that a process that only trains eagerly (a torchrun worker,
# ``gemcompile train`` without --compile) or reads a checkpoint does not pay for it.
_LAZY = {"gem_compile": "gemcompile.api", "explain": "gemcompile.explain", "ExplainReport": "gemcompile.explain"}


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        # Importing the submodule gemcompile.explain binds it as this package's attribute ``explain``; the
        # public name is the function of that module.
        if name == "explain" and isinstance(value, types.ModuleType):
            value = value.explain
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gemcompile' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
