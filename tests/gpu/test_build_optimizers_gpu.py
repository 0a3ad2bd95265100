"""build_optimizers on CUDA parameters: TritonAdam for the dense weights (torch's fused Adam with
GEMCOMPILE_TRITON_ADAM=0 or triton_adam=False), foreach Adagrad, and both take a step; TritonAdam's
trajectory against torch's fused Adam on the GPU."""

import pytest
import torch
from torch import nn

from gemcompile.runtime.training.adam import TritonAdam
from gemcompile.runtime.training.adam_triton import BLOCK
from gemcompile.runtime.training.optimizers import build_optimizers

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _model():
    return nn.ModuleDict({"table": nn.Embedding(10, 4), "mlp": nn.Linear(4, 2)}).cuda()


def test_cuda_parameters_get_triton_adam_and_both_step():
    model = _model()
    adam, adagrad = build_optimizers(model, lr=1e-3, embedding_lr=0.1)
    assert isinstance(adam, TritonAdam) and not adagrad.defaults.get("fused")
    before = [p.detach().clone() for p in model.parameters()]
    model["mlp"](model["table"](torch.arange(3, device="cuda"))).square().sum().backward()
    adam.step()
    adagrad.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("how", ["env", "argument"])
def test_torch_fused_adam_when_asked(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("GEMCOMPILE_TRITON_ADAM", "0")
    model = _model()
    adam, _ = build_optimizers(model, lr=1e-3, embedding_lr=0.1, triton_adam=how != "argument")
    assert type(adam) is torch.optim.Adam and adam.defaults["fused"] is True
    before = model["mlp"].weight.detach().clone()
    model["mlp"](torch.ones(1, 4, device="cuda")).sum().backward()
    adam.step()  # a fused flag torch refuses on CUDA fails here, at the first step, not at construction
    assert not torch.equal(before, model["mlp"].weight)


def test_triton_adam_is_as_accurate_as_torch_fused_adam_on_the_gpu():
    """Against float64 Adam: TritonAdam's error no larger than torch's fused Adam's (both fp32; they round a
    few operations differently, so they differ from each other by an ulp of a parameter here and there)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1,), (BLOCK + 3,), (257, 129), (4096, 1000)]
    base = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    ours_p = [nn.Parameter(t.clone()) for t in base]
    ref_p = [nn.Parameter(t.clone()) for t in base]
    f64_p = [nn.Parameter(t.double()) for t in base]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01}
    ours = TritonAdam(ours_p, **kwargs)
    ref = torch.optim.Adam(ref_p, fused=True, **kwargs)
    f64 = torch.optim.Adam(f64_p, foreach=False, **kwargs)
    for _ in range(5):
        for a, b, c in zip(ours_p, ref_p, f64_p):
            a.grad = torch.randn(a.shape, device="cuda", generator=g)
            b.grad = a.grad.clone()
            c.grad = a.grad.double()
        ours.step()
        ref.step()
        f64.step()
    for a, b, c in zip(ours_p, ref_p, f64_p):
        ours_err = (a.double() - c).abs().max().item()
        torch_err = (b.double() - c).abs().max().item()
        ulps = 4 * torch.finfo(torch.float32).eps * c.abs().max().item()  # where fused Adam happens to be exact
        assert ours_err <= 2 * torch_err + ulps, (tuple(a.shape), ours_err, torch_err)
        # elementwise they agree to a few ulps, except where grad + weight_decay * p nearly cancels (FMA or
        # not then changes the update's sign or size: one element in 4M on the H100)
        far = ((a - b).abs() > 1e-6 + 1e-6 * b.abs()).float().mean().item()
        assert far <= 1e-5, (tuple(a.shape), far)
    # and a fused Adam's checkpoint (step kept on the GPU) resumes in TritonAdam
    resumed = TritonAdam([nn.Parameter(p.detach().clone()) for p in ref_p], **kwargs)
    resumed.load_state_dict(ref.state_dict())
    assert all(s["step"].device.type == "cpu" for s in resumed.state.values())
