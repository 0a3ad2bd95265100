"""Issue 24 on CUDA: one batch order / key bounds per lengths (or key mask) tensor per step, shared by every
attention op and saved for the backward, through Inductor, CUDA graphs and the eager fast path.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_length_order_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, gem_compile
from gemcompile.lowering.common import length_order as lo
from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
from tests.integration.test_shared_length_order import (
    L,
    L2,
    LengthSites,
    MaskSites,
    length_inputs,
    mask_inputs,
    step,
)

DEV = "cuda"
NO_UNPAD = GemConfig(unpad={"enabled": False})  # (its packed token count is a host read: no CUDA graph)


def _close(got, want, rtol=1e-3, atol=1e-4):
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _counted_step(fn, inputs):
    torch.cuda.synchronize()
    lo.reset_counts()
    result = step(fn, inputs)
    torch.cuda.synchronize()
    return result, dict(lo.COUNTS)


def test_inductor_step_derives_each_order_once_and_matches_the_unshared_graph(monkeypatch):
    import gemcompile.passes.attention.rewrite as rewrite

    torch.manual_seed(0)
    model = LengthSites().to(DEV)
    inputs = length_inputs(device=DEV)
    compiled = gem_compile(model, config=NO_UNPAD)
    step(compiled, inputs)
    shared, counts = _counted_step(compiled, inputs)
    assert counts == {"order": 2}  # lengths, lengths2: five attention ops forward and backward
    monkeypatch.setattr(rewrite, "share_derived_tensors", lambda graph: 0)
    torch._dynamo.reset()
    unshared = gem_compile(model, config=NO_UNPAD)
    step(unshared, inputs)
    before, counts = _counted_step(unshared, inputs)
    assert counts == {"order": 3 * 2 + 3}
    _close(shared, before, rtol=1e-5, atol=1e-6)  # the same kernels; only the derived tensors' source differs
    _close(shared, step(model, inputs))


def test_one_key_bounds_per_mask_per_step():
    torch.manual_seed(0)
    model = MaskSites().to(DEV)
    inputs = mask_inputs(device=DEV)
    compiled = gem_compile(model, config=NO_UNPAD)
    step(compiled, inputs)
    got, counts = _counted_step(compiled, inputs)
    assert counts == {"bounds": 1, "order": 1}
    _close(got, step(model, inputs))


@pytest.mark.parametrize("model_type", ["lengths", "mask"])
def test_cuda_graphs_replay_with_new_lengths(model_type):
    """mode="reduce-overhead": the derived tensors are computed inside the captured graph from the replayed
    inputs (nothing is cached across steps), so every replay with new lengths / masks is exact."""
    torch.manual_seed(0)
    model = (LengthSites() if model_type == "lengths" else MaskSites()).to(DEV)
    compiled = gem_compile(model, config=NO_UNPAD, mode="reduce-overhead")
    g = torch.Generator().manual_seed(1)
    for seed in range(6):
        if model_type == "lengths":
            lengths = torch.randint(0, L + 1, (3,), generator=g).tolist()
            lengths2 = torch.randint(0, L2 + 1, (3,), generator=g).tolist()
            inputs = length_inputs(seed, DEV, lengths, lengths2)
        else:
            inputs = mask_inputs(seed, DEV)
        _close(step(compiled, inputs), step(model, inputs))


def test_gem_ref_step_orders_once_per_sequence_type():
    """GEM-ref tiny (jagged PMA, GDPA and block attention per layer and sequence type): one order per
    sequence type's lengths per training step (it was one per attention call, forward and backward)."""
    config = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(config).to(DEV)
    data = SyntheticData(config.data_config(batch_size=32, fill=0.5))
    compiled = gem_compile(model)
    for i in range(3):
        batch = data.batch(i).to(DEV)
        torch.cuda.synchronize()
        lo.reset_counts()
        out = compiled(**batch.features())
        masked_bce_loss(out, batch.labels, batch.label_mask).backward()
        torch.cuda.synchronize()
        if i > 0:
            assert dict(lo.COUNTS) == {"order": config.n_seq}, dict(lo.COUNTS)
        ref = model(**batch.features())
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-4)


def test_eager_fast_path_derives_once_per_call():
    """A plain eager CUDA call derives its orders in the forward and the backward reuses them; given ones
    are used as they are."""
    from gemcompile.lowering.gdpa.op import gdpa
    from gemcompile.lowering.jagged_attention.op import jagged_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 64, 32, generator=g).to(DEV).requires_grad_() for _ in range(3))
    ql, kl = torch.tensor([64, 3, 0, 40], device=DEV), torch.tensor([10, 64, 5, 0], device=DEV)
    for call, derived in ((lambda **p: jagged_attention(q, k, v, ql, kl, **p), 2),
                          (lambda **p: gdpa(q, k, v, ql, None, **p), 1)):
        lo.reset_counts()
        out = call()
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        torch.cuda.synchronize()
        assert lo.COUNTS["order"] == derived
        plan = {"q_order": torch.sort(ql, descending=True, stable=True).indices}
        if derived == 2:
            plan["kv_order"] = torch.sort(kl, descending=True, stable=True).indices
        lo.reset_counts()
        out2 = call(**plan)
        grads2 = torch.autograd.grad(out2.square().sum(), (q, k, v))
        torch.cuda.synchronize()
        assert lo.COUNTS["order"] == 0
        for a, b in zip((out, *grads), (out2, *grads2)):
            assert torch.equal(a, b)
