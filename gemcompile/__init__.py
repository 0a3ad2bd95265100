"""gemcompile: train padded recommendation models with jagged, block and low-precision kernels.

The public API, nothing else: ``gem_compile``, ``GemConfig``, ``explain`` (and the ``ExplainReport``
it returns).
"""

from gemcompile.api import gem_compile
from gemcompile.config import GemConfig
from gemcompile.explain import ExplainReport, explain
from gemcompile.version import __version__

__all__ = ["ExplainReport", "GemConfig", "__version__", "explain", "gem_compile"]
