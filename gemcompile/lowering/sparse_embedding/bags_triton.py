"""The pooled lookups of many embedding-bag tables in one Triton launch (table-batched embeddings).

One program sums (or averages) a block of bags of one table over a block of columns. The tables' weights
stay separate tensors: the kernel reads each table's weight pointer, row count and row stride from a small
int64 table (table_meta.py), built once per set of weights and kept (the pointers do not change while a
model trains), so a call copies nothing from the host.

The ids of a bag are summed in order with an fp32 accumulator, as torch's CUDA embedding_bag kernel sums
them, so the outputs match nn.EmbeddingBag's. Padding ids (``padding_idx``) are left out of the sum and of
a mean's count; a bag of padding only is 0. An id outside [0, rows) is never read: the kernel clears the
``ok`` flag and the launcher asserts it on the device (``torch._assert_async``: a device-side assert, as
torch's own embedding kernels raise, never a silent row or an illegal address).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.tuned_launch import INTERPRET
from .table_meta import TL_DTYPES, device_table

__all__ = ["embedding_bags_triton"]


@triton.jit
def _bags_fwd_kernel(Ids, Meta, Out, Ok, bags, dim, padding_idx, stride_it, stride_ib, stride_ih,
                     stride_ot, stride_ob, HOT: tl.constexpr, MEAN: tl.constexpr, HAS_PADDING: tl.constexpr,
                     W_DTYPE: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    table = tl.program_id(1)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    bag_ok = b < bags
    col_ok = cols < dim
    weight = tl.load(Meta + table * 3).to(tl.pointer_type(W_DTYPE))
    rows = tl.load(Meta + table * 3 + 1)
    stride_w = tl.load(Meta + table * 3 + 2)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_B], dtype=tl.int32)
    bad = tl.zeros([BLOCK_B], dtype=tl.int32)
    ids = Ids + table.to(tl.int64) * stride_it + b.to(tl.int64) * stride_ib
    for h in range(0, HOT):  # HOT constexpr: a model's features keep their width
        i = tl.load(ids + h * stride_ih, mask=bag_ok, other=padding_idx).to(tl.int64)
        inside = (i >= 0) & (i < rows)
        use = bag_ok & inside
        outside = bag_ok & ~inside
        if HAS_PADDING:  # (else padding_idx is -1, and an id of -1 is outside the table, not padding)
            use = use & (i != padding_idx)
            outside = outside & (i != padding_idx)
        bad += outside.to(tl.int32)
        row = tl.load(weight + i[:, None] * stride_w + cols[None, :], mask=use[:, None] & col_ok[None, :],
                      other=0.0)
        acc += row.to(tl.float32)
        count += use.to(tl.int32)
    if MEAN:
        acc = acc / tl.maximum(count, 1).to(tl.float32)[:, None]
    out = Out + table.to(tl.int64) * stride_ot + b.to(tl.int64)[:, None] * stride_ob + cols[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=bag_ok[:, None] & col_ok[None, :])
    if tl.sum(bad, axis=0) > 0:
        tl.store(Ok, 0)


@torch.no_grad()
def embedding_bags_triton(ids: torch.Tensor, weights: list[torch.Tensor], mean: bool, padding_idx: int
                          ) -> torch.Tensor:
    """(tables, bags, dim): bag b of table t pools weights[t] at ids[t, b, :] (sum, or mean over the
    non-padding ids). ids (tables, bags, hot) of any strides; weights of one dim, dtype and device with unit
    column stride; ``padding_idx`` -1 for none."""
    tables, bags, hot = ids.shape
    dim, dtype = weights[0].shape[1], weights[0].dtype
    out = torch.empty((tables, bags, dim), dtype=dtype, device=ids.device)
    if out.numel() == 0:
        return out
    ok = torch.ones(1, dtype=torch.int32, device=ids.device)
    block_d = min(128 if not INTERPRET else 32, triton.next_power_of_2(dim))
    block_b = 16 if not INTERPRET else 4
    grid = (triton.cdiv(bags, block_b), tables, triton.cdiv(dim, block_d))
    meta = device_table(tuple((w.data_ptr(), w.shape[0], w.stride(0)) for w in weights), ids.device)
    _bags_fwd_kernel[grid](
        ids, meta, out, ok, bags, dim, padding_idx, ids.stride(0), ids.stride(1),
        ids.stride(2), out.stride(0), out.stride(1), HOT=hot, MEAN=mean, HAS_PADDING=padding_idx >= 0,
        W_DTYPE=TL_DTYPES[dtype], BLOCK_B=block_b, BLOCK_D=block_d, num_warps=4)
    torch._assert_async(ok, "gemcompile::sparse_embedding_bags: an id lies outside its table's rows")
    return out
