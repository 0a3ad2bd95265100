"""One Triton launch for Adam's update of a list of fp32 tensors (the dense weights' step).

The update is torch.optim.Adam's (L2 weight decay, no amsgrad), per element in fp32:

    g = -grad if maximize else grad;  g += weight_decay * p
    m = beta1 m + (1 - beta1) g;      v = beta2 v + (1 - beta2) g^2
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Why not torch's fused Adam: the update is memory-bound (7 fp32 accesses a parameter), and on GEM-ref medium's
380 dense tensors (1.05B parameters) torch's fused kernel moved 2608-2655 GB/s on an H100 where a copy of the
same bytes moved 3026-3046 and this kernel 2905-2932 (benchmarks/results/adam_step-20261206-0913*.json).

Layout: the tensors stay where they are. A plan per tensor list holds, on the device, each tensor's address
(parameter, exp_avg, exp_avg_sq), its element count and first block, and for every block the tensor it
belongs to; the gradients' addresses change from step to step (autograd allocates them), so they go to the
device at each launch through a small ring of pinned buffers (an event guards a buffer until its copy ran,
so the host never waits for the GPU's queue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from gemcompile.lowering.common.tuned_launch import INTERPRET

__all__ = ["BLOCK", "AdamPlan", "adam_update_"]

BLOCK = 512
"""Elements a program: 512 with 4 warps was the fastest of 512-4096 on the H100 (larger blocks were up to
2x slower); a fixed config, since an autotuner would have to undo in-place updates between its trials."""
NUM_WARPS = 4


@triton.jit
def _adam_kernel(BlockTensor, FirstBlock, Numel, PAddr, GAddr, MAddr, VAddr, lr_over_bc1, inv_bc2_sqrt,
                 beta1, beta2, eps, weight_decay, MAXIMIZE: tl.constexpr, DECAY: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(BlockTensor + pid)
    start = (pid - tl.load(FirstBlock + t)).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    ok = idx < tl.load(Numel + t)
    p_ptr = tl.load(PAddr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(GAddr + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(MAddr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(VAddr + t).to(tl.pointer_type(tl.float32))
    # every byte is read once and written once: keep none of it in L2
    p = tl.load(p_ptr + idx, mask=ok, eviction_policy="evict_first")
    g = tl.load(g_ptr + idx, mask=ok, eviction_policy="evict_first")
    m = tl.load(m_ptr + idx, mask=ok, eviction_policy="evict_first")
    v = tl.load(v_ptr + idx, mask=ok, eviction_policy="evict_first")
    if MAXIMIZE:
        g = -g
    if DECAY:
        g = g + weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE sqrt and division, as torch's CUDA Adam computes them (Triton's defaults are the approximate ones)
    p = p - tl.div_rn(lr_over_bc1 * m, tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
    tl.store(p_ptr + idx, p, mask=ok)
    tl.store(m_ptr + idx, m, mask=ok)
    tl.store(v_ptr + idx, v, mask=ok)


def _addresses(tensors: list[Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


class AdamPlan:
    """The device tables of one list of (parameter, exp_avg, exp_avg_sq) fp32 tensors, all contiguous and on
    one device; ``matches`` says whether the plan still describes the lists (same tensors at the same
    addresses: a replaced ``.data`` or a loaded state makes a new plan)."""

    RING = 4

    def __init__(self, params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]) -> None:
        device = params[0].device
        self.param_addresses = _addresses(params)
        self.tensors = (list(params), list(exp_avgs), list(exp_avg_sqs))
        sizes = [p.numel() for p in params]
        blocks = [triton.cdiv(n, BLOCK) for n in sizes]
        first = [0]
        for b in blocks[:-1]:
            first.append(first[-1] + b)
        self.n_blocks = sum(blocks)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(params), dtype=torch.int32), torch.tensor(blocks)).to(device)
        self.first_block = torch.tensor(first, dtype=torch.int32, device=device)
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.p_addr, self.m_addr, self.v_addr = (torch.tensor(_addresses(t), dtype=torch.int64, device=device)
                                                 for t in self.tensors)
        pinned = device.type == "cuda"
        self._host = [torch.empty(len(params), dtype=torch.int64, pin_memory=pinned) for _ in range(self.RING)]
        self._dev = [torch.empty(len(params), dtype=torch.int64, device=device) for _ in range(self.RING)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(self.RING)]
        self._turn = 0

    def matches(self, params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]) -> bool:
        """The same tensor objects (identity: cheap) and the same parameter storage (a replaced ``.data``);
        the moments are the optimizer's own, replaced only through its state (a load clears the plans)."""
        lists = (params, exp_avgs, exp_avg_sqs)
        if any(len(a) != len(b) or any(x is not y for x, y in zip(a, b)) for a, b in zip(lists, self.tensors)):
            return False
        return self.param_addresses == _addresses(params)

    def grad_addresses(self, grads: list[Tensor]) -> Tensor:
        """The gradients' addresses on the device, through the next pinned buffer of the ring."""
        i = self._turn
        self._turn = (i + 1) % self.RING
        if self._copied[i] is None:  # CPU (the interpreter): the addresses are read in place
            self._dev[i].copy_(torch.tensor(_addresses(grads), dtype=torch.int64))
            return self._dev[i]
        self._copied[i].synchronize()  # this buffer's previous copy (RING launches ago) has run
        self._host[i].copy_(torch.tensor(_addresses(grads), dtype=torch.int64))
        self._dev[i].copy_(self._host[i], non_blocking=True)
        self._copied[i].record()
        return self._dev[i]


def adam_update_(plan: AdamPlan, grads: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, maximize: bool, step: int) -> None:
    """One Adam step of the plan's tensors in place, with the bias corrections of step ``step`` (>= 1)."""
    if plan.n_blocks == 0:
        return
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    g_addr = plan.grad_addresses(grads)
    _adam_kernel[(plan.n_blocks,)](
        plan.block_tensor, plan.first_block, plan.numel, plan.p_addr, g_addr, plan.m_addr, plan.v_addr,
        lr / bc1, 1.0 / bc2 ** 0.5, beta1, beta2, eps, weight_decay,
        MAXIMIZE=bool(maximize), DECAY=weight_decay != 0, BLOCK=BLOCK, num_warps=NUM_WARPS)


def runs_here(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of this device: CUDA, or the CPU under the interpreter."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")
