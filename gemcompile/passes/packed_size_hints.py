"""Inductor's scheduler heuristics size unpad's packed tensors at their hinted token count.

Where Inductor does not read user hints for unbacked sizes (torch 2.11: no
``SizeVarAllocator.all_unbacked_explicitly_hinted``; lowering/valid_tokens.py sets its overrides only where
it does), it sizes every buffer of unbacked size at 0 bytes in two heuristics and every kernel over one
at 8192 elements in a third, and every tensor of unpad's packed (T, ...) rows, most of a padded sequence
model's activations, has such a size:

* **Fusion.** ``Scheduler.score_fusion_memory`` sums ``GraphLowering.get_dep_size_hint`` over the buffers
  two nodes share, and ``InductorChoices.can_fuse`` refuses a score of 0 ("no shared data"): no two
  kernels that share only packed buffers were ever fused. With the hints, torch 2.11 fuses GEM-ref's
  packed layers about as torch 2.13 (which reads them) does (counted on the CPU; the test fuses a packed
  block's kernels only with them).
* **Peak-memory reordering.** ``torch._inductor.memory.reorder_for_peak_memory`` (the lowest estimate among
  the original order and three topological sorts) sizes buffers with ``sizevars.size_hint`` /
  ``optimization_hint(numel, fallback=0)`` and graph inputs with ``get_dep_size_hint``. With the packed
  tensors at 0 bytes it could not tell orders apart: on the H200 (torch 2.11, GEM-ref medium B 256,
  activation memory budget 0.5) the backward kept six layers' attention gradients alive together, and the
  step's peak rose to 1.23x the default's although the partition saved half the bytes.
* **Kernel block sizes.** ``TritonKernel.codegen_kernel`` gives the runtime heuristics a size hint per
  block dim from ``sizevars.symbolic_hint``, and 8192 for any size it cannot evaluate: every pointwise
  kernel over packed rows got a 256-element block. On the H200 a gelu over 277k packed rows of 1024 ran
  at 1.5 TB/s that way against 2.5 TB/s for the same static size (0.76 vs 0.45 ms: one compiled gelu
  timed alone by a diagnostic script, not a committed benchmark).

``install`` wraps ``GraphLowering.get_dep_size_hint`` (a heuristic's size: fusion scores, memory estimates)
so that a dependency it sizes at 0 whose unbacked symbols all have a recorded hint (valid_tokens.
recorded_hints) is sized at that hint, and ``reorder_for_peak_memory`` (looked up in its module at each
call by the scheduler) so that, while it runs, the size hints with a fallback read the same hints, and
``TritonKernel.codegen_kernel`` so that the hints of its x/y/z sizes do too (never a reduction size: a
persistent reduction's block must cover its rows, so its hint must not shrink). Kernels' code,
guards and buffer allocation keep their symbolic sizes, and graphs without recorded hints (not
gemcompile's) are sized as before. Installed once, by GemBackend, only on a torch whose Inductor does not
read the hints itself.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import sympy

from gemcompile.lowering.valid_tokens import inductor_reads_unbacked_hints, recorded_hints

_WRAPPED = "_gemcompile_packed_size_hints"
SIZE_METHODS = ("size_hint", "optimization_hint")
"""The SizeVarAllocator methods the memory estimate sizes buffers with (torch 2.11 uses both)."""


def hinted_value(expr: Any, hints: dict, simplify) -> int | None:
    """``expr`` with every unbacked symbol at its recorded hint, or None when a symbol has none."""
    if not getattr(expr, "free_symbols", None):
        return None  # a number: Inductor's own size
    for candidate in (expr, simplify(expr)):  # a replacement (u1 -> u0) may leave a hinted symbol behind
        if getattr(candidate, "free_symbols", set()) & hints.keys():
            value = sympy.sympify(candidate.xreplace(hints))  # a lone symbol becomes its hint, an int
            if value.is_number:
                return int(value)
    return None


@contextlib.contextmanager
def hinted_sizes(graph: Any):
    """Inside the block, ``graph``'s size hints with a fallback (heuristics' sizes) read unpad's recorded
    token counts; restored on exit."""
    sizevars = graph.sizevars
    hints = recorded_hints(getattr(sizevars, "shape_env", None))
    if not hints:
        yield
        return
    patched: dict[tuple[Any, str], Any] = {}

    def sized(original):
        @functools.wraps(original)
        def method(expr, *args, fallback=None, **kwargs):
            if fallback is not None:
                value = hinted_value(expr, hints, sizevars.simplify)
                if value is not None:
                    return value
            return original(expr, *args, fallback=fallback, **kwargs)
        return method

    for name in SIZE_METHODS:
        if hasattr(type(sizevars), name):
            patched[(sizevars, name)] = vars(sizevars).get(name)
            setattr(sizevars, name, sized(getattr(sizevars, name)))

    try:
        yield
    finally:
        for (owner, name), previous in patched.items():
            if previous is None:
                delattr(owner, name)  # back to the class's method
            else:
                setattr(owner, name, previous)


def _hinted_dep_size(original):
    """GraphLowering.get_dep_size_hint, with a dependency it sizes at 0 sized at unpad's hints (cached as
    Inductor caches its own answer)."""

    @functools.wraps(original)
    def get_dep_size_hint(self, dep, count_bytes: bool = True) -> int:
        size = original(self, dep, count_bytes)
        if size != 0:
            return size
        try:
            hints = recorded_hints(self.sizevars.shape_env)
            if not hints or not dep.has_unbacked_symbols():
                return size
            numel = hinted_value(dep.get_numel(), hints, self.sizevars.simplify)
            if numel is None:
                return size
            size = numel * (self.get_dtype(dep.name).itemsize if count_bytes else 1)
        except Exception:  # noqa: BLE001 - a dependency without a size or dtype: as Inductor sized it
            return 0
        cache = getattr(self, "dep_size_hint_cache", None)
        if isinstance(cache, dict):
            cache[(dep, count_bytes)] = size
        return size

    return get_dep_size_hint


def _block_prefix(prefix: str) -> bool:
    return not prefix.startswith("r")  # x, y, z: not r0_, r1_ (a reduction's rows)


def _hinted_kernel_codegen(original):
    """TritonKernel.codegen_kernel, with its x/y/z sizes' hints (the runtime heuristics' block sizes) read
    at unpad's recorded token counts where Inductor could not evaluate them."""

    @functools.wraps(original)
    def codegen_kernel(self, *args, **kwargs):
        from torch._inductor.virtualized import V

        sizevars = V.graph.sizevars
        hints = recorded_hints(getattr(sizevars, "shape_env", None))
        sizes = [numel for prefix, numel in getattr(self, "numels", {}).items() if _block_prefix(prefix)]
        if not hints or not any(getattr(n, "free_symbols", None) for n in sizes):
            return original(self, *args, **kwargs)
        symbolic_hint = sizevars.symbolic_hint

        def hinted(expr, *a, **kw):
            value = symbolic_hint(expr, *a, **kw)
            if getattr(value, "free_symbols", None) and any(expr == n for n in sizes):
                at_hint = hinted_value(expr, hints, sizevars.simplify)
                return value if at_hint is None else at_hint
            return value

        previous = vars(sizevars).get("symbolic_hint")  # a codegen inside another one: the outer's patch
        sizevars.symbolic_hint = hinted
        try:
            return original(self, *args, **kwargs)
        finally:
            if previous is None:
                del sizevars.symbolic_hint  # back to the class's method
            else:
                sizevars.symbolic_hint = previous

    return codegen_kernel


