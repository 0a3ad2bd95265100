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
    adam, _ = build_optimizers(_model(), lr=1e-3, embedding_lr=0.1, triton_adam=how != "argument")
    assert type(adam) is torch.optim.Adam and adam.defaults["fused"] is True
    _model()["mlp"](torch.ones(1, 4, device="cuda")).sum().backward()
    adam.step()  # a fused flag torch refuses on CUDA fails here, at the first step, not at construction


def test_triton_adam_follows_torch_fused_adam_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1,), (BLOCK + 3,), (257, 129), (4096, 1000)]
    base = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    ours_p = [nn.Parameter(t.clone()) for t in base]
    ref_p = [nn.Parameter(t.clone()) for t in base]
    ours = TritonAdam(ours_p, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.Adam(ref_p, lr=1e-2, weight_decay=0.01, fused=True)
    for _ in range(5):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, device="cuda", generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    # and a fused Adam's checkpoint (step kept on the GPU) resumes in TritonAdam
    resumed = TritonAdam([nn.Parameter(p.detach().clone()) for p in ref_p], lr=1e-2, weight_decay=0.01)
    resumed.load_state_dict(ref.state_dict())
    assert all(s["step"].device.type == "cpu" for s in resumed.state.values())
