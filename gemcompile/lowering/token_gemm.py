"""gemcompile::token_mm: a GEMM over packed tokens, run as GEMMs whose sizes come from a small fixed set.

    torch.ops.gemcompile.token_mm(Tensor a, Tensor b, Tensor? bias, int split_dim, int per_octave,
                                  int min_rows) -> Tensor
        a (M, K) @ b (K, N) (+ bias, broadcast over rows as addmm's), a new contiguous (M, N) tensor in
        a's dtype. split_dim 0: M is the token count; 1: K is (a weight gradient, summed over tokens).

Why: packed tokens make the token count new at every step, and cuBLAS(Lt) picks a kernel for each new
GEMM shape on the host. On an H200 that took 0.2 to 4 ms per call at a new M (a seen M: 30 us;
benchmarks/gemm_host_time.py), while the GPU waited: GEM-ref small's step runs 86 such GEMMs forward
and 172 backward (tests/golden/explain-gem-ref-small.json). Here the token dim n is covered by a GEMM
over its first ``floor(n / q) * q`` tokens and one over a window of its last q tokens, q =
``bucket_quantum(n)`` (a power of two, 1/per_octave of n's power of two). Both sizes come from a few
values per octave, so cuBLAS meets each shape once and its heuristic cache answers afterwards. The
window overlaps the first GEMM (fewer than q tokens are computed twice): for split_dim 0 it rewrites rows
with the same values; for split_dim 1 the tokens already summed are zeroed in the window's copy of b (one
``where`` against a cached row mask), and the window's product is added (addmm) onto the first one: one
more rounding in a's dtype than a single GEMM.

Token dims below ``2 * min_rows``, or already a bucket size, run as one GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .common.opkit import direct_cuda, kept_tensor

__all__ = ["bucket_quantum", "token_mm"]


def bucket_quantum(n: int, per_octave: int, min_rows: int) -> int:
    """The window size q for a token dim n: n's power of two divided by per_octave (at least min_rows), so
    that floor(n / q) * q takes per_octave values per octave of n."""
    top = 1 << (max(n, 1).bit_length() - 1)
    return max(min_rows, top // max(per_octave, 1))


def _check(a: Tensor, b: Tensor, bias: Optional[Tensor], split_dim: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"token_mm: expected a (M, K) and b (K, N), got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise ValueError(f"token_mm: a, b and bias must share a dtype, got {a.dtype}, {b.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and bias.numel() != b.shape[1]:
        raise ValueError(f"token_mm: bias must have N = {b.shape[1]} elements (a row broadcast over the "
                         f"output), got {tuple(bias.shape)}")
    if split_dim not in (0, 1):
        raise ValueError(f"token_mm: split_dim must be 0 (rows of a) or 1 (the reduction dim), got "
                         f"{split_dim}")


def _gemm(a: Tensor, b: Tensor, bias: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    if bias is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)


_ROW_STEPS: dict = {}
"""(q, device) -> (2q,) bool, False then True: every window's row mask is a view of it (no launch a call)."""


def _rows_from(q: int, first: int, device: torch.device) -> Tensor:
    """(q,) bool view: False for rows < first, True from ``first`` on."""
    steps = _ROW_STEPS.get((q, device))
    if steps is None:
        steps = _ROW_STEPS[(q, device)] = kept_tensor(lambda: torch.arange(2 * q, device=device) >= q, device)
    return steps[q - first: 2 * q - first]


def token_mm_impl(a: Tensor, b: Tensor, bias: Optional[Tensor], split_dim: int, per_octave: int,
                  min_rows: int) -> Tensor:
    n = a.shape[split_dim]
    q = bucket_quantum(n, per_octave, min_rows)
    head = n // q * q
    if per_octave < 1 or n < 2 * min_rows or head == n:
        return _gemm(a, b, bias).contiguous()
    if split_dim == 0:  # rows: two GEMMs write one output, the window rewriting rows of the head
        out = a.new_empty((n, b.shape[1]))
        _gemm(a[:head], b, bias, out=out[:head])
        _gemm(a[n - q:], b, bias, out=out[n - q:])
        return out
    # reduction over tokens: the window's tokens that the head already summed count zero
    out = _gemm(a[:, :head], b[:head], bias)
    window = torch.where(_rows_from(q, head - (n - q), b.device)[:, None], b[n - q:], 0)
    return torch.addmm(out, a[:, n - q:], window)


@torch.library.custom_op("gemcompile::token_mm", mutates_args=())
def token_mm(a: Tensor, b: Tensor, bias: Optional[Tensor], split_dim: int, per_octave: int,
             min_rows: int) -> Tensor:
    """a @ b (+ bias) with the token dim (split_dim) covered by GEMMs of bucketed sizes (module doc)."""
    _check(a, b, bias, split_dim)
    return token_mm_impl(a, b, bias, split_dim, per_octave, min_rows)


direct_cuda(token_mm)  # CUDA calls skip register_kernel's wrapper (opkit.direct_cuda)


@token_mm.register_fake
def _token_mm_fake(a: Tensor, b: Tensor, bias: Optional[Tensor], split_dim: int, per_octave: int,
                   min_rows: int) -> Tensor:
    _check(a, b, bias, split_dim)
    return a.new_empty((a.shape[0], b.shape[1]))


@register_flop_formula(torch.ops.gemcompile.token_mm)
def _token_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """The product's FLOPs, 2 M N K (what the model asks for: the window's repeated tokens not counted)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]
