"""Jagged <-> padded conversions and the project's one length-bucketing helper.

A jagged batch stores the valid tokens of every sample back to back (`values`, shape (T, ...)) plus
`offsets` (B + 1,) with sample b's tokens at values[offsets[b]:offsets[b + 1]]. The padded layout is
(B, N, ...) with sample b's tokens at [b, :lengths[b]]. Small, torch-only helpers; all run on any
device and keep the dtype of the values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "bucket_length",
    "jagged_to_padded",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "padded_to_jagged",
]


def _check_lengths(lengths: torch.Tensor, name: str = "lengths") -> None:
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dim() != 1:
        raise ValueError(f"{name} must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lengths.dtype}")


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """(B,) lengths -> (B + 1,) int64 offsets [0, l0, l0 + l1, ...]."""
    _check_lengths(lengths)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """(B + 1,) offsets -> (B,) int64 lengths."""
    _check_lengths(offsets, "offsets")
    if offsets.numel() < 1:
        raise ValueError("offsets must have at least one element (B + 1 >= 1)")
    return (offsets[1:] - offsets[:-1]).to(torch.int64)


def _valid_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def padded_to_jagged(padded: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, ...) padded + (B,) lengths -> (values (sum(lengths), ...), offsets (B + 1,)).

    Raises ValueError when a length is negative or exceeds N (that sample would silently lose tokens).
    """
    _check_lengths(lengths)
    if padded.dim() < 2 or padded.shape[0] != lengths.shape[0]:
        raise ValueError(
            f"padded must be (B, N, ...) with B = len(lengths) = {lengths.shape[0]}, "
            f"got {tuple(padded.shape)}"
        )
    max_len = padded.shape[1]
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > max_len):
        raise ValueError(f"lengths must lie in [0, {max_len}] (the padded length), got {lengths.tolist()}")
    # Boolean indexing walks (b, n) in row-major order, which is exactly the jagged order.
    values = padded[_valid_mask(lengths, max_len)]
    return values, lengths_to_offsets(lengths)


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0
) -> torch.Tensor:
    """(values (T, ...), offsets (B + 1,)) -> padded (B, max_len, ...) filled with `padding_value`.

    Raises ValueError when a sample is longer than `max_len` or the offsets do not match `values`.
    """
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0:
        raise ValueError(f"max_len must be an int >= 0, got {max_len!r}")
    lengths = offsets_to_lengths(offsets)
    if lengths.numel():
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
            raise ValueError(
                f"offsets must start at 0 and end at values.shape[0] = {values.shape[0]}, "
                f"got {int(offsets[0])} .. {int(offsets[-1])}"
            )
        if int(lengths.min()) < 0:
            raise ValueError("offsets must be non-decreasing")
        if int(lengths.max()) > max_len:
            raise ValueError(f"a sample has {int(lengths.max())} tokens, more than max_len = {max_len}")
    out = values.new_full((lengths.numel(), max_len, *values.shape[1:]), padding_value)
    out[_valid_mask(lengths, max_len)] = values
    return out


def bucket_length(n: int, buckets: Iterable[int] | None = None) -> int:
    """Padded length to use for a batch whose longest row has `n` tokens.

    Without `buckets`: the next power of two >= n (1 for n <= 1). With `buckets`: the smallest bucket
    >= n; ValueError when n exceeds every bucket. Bucketing bounds the number of distinct shapes a
    compiled model sees (one recompile per bucket) while wasting at most 2x on padding.
    """
    if isinstance(n, torch.Tensor):
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if buckets is None:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()
    sizes = sorted(buckets)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"buckets must be a non-empty collection of ints >= 1, got {list(sizes)!r}")
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"length {n} exceeds the largest bucket {sizes[-1]} (buckets: {sizes})")
