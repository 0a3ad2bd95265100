"""build_optimizers on CUDA parameters: fused Adam, foreach Adagrad, and both take a step."""

import pytest
import torch
from torch import nn

from gemcompile.runtime.training.optimizers import build_optimizers

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_cuda_parameters_get_fused_adam_and_both_step():
    model = nn.ModuleDict({"table": nn.Embedding(10, 4), "mlp": nn.Linear(4, 2)}).cuda()
    adam, adagrad = build_optimizers(model, lr=1e-3, embedding_lr=0.1)
    assert adam.defaults["fused"] is True and not adagrad.defaults.get("fused")
    before = [p.detach().clone() for p in model.parameters()]
    model["mlp"](model["table"](torch.arange(3, device="cuda"))).square().sum().backward()
    adam.step()  # a fused flag torch refuses on CUDA fails here, at the first step, not at construction
    adagrad.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
