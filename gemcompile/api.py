"""gem_compile: torch.compile with gemcompile's passes.

    @gem_compile                      # bare, on a function or an nn.Module subclass
    @gem_compile(config=GemConfig())  # with arguments
    model = gem_compile(model)        # on a module instance: returns what torch.compile returns
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from gemcompile.backend import GemBackend, check_mode_and_options
from gemcompile.config import GemConfig


def _whole_graph_under_ddp(fn: Any) -> Any:
    """fn compiling with Dynamo's DDP graph split off: under DistributedDataParallel Dynamo cuts the graph at
    every gradient bucket (torch._dynamo.config.optimize_ddp) and compiles each piece alone, so a mask built
    in one piece reaches the attention in another as an input, which no pass can prove. The whole graph keeps
    them provable; DDP's reducer still all-reduces the gradients, after the compiled backward rather than
    overlapped with it."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(optimize_ddp=False):
            return fn(*args, **kwargs)
    return run


def _compile_module_class(cls: type[nn.Module], backend: GemBackend, kwargs: dict[str, Any]) -> type[nn.Module]:
    """A subclass whose instances compile themselves in place (state_dict keys stay unchanged)."""

    class Compiled(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.compile(backend=backend, **kwargs)
            self._compiled_call_impl = _whole_graph_under_ddp(self._compiled_call_impl)

    Compiled.__name__ = cls.__name__
    Compiled.__qualname__ = cls.__qualname__
    Compiled.__module__ = cls.__module__
    Compiled.__doc__ = cls.__doc__
    return Compiled


def gem_compile(model_or_fn: Any = None, *, config: GemConfig | None = None, **torch_compile_kwargs: Any) -> Any:
    """Compile a model or function with torch.compile and gemcompile's graph passes.

    Args:
        model_or_fn: an ``nn.Module`` instance, an ``nn.Module`` subclass, or a callable. When omitted,
            returns a decorator (``@gem_compile(config=...)``).
        config: what the passes do; ``GemConfig()`` when None.
        **torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ``mode``,
            ``options``, ...); ``backend`` is gemcompile's own and cannot be given. ``mode`` and
            ``options`` are checked here (RuntimeError listing the valid names), as torch.compile does.
    """
    if config is not None and not isinstance(config, GemConfig):
        raise TypeError(f"gem_compile: config must be a gemcompile.GemConfig, got {type(config).__name__}")
    if "backend" in torch_compile_kwargs:
        raise TypeError("gem_compile sets its own backend; for another backend call torch.compile directly")
    # Checked now, as torch.compile checks them for Inductor, not at the first call.
    check_mode_and_options(torch_compile_kwargs.get("mode"), torch_compile_kwargs.get("options"))
    if model_or_fn is None:
        return functools.partial(gem_compile, config=config, **torch_compile_kwargs)

    backend = GemBackend(config)
    if isinstance(model_or_fn, type):
        if issubclass(model_or_fn, nn.Module):
            return _compile_module_class(model_or_fn, backend, torch_compile_kwargs)
        raise TypeError(f"gem_compile: a class must be an nn.Module subclass, got {model_or_fn.__name__}")
    if not callable(model_or_fn):
        raise TypeError(
            "gem_compile expects an nn.Module, an nn.Module subclass or a callable, "
            f"got {type(model_or_fn).__name__}"
        )
    compiled = torch.compile(model_or_fn, backend=backend, **torch_compile_kwargs)
    if isinstance(compiled, nn.Module):  # an OptimizedModule: its forward runs the compiled frame
        compiled.forward = _whole_graph_under_ddp(compiled.forward)
        return compiled
    return _whole_graph_under_ddp(compiled)
