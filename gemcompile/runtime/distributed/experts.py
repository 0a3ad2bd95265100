"""Expert parallelism for dense expert ensembles (GEM-ref's Interaction of Wukong experts).

GEM's experts are dense ensemble members applied to every sample, not token-routed MoE. Meta's
pattern: each rank of the ep axis holds E / ep experts; forward =
all-gather the activations over ep -> run the local experts on the gathered (full ep-group) batch ->
reduce-scatter the gate-weighted outputs over ep, which both sums over the experts and hands each rank
its own samples back. The per-sample gate is computed before the exchange on the rank's own samples
and travels with the activations (one all-gather), so the gate and everything dense stay data parallel.

Gradients: the backward is the transpose (all-gather of output grads, reduce-scatter of input grads).
A local expert's gradient sums the ep group's ep x B samples while FSDP averages it over the
(dp_replicate, efsdp) mesh of W / ep ranks, so it would come out ep times the data-parallel gradient:
the expert's parameter gradients are scaled by 1 / ep (its output gradient by 1 / ep, its input
gradient back by ep, so activations and the gate see the exact gradient). FSDP's own divide factor
would do the same but needs ReduceOp.PREMUL_SUM, which gloo lacks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gemcompile.runtime.distributed.collectives import all_gather, reduce_scatter, scale_grad

__all__ = ["ExpertParallelMixture"]


class ExpertParallelMixture(nn.Module):
    """Replaces an ``Interaction``: ``gate`` (d -> E logits, softmax over experts of the token mean)
    and ``experts`` (E modules mapping (B, n_in, d) -> (B, n_out, d)). Holds only this rank's experts,
    in a ModuleDict keyed by the global expert index, so parameter names are the original ones
    (``...interaction.experts.3.fm_y``) and checkpoints load across expert-parallel sizes."""

    def __init__(self, interaction: nn.Module, ep_rank: int, ep_size: int, group) -> None:
        super().__init__()
        experts = interaction.experts
        count = len(experts)
        if count % ep_size:
            raise ValueError(f"expert count {count} is not divisible by ep={ep_size}")
        per_rank = count // ep_size
        self.expert_count = count
        self.local_indices = list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
        self.gate = interaction.gate
        self.experts = nn.ModuleDict({str(e): experts[e] for e in self.local_indices})
        self.group = group
        self.ep_size = ep_size

    def forward(self, x: Tensor) -> Tensor:
        # x (B, n_in, d): this rank's samples
        weights = torch.softmax(self.gate(x.mean(dim=1)), dim=-1)  # (B, E), as Interaction
        feature_shape = x.shape[1:]
        width = x[0].numel()
        dtype = torch.promote_types(x.dtype, weights.dtype)
        packed = torch.cat([x.flatten(1).to(dtype), weights.to(dtype)], dim=1)  # one message per sample
        gathered = all_gather(packed, self.group)  # (ep * B, width + E): the ep group's samples
        xg = gathered[:, :width].unflatten(1, feature_shape).to(x.dtype)
        wg = gathered[:, width:]
        out = None
        x_in = scale_grad(xg, self.ep_size)
        for e in self.local_indices:
            h = scale_grad(self.experts[str(e)](x_in), 1.0 / self.ep_size)  # parameter grads / ep
            y = wg[:, e, None, None] * h  # (ep * B, n_out, d)
            out = y if out is None else out + y
        return reduce_scatter(out, self.group)  # (B, n_out, d): summed over all experts of the group

    def extra_repr(self) -> str:
        return f"experts {self.local_indices} of {self.expert_count}, ep={self.ep_size}"
