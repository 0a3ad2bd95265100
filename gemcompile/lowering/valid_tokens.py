"""gemcompile::valid_token_index and gemcompile::valid_mask_index: where the valid tokens of a padded batch
are, as flat row indices (optionally rounded up to a few capacities, ``buckets``).

The unpad pass packs a token-wise region of a padded model: ``packed = x[index // N, index % N]`` and
back ``zeros(B, N, ...).index_put((index // N, index % N), packed)``. ``index`` lists the positions
``b * N + n`` with ``n < lengths[b]`` in row-major order, which is exactly the jagged order.

Its length T = sum(clamp(lengths, 0, N)) changes with every batch. Under torch.compile it is an unbacked
SymInt (the fake implementation allocates one), so one compiled graph serves every T with no recompile:
Inductor sizes the packed kernels at run time. The price is one device-to-host read of T per call (the
index's size must be known to allocate it), the same as ``torch.nonzero``.

``buckets = k > 0`` pads the index up to one of k + 1 capacities (UnpadConfig.token_buckets) with a sentinel
row: the packed size then takes at most k + 1 values, so CUDA-graph trees, which record one graph per
distinct size, record a few graphs instead of one per batch. The padding happens inside the op, so no
tensor of the exact size T reaches the compiled graph: a graph partition reading T would be recorded again
for every batch, and with it every partition after it in the tree (seen on the H200 with a separate
padding op: a recording per step).

``valid_mask_index`` is the same index for tokens marked by a (B, N) boolean vector instead of lengths
(``ids != 0``, an attention_mask, left padding, holes): the positions where the vector holds, row-major,
with the same unbacked size T = valid.sum().
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from .common.opkit import LIB

LIB.define("valid_token_index(Tensor lengths, SymInt max_len, int size_hint=0, int buckets=0) -> Tensor")
LIB.define("valid_mask_index(Tensor valid, int size_hint=0, int buckets=0) -> Tensor")


def _check(lengths: Tensor, max_len) -> None:
    if lengths.dim() != 1:
        raise ValueError(f"valid_token_index: lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"valid_token_index: lengths must be an integer tensor, got {lengths.dtype}")
    if isinstance(max_len, int) and max_len < 0:
        raise ValueError(f"valid_token_index: max_len must be >= 0, got {max_len}")


def valid_token_index_reference(lengths: Tensor, max_len: int) -> Tensor:
    """int64 (T,) flat positions b * max_len + n of the tokens with n < lengths[b], in row-major order."""
    _check(lengths, max_len)
    valid = torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]
    return valid.flatten().nonzero().squeeze(1)


@torch.library.impl(LIB, "valid_token_index", "CompositeExplicitAutograd")
def _valid_token_index(lengths: Tensor, max_len: int, size_hint: int = 0, buckets: int = 0) -> Tensor:
    _check_buckets(buckets)
    index = valid_token_index_reference(lengths, max_len)
    return pad_to_bucket(index, lengths.shape[0] * max_len, buckets) if buckets else index


def _check_mask(valid: Tensor) -> None:
    if valid.dim() != 2 or valid.dtype != torch.bool:
        raise ValueError(f"valid_mask_index: valid must be a (B, N) bool tensor, got {valid.dtype} of shape "
                         f"{tuple(valid.shape)}")


def valid_mask_index_reference(valid: Tensor) -> Tensor:
    """int64 (T,) flat positions b * N + n where valid[b, n], in row-major order."""
    _check_mask(valid)
    return valid.flatten().nonzero().squeeze(1)


@torch.library.impl(LIB, "valid_mask_index", "CompositeExplicitAutograd")
def _valid_mask_index(valid: Tensor, size_hint: int = 0, buckets: int = 0) -> Tensor:
    _check_buckets(buckets)
    index = valid_mask_index_reference(valid)
    return pad_to_bucket(index, valid.numel(), buckets) if buckets else index


def bucket_capacity(count: int, total: int, buckets: int) -> int:
    """count rounded up to a multiple of ceil(total / buckets), at most total: one of buckets + 1 sizes."""
    step = max(1, -(-total // buckets))
    return min(total, -(-count // step) * step)


def pad_to_bucket(index: Tensor, total: int, buckets: int) -> Tensor:
    """``index`` (T,) padded to bucket_capacity(T) entries with the sentinel ``total`` (one past the last
    flat position: a scatter sends those rows to a row that is dropped)."""
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"pad_to_bucket: index must be 1-D int64, got {index.dtype} {tuple(index.shape)}")
    if buckets < 1 or total < 0 or index.numel() > total:
        raise ValueError(f"pad_to_bucket: need buckets >= 1 and 0 <= T <= total, got buckets {buckets}, "
                         f"T {index.numel()}, total {total}")
    capacity = bucket_capacity(index.numel(), total, buckets)
    return torch.cat([index, index.new_full((capacity - index.numel(),), total)])


def _check_buckets(buckets: int) -> None:
    if buckets < 0:
        raise ValueError(f"buckets must be >= 0 (0: the exact token count), got {buckets}")


_HINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""shape env -> {unbacked symbol: the T it was hinted}, for every packed size these ops created."""


