"""runtime/training/optimizers.py build_optimizers: Adam for dense weights, Adagrad for tables, fused
kernels on CUDA only."""

import torch
from torch import nn

from gemcompile.runtime.training.optimizers import build_optimizers


class TableAndMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 4)
        self.mlp = nn.Linear(4, 2)


def test_dense_weights_get_adam_and_tables_adagrad():
    model = TableAndMlp()
    adam, adagrad = build_optimizers(model, lr=1e-3, embedding_lr=0.1)
    assert isinstance(adam, torch.optim.Adam) and isinstance(adagrad, torch.optim.Adagrad)
    assert {id(p) for p in adam.param_groups[0]["params"]} == {id(model.mlp.weight), id(model.mlp.bias)}
    assert [id(p) for p in adagrad.param_groups[0]["params"]] == [id(model.table.weight)]
    assert adam.defaults["lr"] == 1e-3 and adagrad.defaults["lr"] == 0.1


def test_cpu_parameters_keep_the_default_implementation():
    # CPU training (CI, the tests' trajectories) must not change: fused is asked for on CUDA only
    adam, adagrad = build_optimizers(TableAndMlp(), lr=1e-3, embedding_lr=0.1)
    assert not adam.defaults.get("fused") and not adagrad.defaults.get("fused")
