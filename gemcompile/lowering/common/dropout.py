"""Dropout on attention probabilities: which (query, key) pairs a given seed keeps, in plain PyTorch.

Eager attention drops entries of the softmax's probabilities ``P`` (``dropout(P) = P * keep / (1 - p)``)
before ``P @ V``. Our kernels never write ``P``, so they draw the keep mask inside the tiles from a seed
with Triton's counter-based Philox (``tl.rand4x``) and draw it again, identically, in the backward. This
module draws the same numbers on the host, bit for bit, so that the references (CPU) and the kernels give
the same answer for the same seed, and the tests can compare them.

The stream: one Philox key per (batch, head), ``seed + b * H + h`` (b the batch index of k), and one
counter per four consecutive keys of a query row, ``i * ceil(Lk / 4) + j // 4``, whose four Philox words
(``tl.rand4x``) go to keys ``j = 4c, ..., 4c + 3`` in order: one Philox evaluation per four pairs. i, j are
the query and key positions inside their sequence and Lk the padded key length (packed operands:
``packed_len``). The counter is int32 (``Lq * ceil(Lk / 4) < 2**31``, checked): Triton draws int32 counters
the same way in every release we support. A pair is kept when its uniform draw is ``>= p``.

The seed is an int64 tensor of one element on the operands' device: the graph draws it once per call
from torch's generator (:func:`new_seed`), so a step's randomness follows ``torch.manual_seed`` and CUDA
graphs replay fresh draws, and the backward reads the saved seed, never a host value.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_DROPOUT_COUNTERS", "check_dropout", "diagonal_keep_factor", "keep_mask", "new_seed",
           "philox_uniform"]

MAX_DROPOUT_COUNTERS = 2**31
"""Lq * ceil(Lk / 4) must stay below this: the counter is int32."""

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's uint -> [0, 1) scale for 32-bit draws


def _mul_parts(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * c (a a 32-bit constant, c uint32 values held in
    int64): c is split in 16-bit halves so that no partial product leaves int64."""
    c_hi, c_lo = c >> 16, c & 0xFFFF
    lo_part = a * c_lo  # < 2**48
    mid = a * c_hi + (lo_part >> 16)  # < 2**49
    return mid >> 16, ((mid << 16) | (lo_part & 0xFFFF)) & _U32


def philox_uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """``tl.rand4x(key, counter)`` for int32 counters: the four float32 uniforms in [0, 1), stacked in a last
    dim of 4, broadcasting keys (int64, any values: their low and high 32 bits are Philox's two key words)
    against counters (int32 >= 0). Word 0 is ``tl.rand(key, counter)``."""
    keys, counters = torch.broadcast_tensors(keys.to(torch.int64), counters.to(torch.int64))
    k0, k1 = keys & _U32, (keys >> 32) & _U32
    c0, c1 = counters & _U32, torch.zeros_like(counters)
    c2, c3 = torch.zeros_like(counters), torch.zeros_like(counters)
    for _ in range(10):
        hi_b, lo_b = _mul_parts(_ROUND_B, c2)
        hi_a, lo_a = _mul_parts(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    words = torch.stack((c0, c1, c2, c3), dim=-1)
    signed = torch.where(words >= 2**31, words - 2**32, words)  # each draw read as int32
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.int32).to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def keep_mask(seed: torch.Tensor, p: float, B: int, H: int, Lq: int, Lk: int, device) -> torch.Tensor:
    """(B, H, Lq, Lk) bool: the pairs that dropout with probability p keeps under ``seed`` (see the module
    docstring for the stream)."""
    quads = -(-Lk // 4)
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    keys = seed.to(device=device, dtype=torch.int64).reshape(()) + bh
    counters = (torch.arange(Lq, device=device, dtype=torch.int64)[:, None] * quads
                + torch.arange(quads, device=device, dtype=torch.int64)[None, :])
    uniform = philox_uniform(keys, counters).reshape(B, H, Lq, 4 * quads)[..., :Lk]
    return uniform >= torch.tensor(p, dtype=torch.float32)


def diagonal_keep_factor(seed: torch.Tensor, p: float, B: int, H: int, L: int) -> torch.Tensor:
    """(B, H, L) float32: keep / (1 - p) of the pairs (i, i) under ``seed`` (keep_mask's diagonal, drawn
    without the (L, L) rest): what a key merged into row i after the kernel is dropped with."""
    quads = (L + 3) // 4
    device = seed.device
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1)
    rows = torch.arange(L, device=device, dtype=torch.int64)
    words = philox_uniform(seed.to(torch.int64).reshape(()) + bh, rows * quads + rows // 4)  # (B, H, L, 4)
    uniform = torch.gather(words, -1, (rows % 4).view(1, 1, L, 1).expand(B, H, L, 1)).squeeze(-1)
    kept = uniform >= torch.tensor(p, dtype=torch.float32, device=device)
    return torch.where(kept, torch.tensor(1.0 / (1.0 - p), device=device), torch.tensor(0.0, device=device))


def new_seed(device) -> torch.Tensor:
    """A fresh int64 seed of one element on ``device``, from torch's generator of that device."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def check_dropout(dropout_p, dropout_seed, Lq: int, Lk: int, device) -> None:
    """TypeError/ValueError naming the argument: p a number in [0, 1); with p > 0 a seed tensor of one int64
    element on the operands' device and Lq * ceil(Lk / 4) below 2**31 (the int32 counter)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p} (p = 1 drops every probability: the "
                         "output is 0; write that instead)")
    if dropout_p == 0.0:
        return
    if not isinstance(dropout_seed, torch.Tensor):
        raise TypeError(f"dropout_p={dropout_p} needs dropout_seed, an int64 tensor of one element "
                        f"(gemcompile.lowering.common.dropout.new_seed), got {type(dropout_seed).__name__}")
    if dropout_seed.dtype != torch.int64 or dropout_seed.numel() != 1:
        raise ValueError(f"dropout_seed must hold one int64 element, got {dropout_seed.dtype} "
                         f"{tuple(dropout_seed.shape)}")
    if dropout_seed.device != torch.device(device):
        raise ValueError(f"dropout_seed is on {dropout_seed.device}, the operands on {device}")
    if Lq * (-(-Lk // 4)) >= MAX_DROPOUT_COUNTERS:
        raise ValueError(f"attention dropout draws one int32 counter per four (query, key) pairs: Lq * ceil(Lk "
                         f"/ 4) = {Lq} * {-(-Lk // 4)} must be below 2**31")
