"""Triton JIT compiles while training: a kernel compiled inside a measured step costs that step a second or
more (a new specialization: an int argument that is 1 or a multiple of 16 for the first time, a new dtype or
alignment). The e2e benchmark records them as it records Dynamo's recompiles.

Through Triton's ``knobs.runtime.jit_post_compile_hook``, called after every ``JITFunction`` compile (the
kernels our ops launch; Inductor compiles its own kernels ahead of the steps, not through it). A hook
already installed keeps being called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["recording_triton_compiles"]


@contextlib.contextmanager
def recording_triton_compiles(log: list[str]) -> Iterator[list[str]]:
    """Append the name of every kernel the Triton JIT compiles inside the block to ``log`` (nothing where
    Triton or its hook is missing)."""
    try:
        from triton import knobs
    except ImportError:
        yield log
        return
    runtime = knobs.runtime
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        log.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?"))[:80])
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield log
    finally:
        runtime.jit_post_compile_hook = previous
