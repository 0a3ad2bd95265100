"""TritonAdam (runtime/training/adam.py, one Triton launch a step) against torch.optim.Adam, under the Triton
interpreter on the CPU: the same trajectory within fp32 rounding, state dicts that interchange, and clear
refusals of what it does not serve."""

import pytest
import torch
from torch import nn

from gemcompile.lowering.common.tuned_launch import INTERPRET
from gemcompile.runtime.training.adam import TritonAdam, triton_adam_serves
from gemcompile.runtime.training.adam_triton import BLOCK

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel in the interpreter (TRITON_INTERPRET=1)")

# one element, a block's worth exactly, tails on both sides of a block boundary, 2-D and 3-D
SHAPES = [(1,), (BLOCK,), (BLOCK + 1,), (3, 7), (2 * BLOCK - 1,), (5, 4, 33)]


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g) * 3) for s in shapes]


def _clones(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def _draw_grads(groups, g):
    for params in groups:
        for p in params:
            p.grad = None
    for i, p in enumerate(groups[0]):
        grad = torch.randn(p.shape, generator=g) * torch.exp2(torch.randint(-8, 8, (1,), generator=g).float())
        for params in groups:
            params[i].grad = grad.clone()


def _assert_close(ours, ref, what):
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


@pytest.mark.parametrize("kwargs", [
    {},
    {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6},
    {"weight_decay": 0.1},
    {"maximize": True, "weight_decay": 0.01},
])
def test_trajectory_matches_torch_adam_in_fp32_and_float64(kwargs):
    base = _params(SHAPES, seed=1)
    ours_p, ref_p = _clones(base), _clones(base)
    ref64 = [nn.Parameter(p.detach().double().clone()) for p in base]
    ours = TritonAdam(ours_p, **kwargs)
    ref = torch.optim.Adam(ref_p, foreach=False, **kwargs)
    ref_f64 = torch.optim.Adam(ref64, foreach=False, **kwargs)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        _draw_grads([ours_p, ref_p], g)
        for p, q in zip(ref64, ref_p):
            p.grad = q.grad.double()
        ours.step()
        ref.step()
        ref_f64.step()
    _assert_close(ours_p, ref_p, "parameters vs torch's fp32 Adam")
    for a, b in zip(ours_p, ref64):  # and no further from float64 than fp32 rounding of a few steps
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    for name in ("exp_avg", "exp_avg_sq"):
        _assert_close([ours.state[p][name] for p in ours_p], [ref.state[p][name] for p in ref_p], name)
    assert all(float(ours.state[p]["step"]) == 4.0 for p in ours_p)


def test_groups_with_their_own_lr_and_parameters_without_gradients():
    base = _params(SHAPES, seed=3)
    ours_p, ref_p = _clones(base), _clones(base)
    ours = TritonAdam([{"params": ours_p[:3], "lr": 1e-1}, {"params": ours_p[3:]}], lr=1e-2)
    ref = torch.optim.Adam([{"params": ref_p[:3], "lr": 1e-1}, {"params": ref_p[3:]}], lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        _draw_grads([ours_p, ref_p], g)
        if step == 1:  # a parameter without a gradient is skipped (its step count stays), as torch does
            ours_p[4].grad = ref_p[4].grad = None
        ours.step()
        ref.step()
    _assert_close(ours_p, ref_p, "parameters")
    assert float(ours.state[ours_p[4]]["step"]) == float(ref.state[ref_p[4]]["step"]) == 2.0


def test_a_parameter_added_later_runs_at_its_own_step_count():
    base = _params(SHAPES, seed=5)
    ours_p, ref_p = _clones(base), _clones(base)
    ours = TritonAdam(ours_p[:2], lr=1e-2)
    ref = torch.optim.Adam(ref_p[:2], lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(6)
    for step in range(4):
        if step == 2:
            ours.param_groups[0]["params"].extend(ours_p[2:])
            ref.param_groups[0]["params"].extend(ref_p[2:])
        _draw_grads([ours_p, ref_p], g)
        ours.step()
        ref.step()
    _assert_close(ours_p, ref_p, "parameters")
    assert [float(ours.state[p]["step"]) for p in ours_p] == [4.0, 4.0] + [2.0] * (len(SHAPES) - 2)


@pytest.mark.parametrize("direction", ["torch -> ours", "ours -> torch"])
def test_state_dicts_interchange_with_torch_adam(direction):
    base = _params(SHAPES, seed=7)
    a_p, b_p, ref_p = _clones(base), _clones(base), _clones(base)
    make_a, make_b = ((lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False)), (lambda ps: TritonAdam(ps, lr=1e-2)))
    if direction == "ours -> torch":
        make_a, make_b = make_b, make_a
    a, ref = make_a(a_p), torch.optim.Adam(ref_p, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        _draw_grads([a_p, ref_p], g)
        a.step()
        ref.step()
    with torch.no_grad():
        for p, q in zip(b_p, a_p):
            p.copy_(q)
    b = make_b(b_p)
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        _draw_grads([b_p, ref_p], g)
        b.step()
        ref.step()
    _assert_close(b_p, ref_p, "parameters after the resume")


def test_a_replaced_parameter_storage_makes_a_new_plan():
    base = _params(SHAPES, seed=9)
    ours_p, ref_p = _clones(base), _clones(base)
    ours, ref = TritonAdam(ours_p, lr=1e-2), torch.optim.Adam(ref_p, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(10)
    _draw_grads([ours_p, ref_p], g)
    ours.step()
    ref.step()
    ours_p[2].data = ours_p[2].data.clone()  # new address: the cached device addresses would be stale
    _draw_grads([ours_p, ref_p], g)
    ours.step()
    ref.step()
    _assert_close(ours_p, ref_p, "parameters")


def test_refusals_name_what_is_not_served():
    p = nn.Parameter(torch.zeros(4))
    for flag in ("amsgrad", "capturable", "differentiable", "fused"):
        with pytest.raises(ValueError, match=flag):
            TritonAdam([{"params": [p], flag: True}])
    with pytest.raises(ValueError, match="bfloat16"):
        TritonAdam([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="contiguous: False"):
        TritonAdam([nn.Parameter(torch.zeros(4, 6).t())])
    w = nn.Parameter(torch.zeros(4, 6))
    opt = TritonAdam([w])
    w.grad = torch.zeros(6, 4).t()  # a transposed gradient: the kernel reads it as flat memory
    with pytest.raises(ValueError, match="dense contiguous fp32 gradients"):
        opt.step()
    assert not triton_adam_serves([]) and not triton_adam_serves([torch.zeros(2, dtype=torch.float16)])


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("saved_by,loaded_by", [("triton", "triton"), ("triton", "torch"), ("torch", "triton")])
def test_dcp_checkpoint_resumes_across_torch_and_triton_adam(saved_by, loaded_by, tmp_path):
    from gemcompile.runtime.training.checkpoint import load_checkpoint, save_checkpoint

    def make(kind, model):
        return TritonAdam(model.parameters(), lr=1e-2) if kind == "triton" else torch.optim.Adam(
            model.parameters(), lr=1e-2, foreach=False)

    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(4, 8, generator=g) for _ in range(5)]
    torch.manual_seed(0)
    straight = _Mlp()
    straight_opt = make(saved_by, straight)
    _train(straight, straight_opt, batches[:3])
    save_checkpoint(tmp_path, 3, straight, straight_opt)
    _train(straight, straight_opt, batches[3:])

    torch.manual_seed(1)  # other initial weights: the checkpoint must overwrite them
    resumed = _Mlp()
    resumed_opt = make(loaded_by, resumed)
    state = load_checkpoint(tmp_path / "step_00000003", resumed, resumed_opt)
    assert state.step == 3
    assert all(float(s["step"]) == 3.0 for s in resumed_opt.state.values())
    _train(resumed, resumed_opt, batches[3:])
    for a, b in zip(resumed.parameters(), straight.parameters()):
        if saved_by == loaded_by:
            assert torch.equal(a, b)
        else:  # the two implementations round a few operations differently
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_closure_runs_with_gradients_and_its_loss_is_returned():
    model = _Mlp()
    opt = TritonAdam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()  # would fail under the step's no_grad
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert loss is not None and loss.requires_grad
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
