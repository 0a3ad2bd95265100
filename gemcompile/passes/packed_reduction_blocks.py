"""Inductor's block sizes for sums over packed tokens: the ones it picks for the same sum over static sizes.

A weight or norm gradient sums over tokens: an "outer" reduction (over rows, one output per column), split
by Inductor into a first kernel over row blocks. Inductor's reduction heuristic
(``triton_heuristics._reduction_configs``) gives such a kernel, when it has one dynamic size argument and
reads three or more inputs, one row per loop iteration ("register pressure for indexing"), and no other
config to tune. Packed tokens make the row count dynamic (the mask ``row < T``), so GEM-ref medium's norm
gradients over 265k tokens ran at about 0.5 TB/s on the H200: 1.2 ms each, where static shapes (the same
sums in torch.compile's padded graph) get 8 to 64 rows per iteration (benchmarks/token_sum_reduction.py).

``install`` wraps ``InductorChoices.triton_kernel_kwargs`` (Inductor's hook for out-of-tree heuristics,
"used to apply fixed configurations") so that in graphs with unpad's recorded token counts (gemcompile's
packed graphs, lowering/valid_tokens.py) an outer reduction over one dim that reads a buffer of data-
dependent size, over a static number of rows per program (Inductor's split of the sum, or unpad_reductions'
padding), gets a fixed config computed as the static-shape branch of that heuristic computes it.
Every other kernel, and every graph without recorded token counts (not gemcompile's), is left to Inductor.
"""

from __future__ import annotations

import functools
from typing import Any

from gemcompile.lowering.valid_tokens import recorded_hints

_WRAPPED = "_gemcompile_packed_reduction_blocks"


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def static_outer_config(x: int, rnumel: int, loads: int) -> dict[str, int]:
    """The block config Inductor's outer-reduction heuristic picks for static sizes (x outputs, rnumel rows
    each, ``loads`` inputs read per row), with its number of warps made explicit. The heuristic sees the
    sizes rounded up to powers of two (its size hints), and so do the blocks here: Triton takes only powers
    of two (a model 768 wide gave XBLOCK 6, which failed to compile)."""
    x, rnumel = _next_power_of_2(x), _next_power_of_2(rnumel)
    if x <= 1024:  # few outputs: spread the rows over every SM
        x_block, r_block = max(min(x // 128, 8), 2), min(rnumel, 64)
    elif x // 4096 <= 8:
        x_block, r_block = 16, 32
    else:
        x_block = max(min(256, _next_power_of_2(x // 4096)), 64)
        if loads >= 4 and rnumel > 128:  # heavier iterations: fewer, larger row blocks
            return {"XBLOCK": min(x_block, 32), "R0_BLOCK": 64 if rnumel >= 2048 else 32, "num_warps": 4}
        r_block = 512 // x_block
    return {"XBLOCK": x_block, "R0_BLOCK": r_block, "num_warps": max(2, min(8, x_block * r_block // 128))}


def _buffer_size(name: str) -> list | None:
    from torch._inductor.virtualized import V

    node = V.graph.graph_inputs.get(name)
    try:
        node = node if node is not None else V.graph.get_buffer(name)
        return list(node.get_size())
    except Exception:  # noqa: BLE001 - a buffer without a layout (removed, multi-output): nothing to read
        return None


def _reads_data_dependent_sizes(features: Any) -> bool:
    """Whether the kernel reads a buffer whose size is data-dependent. The read's own index may be static
    (unpad_reductions' padded sums read the packed buffer over the padded range, masked at T), so the
    buffer's layout is what tells."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in features.scheduler_nodes():
        for dep in node.read_writes.reads:
            has = getattr(dep, "has_unbacked_symbols", None)
            if has is not None and has():
                return True
            size = _buffer_size(dep.name)
            if size and any(free_unbacked_symbols(s) for s in size):
                return True
    return False


def _symbolic(expr: Any) -> bool:
    return bool(getattr(expr, "free_symbols", None))


def _loads(features: Any) -> int:
    return len({dep.name for node in features.scheduler_nodes() for dep in node.read_writes.reads})


def packed_outer_config(features: Any, groups: list, kernel_kwargs: dict) -> dict[str, int] | None:
    """The fixed config for this kernel, or None to leave it to Inductor."""
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    if kernel_kwargs.get("fixed_config") is not None or kernel_kwargs.get("override_persistent_reduction"):
        return None
    if kernel_kwargs.get("mix_order_reduction") or not features.is_reduction():
        return None
    if not groups or set(groups[0]) != {"x", "r0_"}:
        return None
    if not recorded_hints(getattr(V.graph.sizevars, "shape_env", None)):
        return None
    if features.get_reduction_hint() != ReductionHint.OUTER or not _reads_data_dependent_sizes(features):
        return None
    if _symbolic(features.numel) or _symbolic(features.reduction_numel):
        # a reduction over a data-dependent row count that Inductor did not split (few programs, each over
        # every row): a fixed block there ran 10x slower than Inductor's choice on the H200
        return None
    sizevars = V.graph.sizevars
    x = sizevars.optimization_hint(features.numel, fallback=8192)
    rnumel = sizevars.optimization_hint(features.reduction_numel, fallback=8192)
    if rnumel <= 64:  # Inductor's persistent reductions: left as they are
        return None
    return static_outer_config(x, rnumel, _loads(features))


def _with_packed_blocks(original):
    @functools.wraps(original)
    def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
        kwargs = original(self, kernel_cls, features, groups, kernel_kwargs)
        try:
            config = packed_outer_config(features, groups, kwargs)
        except Exception:  # noqa: BLE001 - another Inductor's internals: its own choice
            config = None
        if config is None:
            return kwargs
        from torch._inductor.codegen.triton import FixedTritonConfig

        return {**kwargs, "fixed_config": FixedTritonConfig(config), "override_persistent_reduction": False,
                "override_cooperative_reduction": False}

    setattr(triton_kernel_kwargs, _WRAPPED, True)
    return triton_kernel_kwargs


def install() -> bool:
    """Wrap ``InductorChoices.triton_kernel_kwargs`` once per process; returns whether the wrapper is in place."""
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.codegen.triton import FixedTritonConfig  # noqa: F401
    except ImportError:  # another Inductor: its own heuristics
        return False
    original = getattr(InductorChoices, "triton_kernel_kwargs", None)
    if original is None:
        return False
    if not getattr(original, _WRAPPED, False):
        InductorChoices.triton_kernel_kwargs = _with_packed_blocks(original)
    return True
