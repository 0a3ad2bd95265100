"""runtime/training/checkpoint.py: DCP save / load in one process, compiled wrappers, RNG, latest
checkpoint."""

import pytest
import torch
from torch import nn

from gemcompile.runtime.training.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    unwrap_model,
)
from gemcompile.runtime.training.optimizers import build_optimizers


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(20, 4, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids):
        return self.mlp(self.table(ids)).squeeze(-1)


def _step(model, optimizers, step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 20, (6, 3), generator=gen)
    loss = (model(ids) - torch.randn(6, generator=gen)).pow(2).mean()
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in optimizers:
        o.step()
    return loss.item()


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = Small()
    return model, build_optimizers(model, lr=1e-2, embedding_lr=0.1)


def test_round_trip_resumes_bit_exactly(tmp_path):
    model, optimizers = _fresh()
    assert [type(o).__name__ for o in optimizers] == ["Adam", "Adagrad"]
    for step in range(3):
        _step(model, optimizers, step)
    path = save_checkpoint(tmp_path, 3, model, optimizers, extra={"losses": [1.0, 0.5], "note": "x"})
    assert path == checkpoint_path(tmp_path, 3) and (path / ".metadata").is_file()
    reference = [_step(model, optimizers, step) for step in range(3, 6)]

    other, other_optimizers = _fresh(seed=123)  # different init: everything must come from the checkpoint
    state = load_checkpoint(path, other, other_optimizers)
    assert state.step == 3 and state.extra == {"losses": [1.0, 0.5], "note": "x"}
    assert [_step(other, other_optimizers, step) for step in range(3, 6)] == reference
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_compiled_wrapper_saves_the_original_module(tmp_path):
    model, optimizers = _fresh()
    compiled = torch.compile(model)  # never called: only the wrapper matters here
    assert unwrap_model(compiled) is model
    _step(model, optimizers, 0)
    path = save_checkpoint(tmp_path, 1, compiled, optimizers)
    plain, plain_optimizers = _fresh(seed=7)
    load_checkpoint(path, plain, plain_optimizers)  # keys have no "_orig_mod." prefix
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_rng_state_is_restored(tmp_path):
    model, optimizers = _fresh()
    torch.manual_seed(42)
    path = save_checkpoint(tmp_path, 0, model, optimizers)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_checkpoint(path, model, optimizers)
    assert torch.equal(torch.rand(3), expected)


def test_latest_checkpoint_skips_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    model, optimizers = _fresh()
    save_checkpoint(tmp_path, 2, model, optimizers)
    save_checkpoint(tmp_path, 10, model, optimizers)
    (tmp_path / "step_00000020").mkdir()  # an interrupted save: no .metadata
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)


def test_load_missing_checkpoint_is_clear(tmp_path):
    model, optimizers = _fresh()
    with pytest.raises(FileNotFoundError, match="no complete DCP checkpoint"):
        load_checkpoint(tmp_path / "step_00000001", model, optimizers)


def test_bad_arguments(tmp_path):
    model, optimizers = _fresh()
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path, -1, model, optimizers)
    with pytest.raises(TypeError, match="optimizers must be"):
        save_checkpoint(tmp_path, 1, model, [])