def recorded_hints(shape_env: Any) -> dict:
    """The unbacked sizes these ops created in ``shape_env``, each with the T the unpad pass expects
    (recorded whether or not this torch's Inductor reads hints: the partitioner sizes tensors with them)."""
    try:
        return _HINTS.get(shape_env, {})
    except TypeError:  # not weak-referenceable: nothing recorded for it
        return {}


def inductor_reads_unbacked_hints() -> bool:
    from torch._inductor.sizevars import SizeVarAllocator

    return hasattr(SizeVarAllocator, "all_unbacked_explicitly_hinted")


@torch.library.register_fake("gemcompile::valid_token_index")
def _valid_token_index_fake(lengths: Tensor, max_len, size_hint: int = 0, buckets: int = 0) -> Tensor:
    from torch._subclasses.fake_tensor import is_fake

    _check(lengths, max_len)
    _check_buckets(buckets)
    if not is_fake(lengths):
        # plain meta tensors hold no lengths: a shape-only run (explain on the meta device) sees every row
        return lengths.new_empty((lengths.shape[0] * max_len,), dtype=torch.int64)
    total = lengths.shape[0] * max_len
    return _data_dependent_index(lengths, total, _hinted(size_hint, total, buckets))


@torch.library.register_fake("gemcompile::valid_mask_index")
def _valid_mask_index_fake(valid: Tensor, size_hint: int = 0, buckets: int = 0) -> Tensor:
    from torch._subclasses.fake_tensor import is_fake

    _check_mask(valid)
    _check_buckets(buckets)
    if not is_fake(valid):  # a meta vector holds no values: every row (as valid_token_index on meta)
        return valid.new_empty((valid.numel(),), dtype=torch.int64)
    total = valid.shape[0] * valid.shape[1]
    return _data_dependent_index(valid, total, _hinted(size_hint, total, buckets))


def _hinted(size_hint: int, total, buckets: int) -> int:
    """The hint of the index's size: the expected T, or its capacity when bucketed."""
    if size_hint > 0 and buckets and isinstance(total, int):
        return bucket_capacity(size_hint, total, buckets)
    return size_hint


def _data_dependent_index(like: Tensor, bound, size_hint: int) -> Tensor:
    """An int64 (T,) tensor with T a new unbacked SymInt in [0, bound], hinted ``size_hint``."""
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    ctx = torch.library.get_ctx()
    # ctx.new_dynamic_size() insists on the shape env's capture_dynamic_output_shape_ops flag, which Dynamo
    # leaves off by default; the size is data-dependent either way, so allocate the unbacked SymInt directly.
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is None:
        raise RuntimeError("valid_token_index needs a shape environment to trace (its size depends on the data)")
    count = shape_env.create_unbacked_symint()
    _constrain_range_for_size(count, min=0, max=bound if isinstance(bound, int) else None)
    # Without a hint Inductor will not split a reduction over the packed rows (a bias or norm-weight
    # gradient sums T rows): one program per column walks all T, ~4x slower on the H200. The hint only
    # tunes kernels; any T runs correctly. Only where Inductor reads such hints (torch 2.11 has the table
    # but its reductions then fail with "Cannot convert symbols to int", seen on the H200).
    overrides = getattr(shape_env, "var_to_hint_override", None)
    if size_hint > 0 and isinstance(overrides, dict) and inductor_reads_unbacked_hints():
        overrides[count.node.expr] = size_hint
    if size_hint > 0:
        try:
            _HINTS.setdefault(shape_env, {})[count.node.expr] = size_hint
        except TypeError:  # a shape env that is not weak-referenceable: sizes fall back as before
            pass
    return like.new_empty((count,), dtype=torch.int64)


def valid_token_index(lengths: Tensor, max_len: int, size_hint: int = 0, buckets: int = 0) -> Tensor:
    """Flat row-major positions (int64, (T,)) of the tokens n < lengths[b] of a (B, max_len) padded batch.

    ``size_hint`` is the expected T, for compilers only (Inductor sizes reductions over T with it).
    ``buckets > 0``: padded to bucket_capacity(T, B * max_len, buckets) with the sentinel B * max_len."""
    return torch.ops.gemcompile.valid_token_index(lengths, max_len, size_hint, buckets)


def valid_mask_index(valid: Tensor, size_hint: int = 0, buckets: int = 0) -> Tensor:
    """Flat row-major positions (int64, (T,)) of the tokens where the (B, N) bool ``valid`` holds
    (``buckets > 0``: padded as valid_token_index's)."""
    return torch.ops.gemcompile.valid_mask_index(valid, size_hint, buckets)
