"""The packed layout of one side of an attention op: its checks and the references' pad/pack.

A packed operand holds the valid tokens of every sequence back to back, (T, H, D), batch-major: token n
of sequence b at row ``token_offsets[b] + n``, ``token_offsets`` (B + 1,) int32/int64 (the unpad pass's
layout). ``packed_len`` N is the padded length the sequences come from: positions n lie in [0, N), and
the packed op equals the padded op on (B, H, N, D) tensors restricted to the valid rows.

Offsets values: non-decreasing, inside [0, T], each sequence at most N tokens; checked on CPU (and on CUDA
under strict_length_checks), as lengths are (checks.py). Rows outside [token_offsets[0],
token_offsets[B]) (e.g. the sentinel rows of a bucketed token index) belong to no sequence: their outputs
and gradients are 0. On CUDA without checks, bad offsets are clamped inside the kernels (no access leaves
the tensors; the values are then unspecified).

The references pad the packed operands with index_put / gather (no host sync) and run the padded math.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_vector, should_check_values

__all__ = [
    "check_packed_len",
    "check_packed_operand",
    "check_token_offsets",
    "check_token_offsets_values",
    "offsets_batch",
    "pack_padded",
    "packed_lengths",
    "packed_rows",
    "pad_packed",
    "padded_stand_in",
]


def check_packed_len(packed_len) -> None:
    if isinstance(packed_len, bool) or not isinstance(packed_len, (int, torch.SymInt)):
        raise TypeError(f"packed_len must be an int, got {type(packed_len).__name__}")
    if isinstance(packed_len, int) and packed_len < 0:
        raise ValueError(f"packed_len must be >= 0 (the padded length N of the packed sequences), got {packed_len}")


def check_token_offsets(token_offsets, B: int, device, packed_len) -> None:
    """token_offsets: an int32/int64 (B + 1,) tensor on q's device; packed_len an int >= 0 (metadata only)."""
    if not isinstance(token_offsets, Tensor):
        raise ValueError(f"token_offsets must be a torch.Tensor or None, got {type(token_offsets).__name__}")
    try:
        check_index_vector("token_offsets", token_offsets, B + 1, "B + 1", device)
    except TypeError as e:  # a wrong dtype is a ValueError here, as every inconsistent offsets argument
        raise ValueError(str(e)) from None
    check_packed_len(packed_len)


def check_packed_operand(name: str, t, H: int | None = None, D: int | None = None) -> None:
    """A packed operand: a 3-D (T, H, D) tensor (H, D checked when given)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (tokens, heads, head_dim) with token_offsets, got shape {tuple(t.shape)}")
    if H is not None and t.shape[1] != H:
        raise ValueError(f"{name} must have {H} heads, got shape {tuple(t.shape)}")
    if D is not None and t.shape[2] != D:
        raise ValueError(f"{name} must have head dim {D}, got shape {tuple(t.shape)}")


def offsets_batch(token_offsets) -> int:
    """B of a (B + 1,) token_offsets tensor (ValueError naming it when it is not 1-D with B + 1 >= 1)."""
    if not isinstance(token_offsets, Tensor):
        raise ValueError(f"token_offsets must be a torch.Tensor or None, got {type(token_offsets).__name__}")
    if token_offsets.dim() != 1 or token_offsets.shape[0] < 1:
        raise ValueError(f"token_offsets must be 1-D (B + 1,), got shape {tuple(token_offsets.shape)}")
    return token_offsets.shape[0] - 1


def padded_stand_in(t: Tensor, B: int, N: int) -> Tensor:
    """A (B, H, N, D) tensor of t's dtype and device that holds no memory (an expanded scalar): what the
    padded layout checks read in place of a packed (T, H, D) operand."""
    return t.new_empty(()).expand(B, t.shape[1], N, t.shape[2])


def packed_lengths(token_offsets: Tensor) -> Tensor:
    """(B,) int64 tokens per sequence."""
    off = token_offsets.to(torch.int64)
    return off[1:] - off[:-1]


def check_token_offsets_values(token_offsets: Tensor | None, T: int, N: int,
                               lengths: tuple = ()) -> None:
    """ValueError unless the offsets are non-decreasing, inside [0, T], at most N tokens per sequence, and
    each of ``lengths`` ((name, tensor or None) pairs) clamped into [0, N] equals the tokens per sequence.
    CPU always, CUDA under strict_length_checks (a host sync)."""
    if token_offsets is None or not should_check_values(token_offsets):
        return
    off = token_offsets.to(torch.int64)
    counts = off[1:] - off[:-1]
    if int(off[0]) < 0 or int(off[-1]) > T:
        raise ValueError(f"token_offsets must lie in [0, T] = [0, {T}] (T: the packed rows), got "
                         f"{int(off[0])} .. {int(off[-1])}")
    if bool((counts < 0).any()):
        i = int((counts < 0).nonzero()[0, 0])
        raise ValueError(f"token_offsets must be non-decreasing, got token_offsets[{i + 1}] < token_offsets[{i}]")
    if bool((counts > N).any()):
        i = int((counts > N).nonzero()[0, 0])
        raise ValueError(f"token_offsets: sequence {i} has {int(counts[i])} tokens, more than packed_len {N}")
    for name, t in lengths:
        if t is None or not should_check_values(t):
            continue
        bad = t.to(torch.int64).clamp(0, N) != counts
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{name}[{i}] = {int(t[i])} disagrees with token_offsets ({int(counts[i])} tokens "
                             f"in sequence {i})")


def packed_rows(token_offsets: Tensor, T: int, N: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per packed row: (sequence b, position n, whether the row is a valid token), indices clamped into
    [0, B) and [0, N) (rows outside every sequence read a real slot); no host sync."""
    off = token_offsets.to(torch.int64)
    B = off.shape[0] - 1
    rows = torch.arange(T, device=off.device)
    b = (torch.searchsorted(off[1:], rows, right=True)).clamp(max=max(B - 1, 0))
    n = rows - off[b]
    valid = (rows >= off[0]) & (rows < off[-1]) & (n >= 0) & (n < N)
    return b, n.clamp(0, max(N - 1, 0)), valid


def pad_packed(x: Tensor, token_offsets: Tensor, N: int) -> Tensor:
    """(T, H, ...) packed -> (B, H, N, ...) padded, zeros outside the valid tokens (no host sync)."""
    B, T = token_offsets.shape[0] - 1, x.shape[0]
    padded = x.new_zeros((B, N, *x.shape[1:]))
    if B > 0 and N > 0 and T > 0:
        b, n, valid = packed_rows(token_offsets, T, N)
        keep = valid.view(T, *([1] * (x.dim() - 1)))
        # accumulate: rows outside every sequence add 0 to a clamped slot
        padded.index_put_((b, n), torch.where(keep, x, x.new_zeros(())), accumulate=True)
    return padded.transpose(1, 2)


def pack_padded(x: Tensor, token_offsets: Tensor, T: int, fill: float = 0.0) -> Tensor:
    """(B, H, N, ...) padded -> (T, H, ...) packed (contiguous), ``fill`` on rows outside every sequence."""
    N = x.shape[2]
    xt = x.transpose(1, 2)  # (B, N, H, ...)
    if x.shape[0] == 0 or N == 0 or T == 0:
        return x.new_full((T, *xt.shape[2:]), fill)
    b, n, valid = packed_rows(token_offsets, T, N)
    out = xt[b, n]
    return torch.where(valid.view(T, *([1] * (out.dim() - 1))), out, out.new_full((), fill)).contiguous()