def _hinted_reordering(original):
    """reorder_for_peak_memory, with the size hints it reads at unpad's recorded token counts."""

    @functools.wraps(original)
    def reorder_for_peak_memory(*args, **kwargs):
        from torch._inductor.virtualized import V

        with hinted_sizes(V.graph):
            return original(*args, **kwargs)

    return reorder_for_peak_memory


def install() -> bool:
    """Wrap Inductor's ``reorder_for_peak_memory``, ``GraphLowering.get_dep_size_hint`` and
    ``TritonKernel.codegen_kernel`` (each once per process) where Inductor does not read unbacked hints
    itself. Returns whether the wrappers are in place."""
    try:
        from torch._inductor import memory
        from torch._inductor.codegen.triton import TritonKernel
        from torch._inductor.graph import GraphLowering
    except ImportError:  # another Inductor: nothing to size
        return False
    targets = ((memory, "reorder_for_peak_memory", _hinted_reordering),
               (GraphLowering, "get_dep_size_hint", _hinted_dep_size),
               (TritonKernel, "codegen_kernel", _hinted_kernel_codegen))
    if any(getattr(owner, name, None) is None for owner, name, _ in targets):
        return False
    if all(is_wrapped(getattr(owner, name)) for owner, name, _ in targets):
        return True
    if inductor_reads_unbacked_hints():
        return False
    for owner, name, wrap in targets:
        current = getattr(owner, name)
        if not is_wrapped(current):
            wrapper = wrap(current)  # (functools.wraps set __wrapped__)
            setattr(wrapper, _WRAPPED, True)
            setattr(owner, name, wrapper)
    return True


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of this module's wrappers."""
    return bool(getattr(fn, _WRAPPED, False))

