"""Adam for the dense weights with one Triton launch a step (adam_triton.py).

``TritonAdam`` is ``torch.optim.Adam`` (its hyperparameters, defaults and state: ``step``, ``exp_avg``,
``exp_avg_sq`` per parameter, so checkpoints and DCP state dicts interchange with torch's Adam, fused or
not) whose ``step()`` updates every parameter of a group in one launch. The update is Adam's, in fp32,
within fp32 rounding of torch's (the order of a few operations differs; see adam_triton.py).

It takes what the kernel serves: fp32 contiguous parameters on CUDA (or on the CPU under the Triton
interpreter) with dense, contiguous fp32 gradients; amsgrad, capturable, differentiable, fused and decoupled weight decay
(AdamW's) are refused at construction, anything else at the step, with the parameter named. build_optimizers
(optimizers.py) uses it where every dense parameter qualifies and keeps torch's fused Adam otherwise;
``GEMCOMPILE_TRITON_ADAM=0`` keeps torch's everywhere.
"""

from __future__ import annotations


import torch
from torch import Tensor

from gemcompile.runtime.tables.optimizer_closure import run_closure
from gemcompile.runtime.training.adam_triton import AdamPlan, adam_update_, runs_here
from gemcompile.env import env_flag

__all__ = ["TritonAdam", "triton_adam_enabled", "triton_adam_serves"]


def triton_adam_enabled() -> bool:
    """False when GEMCOMPILE_TRITON_ADAM=0 (torch's fused Adam then, for an A/B)."""
    return env_flag("GEMCOMPILE_TRITON_ADAM", True)


def triton_adam_serves(params: list[Tensor]) -> bool:
    """Whether TritonAdam can update these parameters: fp32, contiguous, plain tensors (no DTensor or other
    subclass) on one device the kernel runs on."""
    if not params:
        return False
    device = params[0].device
    return runs_here(device) and all(
        type(p.data) is Tensor and p.dtype == torch.float32 and p.is_contiguous() and p.device == device
        for p in params)


class TritonAdam(torch.optim.Adam):
    """torch.optim.Adam whose step is one Triton launch per parameter group."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, maximize: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         foreach=False, fused=False)
        for group in self.param_groups:
            self._check_group(group)
        self._plans: dict[tuple, AdamPlan] = {}
        self._steps: dict[int, tuple[Tensor, list[Tensor]]] = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_plans"):  # the constructor's groups are checked once it has run
            self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group: dict) -> None:
        for flag in ("amsgrad", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
            if group.get(flag):
                raise ValueError(f"TritonAdam does not support {flag}=True; use torch.optim.Adam")
        if isinstance(group["lr"], Tensor) and group["lr"].device.type != "cpu":
            raise ValueError("TritonAdam takes lr as a float or a CPU tensor (a CUDA lr would sync every step)")
        for i, p in enumerate(group["params"]):
            if not triton_adam_serves([p]) or p.device != group["params"][0].device:
                raise ValueError(
                    f"TritonAdam updates fp32 contiguous plain tensors on one CUDA device; parameter {i} of a "
                    f"group is {p.dtype} {tuple(p.shape)} on {p.device} (contiguous: {p.is_contiguous()}, "
                    f"type {type(p.data).__name__})")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # a fused Adam's checkpoint keeps step on the GPU: read it once here
            if "step" in state and isinstance(state["step"], Tensor) and state["step"].device.type != "cpu":
                state["step"] = state["step"].detach().to("cpu", torch.float32)
        self._plans.clear()
        self._steps.clear()

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonAdam.step() cannot be captured in a CUDA graph (its gradient addresses "
                               "are copied from the host at each step); use torch.optim.Adam(capturable=True)")
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p, g in zip(params, grads):
                if g.dtype is not torch.float32 or g.is_sparse or not g.is_contiguous() or g.shape != p.shape:
                    raise ValueError(f"TritonAdam needs dense contiguous fp32 gradients shaped like the "
                                     f"parameter; got {g.dtype} {tuple(g.shape)} (sparse: {g.is_sparse}) for a "
                                     f"parameter {tuple(p.shape)}")
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            steps = self._count_steps(gi, states)
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]
            beta1, beta2 = group["betas"]
            # one launch per run of parameters at the same step count (one run, unless parameters joined late)
            start = 0
            while start < len(params):
                end = start + 1
                while end < len(params) and steps[end] == steps[start]:
                    end += 1
                self._launch(gi, start, end, params, grads, exp_avgs, exp_avg_sqs, group, beta1, beta2,
                             steps[start])
                start = end
        return loss

    def _count_steps(self, gi: int, states: list[dict]) -> list[int]:
        """Add one to every state's step and return the counts. The steps of a group are 0-d views of one
        buffer (the value and dtype torch's Adam keeps, so state dicts are unchanged), so that counting is one
        add and one read: a loop of 0-d tensor ops cost milliseconds of host time a step at 380 tensors."""
        buffer, views = self._steps.get(gi, (None, ()))
        current = [state["step"] for state in states]
        if len(views) != len(current) or any(a is not b for a, b in zip(views, current)):
            buffer = torch.tensor([float(t) for t in current], dtype=torch.float32)
            views = [buffer[i] for i in range(len(current))]
            for state, view in zip(states, views):
                state["step"] = view
            self._steps[gi] = (buffer, views)
        buffer += 1
        return [int(v) for v in buffer.tolist()]

    def _launch(self, gi, start, end, params, grads, exp_avgs, exp_avg_sqs, group, beta1, beta2, step) -> None:
        key = (gi, start, end)
        span = slice(start, end)
        plan = self._plans.get(key)
        if plan is None or not plan.matches(params[span], exp_avgs[span], exp_avg_sqs[span]):
            plan = self._plans[key] = AdamPlan(params[span], exp_avgs[span], exp_avg_sqs[span])
        adam_update_(plan, grads[span], lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                     eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                     maximize=bool(group["maximize"]), step=step)
