"""Warp-specialized kernel variants (Hopper): what they need from Triton and from the host.

Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``, sm_90) splits a loop into a
TMA producer warp group and consumer warp groups that run the MMAs and the softmax, so the loads of the next
tile overlap the math of this one. Compiled for sm_90a (triton 3.6 and 3.9, no GPU needed:
tests/unit/test_jagged_attention_compile.py), the jagged forward's and dK/dV kernel's specialized loops become
12 warps (1 producer + 2 consumer groups, ``setmaxnreg``) from ``num_warps=4``, without spills at the listed
tiles (D 64 and 128). What the pass accepts (found by compiling variants for sm_90a with triton 3.6):

* loads through descriptors made in the kernel (``tl.make_tensor_descriptor``): host (ragged) descriptors
  crash the pass (triton PR #7658, "Hopper WS doesn't support data partitioning with on-host TMA");
* no early ``return`` in the kernel (an assertion in the pass): an empty tile loops zero times instead;
* ``num_warps=4`` (with 8 the loop is not specialized);
* in the dK/dV kernel, the key tile loaded through descriptors as well: with pointer loads before the loop the
  pass fails (``WSLowerToken.cpp:73`` assertion). The dQ kernel written the same way (q, dO, k, v through
  descriptors, lse and delta by pointers before or inside the loop) fails with that assertion at every tile
  tried, so dQ has no specialized variant.

A descriptor made in the kernel is written to a global scratch buffer that the launcher allocates per launch
through ``triton.set_allocator``'s allocator (a ContextVar: per thread, and unset by default).
:func:`ensure_scratch_allocator` installs one that takes the memory from torch's caching allocator on the
current stream (so a CUDA-graph capture takes it from the graph's pool), unless the thread has one already.

The variants are off. On an H200 (triton 3.6) they gave wrong outputs (NaN or errors of 0.5-0.75 against
float64: all 22 GPU tests of tests/gpu/test_jagged_attention_warp_specialize_gpu.py failed,
benchmarks/results/gpu-tests/gpu-tests-20261206-044823.json) and, in the config sweep of the same lease, were
1.3-1.7x slower than the default tiles at D 128; the CPU interpreter does not see the fault. So
GEMCOMPILE_WARP_SPECIALIZE=1 is refused on a machine with a GPU until they are fixed; on the CPU it still
offers them to the autotuner (only where the launch takes the TMA loads and has no bias, key mask, uniform
keys or dropout), for the interpreter tests.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from gemcompile.env import env_flag

__all__ = ["WARP_SPECIALIZE", "ensure_scratch_allocator", "warp_specialize_available"]

WARP_SPECIALIZE = env_flag("GEMCOMPILE_WARP_SPECIALIZE", False)
"""Offer the warp-specialized configs to the autotuner (GEMCOMPILE_WARP_SPECIALIZE=1; off by default)."""
if WARP_SPECIALIZE and torch.cuda.is_available():
    raise RuntimeError(
        "GEMCOMPILE_WARP_SPECIALIZE=1: the warp-specialized jagged attention configs gave wrong results on an "
        "H200 with triton 3.6 (benchmarks/results/gpu-tests/gpu-tests-20261206-044823.json) and were slower "
        "than the default configs; unset GEMCOMPILE_WARP_SPECIALIZE")


def warp_specialize_available() -> bool:
    """This Triton has descriptors made in the kernel and loops that take ``warp_specialize``."""
    return hasattr(tl, "make_tensor_descriptor") and "warp_specialize" in tl.range.__init__.__code__.co_varnames


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch for descriptors made in a kernel: torch's caching allocator, current device and stream
    (torch's allocations are 512-byte aligned, more than the 128 bytes a descriptor needs)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_scratch_allocator() -> None:
    """Install :func:`_scratch` as this thread's Triton allocator unless one is set (the autograd engine
    runs backward passes, and so recomputed forwards, on threads of its own, where the ContextVar is unset)."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
