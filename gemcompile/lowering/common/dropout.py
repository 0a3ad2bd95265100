"""Dropout on attention probabilities: which (query, key) pairs a given seed keeps, in plain PyTorch.

Eager attention drops entries of the softmax's probabilities ``P`` (``dropout(P) = P * keep / (1 - p)``)
before ``P @ V``. Our kernels never write ``P``, so they draw the keep mask inside the tiles from a seed
with Triton's counter-based Philox (``tl.randint4x``) and draw it again, identically, in the backward. This
module draws the same numbers on the host, bit for bit, so that the references (CPU) and the kernels give
the same answer for the same seed, and the tests can compare them.

The stream: one Philox key per (batch, head), ``seed + b * H + h`` (b the batch index of k), and one
counter per eight consecutive keys of a query row, ``i * ceil(Lk / 8) + j // 8``, whose four 32-bit Philox
words (``tl.randint4x``) give each of the keys ``j = 8c, ..., 8c + 7`` 16 bits: key 8c + 2k + h reads half
h (0 the low bits) of word k. One Philox evaluation serves eight pairs: the draws are most of what dropout
costs in the kernels, and a pair needs no more than 16 bits. i, j are the query and key positions inside
their sequence and Lk the padded key length (packed operands: ``packed_len``). The counter is int32
(``Lq * ceil(Lk / 8) < 2**31``, checked): Triton draws int32 counters the same way in every release we
support.

A pair is dropped when its 16 bits are below ``drop_threshold(p) = round(p * 2**16)``, so the probability
dropped is p to within 2**-17 (0.1 -> 6554 / 65536 = 0.100006; above 1 - 2**-17 the threshold stops at
2**16 - 1, so that a pair can still be kept), and kept pairs are scaled by
``keep_scale(p) = 2**16 / (2**16 - drop_threshold(p))``, one over the probability kept: dropout stays unbiased
(E[dropout(P)] = P exactly) for the p that is drawn.

The seed is an int64 tensor of one element on the operands' device: the graph draws it once per call
from torch's generator (:func:`new_seed`), so a step's randomness follows ``torch.manual_seed`` and CUDA
graphs replay fresh draws, and the backward reads the saved seed, never a host value.
"""

from __future__ import annotations

import torch

__all__ = ["DROPOUT_LEVELS", "KEYS_PER_COUNTER", "MAX_DROPOUT_COUNTERS", "check_dropout", "diagonal_keep_factor",
           "drop_threshold", "keep_mask", "keep_scale", "new_seed", "philox_words"]

MAX_DROPOUT_COUNTERS = 2**31
"""Lq * ceil(Lk / 8) must stay below this: the counter is int32."""

KEYS_PER_COUNTER = 8
"""Keys of a query row drawn from one Philox evaluation (four 32-bit words, 16 bits a key)."""

DROPOUT_LEVELS = 2**16
"""The draw of a pair: a 16-bit integer, dropped below drop_threshold(p)."""

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mul_parts(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * c (a a 32-bit constant, c uint32 values held in
    int64): c is split in 16-bit halves so that no partial product leaves int64."""
    c_hi, c_lo = c >> 16, c & 0xFFFF
    lo_part = a * c_lo  # < 2**48
    mid = a * c_hi + (lo_part >> 16)  # < 2**49
    return mid >> 16, ((mid << 16) | (lo_part & 0xFFFF)) & _U32


def drop_threshold(p: float) -> int:
    """The 16-bit draws below this are dropped: round(p * 2**16), at most 2**16 - 1 (p < 1 keeps some)."""
    return min(round(float(p) * DROPOUT_LEVELS), DROPOUT_LEVELS - 1)


def keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: one over the probability of keeping it (1 / (1 - p) for
    the p that drop_threshold draws)."""
    return DROPOUT_LEVELS / (DROPOUT_LEVELS - drop_threshold(p))


def philox_words(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """``tl.randint4x(key, counter)`` for int32 counters: the four uint32 words (held in int64), stacked in
    a last dim of 4, broadcasting keys (int64, any values: their low and high 32 bits are Philox's two key
    words) against counters (int32 >= 0). Word 0 is ``tl.randint(key, counter)``."""
    keys, counters = torch.broadcast_tensors(keys.to(torch.int64), counters.to(torch.int64))
    k0, k1 = keys & _U32, (keys >> 32) & _U32
    c0, c1 = counters & _U32, torch.zeros_like(counters)
    c2, c3 = torch.zeros_like(counters), torch.zeros_like(counters)
    for _ in range(10):
        hi_b, lo_b = _mul_parts(_ROUND_B, c2)
        hi_a, lo_a = _mul_parts(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def _key_draws(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The eight 16-bit draws of each counter, in a last dim of 8 (key 8c + 2k + h <- half h of word k)."""
    words = philox_words(keys, counters)
    return torch.stack((words & 0xFFFF, words >> 16), dim=-1).flatten(-2)


def keep_mask(seed: torch.Tensor, p: float, B: int, H: int, Lq: int, Lk: int, device) -> torch.Tensor:
    """(B, H, Lq, Lk) bool: the pairs that dropout with probability p keeps under ``seed`` (see the module
    docstring for the stream)."""
    per_row = -(-Lk // KEYS_PER_COUNTER)
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    keys = seed.to(device=device, dtype=torch.int64).reshape(()) + bh
    counters = (torch.arange(Lq, device=device, dtype=torch.int64)[:, None] * per_row
                + torch.arange(per_row, device=device, dtype=torch.int64)[None, :])
    draws = _key_draws(keys, counters).reshape(B, H, Lq, KEYS_PER_COUNTER * per_row)[..., :Lk]
    return draws >= drop_threshold(p)


def diagonal_keep_factor(seed: torch.Tensor, p: float, B: int, H: int, L: int) -> torch.Tensor:
    """(B, H, L) float32: keep_scale(p) or 0 for the pairs (i, i) under ``seed`` (keep_mask's diagonal,
    drawn without the (L, L) rest): what a key merged into row i after the kernel is dropped with."""
    per_row = -(-L // KEYS_PER_COUNTER)
    device = seed.device
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1)
    rows = torch.arange(L, device=device, dtype=torch.int64)
    draws = _key_draws(seed.to(torch.int64).reshape(()) + bh, rows * per_row + rows // KEYS_PER_COUNTER)
    draw = torch.gather(draws, -1, (rows % KEYS_PER_COUNTER).view(1, 1, L, 1).expand(B, H, L, 1)).squeeze(-1)
    return torch.where(draw >= drop_threshold(p), torch.tensor(keep_scale(p), device=device),
                       torch.tensor(0.0, device=device))


def new_seed(device) -> torch.Tensor:
    """A fresh int64 seed of one element on ``device``, from torch's generator of that device."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def check_dropout(dropout_p, dropout_seed, Lq: int, Lk: int, device) -> None:
    """TypeError/ValueError naming the argument: p a number in [0, 1); with p > 0 a seed tensor of one int64
    element on the operands' device and Lq * ceil(Lk / 8) below 2**31 (the int32 counter)."""
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
    per_row = -(-Lk // KEYS_PER_COUNTER)
    if Lq * per_row >= MAX_DROPOUT_COUNTERS:
        raise ValueError(f"attention dropout draws one int32 counter per eight (query, key) pairs: Lq * ceil(Lk "
                         f"/ 8) = {Lq} * {per_row} must be below 2**31")
