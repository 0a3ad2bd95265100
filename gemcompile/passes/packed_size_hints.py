"""Inductor's peak-memory reordering sizes unpad's packed tensors at their hinted token count.

Inductor's scheduler reorders each graph's kernels to lower its estimated peak memory
(``torch._inductor.memory.reorder_for_peak_memory``: the lowest estimate among the original order and three
topological sorts). It sizes every buffer with ``sizevars.size_hint`` / ``optimization_hint(numel,
fallback=0)`` and every graph input with ``GraphLowering.get_dep_size_hint``, which returns 0 for a size
with an unbacked symbol. Where Inductor does not read user hints for unbacked sizes (torch 2.11: no
``SizeVarAllocator.all_unbacked_explicitly_hinted``; lowering/valid_tokens.py sets its overrides only where
it does), every tensor of unpad's packed (T, ...) rows is therefore 0 bytes to the reordering, most of a
padded sequence model's activations. The estimate then cannot tell orders apart, and the order it picks can
hold many of them at once: on the H200 (torch 2.11, GEM-ref medium B 256, activation memory budget 0.5) the
backward kept six layers' attention gradients alive together, and the step's peak rose to 1.23x the
default's although the partition saved half the bytes.

``install`` wraps ``reorder_for_peak_memory`` (looked up in its module at each call by the scheduler) so
that, while it runs, a size whose unbacked symbols all have a recorded hint (valid_tokens.recorded_hints)
is sized at that hint. Nothing else reads the patched sizes: kernels, guards and buffer allocation keep
their symbolic sizes, and graphs without recorded hints (not gemcompile's) are sized as before. Installed
once, by GemBackend, only on a torch whose Inductor does not read the hints itself.
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
    """Inside the block, ``graph``'s size hints (with a fallback, i.e. for heuristics) and its input sizes
    read unpad's recorded token counts; restored on exit."""
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

    original_dep = getattr(graph, "get_dep_size_hint", None)
    if original_dep is not None:
        def dep_size_hint(dep, count_bytes: bool = True) -> int:
            size = original_dep(dep, count_bytes)
            if size == 0:
                try:  # the dependency's own estimate, now through the hinted size methods
                    if dep.has_unbacked_symbols():
                        return dep.numbytes_hint() if count_bytes else dep.numel_hint()
                except Exception:  # noqa: BLE001 - a dependency without a size: as Inductor sized it
                    pass
            return size

        patched[(graph, "get_dep_size_hint")] = vars(graph).get("get_dep_size_hint")
        graph.get_dep_size_hint = dep_size_hint
    try:
        yield
    finally:
        for (owner, name), previous in patched.items():
            if previous is None:
                delattr(owner, name)  # back to the class's method
            else:
                setattr(owner, name, previous)


def install(force: bool = False) -> bool:
    """Wrap Inductor's ``reorder_for_peak_memory`` (once per process) where Inductor does not read unbacked
    hints itself (``force``: regardless, for tests). Returns whether the wrapper is in place."""
    try:
        from torch._inductor import memory
    except ImportError:  # an Inductor without the pass: nothing to size
        return False
    original = getattr(memory, "reorder_for_peak_memory", None)
    if original is None:
        return False
    if getattr(original, _WRAPPED, False):
        return True
    if inductor_reads_unbacked_hints() and not force:
        return False

    @functools.wraps(original)
    def reorder_for_peak_memory(*args, **kwargs):
        from torch._inductor.virtualized import V

        with hinted_sizes(V.graph):
            return original(*args, **kwargs)

    setattr(reorder_for_peak_memory, _WRAPPED, True)
    reorder_for_peak_memory.__wrapped__ = original
    memory.reorder_for_peak_memory = reorder_for_peak_memory
    return True


def uninstall() -> None:
    """Put Inductor's own ``reorder_for_peak_memory`` back (tests)."""
    from torch._inductor import memory

    current = memory.reorder_for_peak_memory
    if getattr(current, _WRAPPED, False):
        memory.reorder_for_peak_memory = current.__wrapped__
