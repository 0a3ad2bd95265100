"""Differentiable collectives for the parallel plan, and a counter of the collectives a step issues.

The plan's expert and embedding exchanges move activations between ranks inside the autograd graph:
an all-gather whose backward is a reduce-scatter (sum), a reduce-scatter whose backward is an
all-gather, an all-to-all whose backward is the all-to-all with the splits swapped. They call the
c10d collectives directly (gloo on CPUs, NCCL on GPUs) on the process group of one mesh axis.

CollectiveCounter is a TorchDispatchMode that sees every c10d collective (ours, FSDP2's, DTensor's) and
counts it by op and by the mesh axis its process group belongs to: the check that each collective lands
on the axis the plan puts it on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "all_gather", "all_to_all", "reduce_scatter", "scale_grad"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity in forward; multiplies the gradient by `factor` in backward."""
    if factor == 1 or not x.requires_grad:
        return x
    return _ScaleGrad.apply(x, factor)


# torch 2.13 names the single-tensor collectives *_single and warns on the old names; 2.11 has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(group) -> int:
    return dist.get_world_size(group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_zeros((_world(group) * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_raw(grad, ctx.group), None


def _reduce_scatter_raw(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_zeros((x.shape[0] // _world(group), *x.shape[1:]))
    reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_raw(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_zeros((_world(ctx.group) * grad.shape[0], *grad.shape[1:]))
        all_gather_single(out, grad, group=ctx.group)
        return out, None


def _all_to_all_raw(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                    group) -> torch.Tensor:
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_zeros((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=None if out_splits is None else list(out_splits),
                           input_split_sizes=None if in_splits is None else list(in_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all_raw(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_raw(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (rank order of the group); backward: reduce-scatter (sum)."""
    if _world(group) == 1:
        return x
    if not x.requires_grad:
        return _AllGather.apply(x, group).detach()
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x over the ranks and keep this rank's 1/n of dim 0; backward: all-gather."""
    if _world(group) == 1:
        return x
    return _ReduceScatter.apply(x, group)


def all_to_all(x: torch.Tensor, group, out_splits: Sequence[int] | None = None,
               in_splits: Sequence[int] | None = None) -> torch.Tensor:
    """all_to_all_single along dim 0 (equal splits when the split lists are None); backward: the
    all-to-all with the splits swapped."""
    if _world(group) == 1:
        return x
    if not x.requires_grad:
        return _all_to_all_raw(x, out_splits, in_splits, group)
    return _AllToAll.apply(x, out_splits, in_splits, group)


# ---------------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------------

_OP_KIND = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
}


def _group_name(args) -> str | None:
    for a in args:
        if isinstance(a, str):
            continue
        name = getattr(a, "group_name", None)
        if isinstance(name, str):
            return name
        try:  # a c10d ProcessGroup script object
            pg = dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) else None
        except (RuntimeError, TypeError, AttributeError):
            pg = None
        if pg is not None:
            return pg.group_name
    for a in args:  # functional collectives name the group by its string
        if isinstance(a, str) and a and not a.isidentifier():
            return a
    return args[-1] if args and isinstance(args[-1], str) else None


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives by (op, axis) while active. `axes` maps a process group name to the axis
    it serves (a group serving several axes of equal membership counts under the first name).
    Collectives on groups of one rank are not counted (the plan says degenerate axes issue nothing)."""

    def __init__(self, axes: Mapping[str, str], single_rank_groups: set[str] | None = None):
        super().__init__()
        self.axes = dict(axes)
        self.single = set(single_rank_groups or ())
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            kind = _OP_KIND.get(func._opname)
            if kind is not None:
                name = _group_name(list(args) + list(kwargs.values()))
                if name not in self.single:
                    self.counts[(kind, self.axes.get(name, f"group:{name}"))] += 1
        return func(*args, **kwargs)

    def as_dict(self) -> dict[tuple[str, str], int]:
        return dict(self.counts)
