"""The unpad pass on CUDA: packed regions compiled by Inductor (dynamic token count) against eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_unpad_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import gem_compile
from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss

DEV = "cuda"


class MaskedFfn(nn.Module):
    def __init__(self, d_in=64, d=256):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x, lengths):
        valid = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None])[..., None]
        h = self.inp(x) * valid
        h = h + self.down(F.gelu(self.up(self.norm(h)))) * valid
        return h.sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_ffn_matches_eager_without_recompiles(dtype):
    torch.manual_seed(0)
    model = MaskedFfn().to(DEV, dtype)
    counters.clear()
    compiled = gem_compile(model)
    B, N = 16, 200
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    for lengths in ([200] * 16, [0] * 16, list(range(0, 200, 13))[:16], [1, 199] * 8):
        x = torch.randn(B, N, 64, device=DEV, dtype=dtype)
        t = torch.tensor(lengths, device=DEV)
        out = compiled(x, t)
        grads = torch.autograd.grad(out.float().square().sum(), list(model.parameters()))
        ref = model(x, t)
        ref_grads = torch.autograd.grad(ref.float().square().sum(), list(model.parameters()))
        torch.testing.assert_close(out, ref, **tol)
        for g, r in zip(grads, ref_grads):
            # weight grads sum thousands of rows: in bf16 single elements cancel to ~0 in a different
            # order than eager's, so compare the whole tensor's relative error
            error = (g.double() - r.double()).norm() / r.double().norm().clamp(min=1e-12)
            assert error < (2e-4 if dtype == torch.float32 else 2e-2), error
    assert counters["gemcompile"]["unpad"] == 1
    assert counters["stats"]["unique_graphs"] == 1


def test_gem_ref_tiny_matches_eager_on_cuda():
    config = gem_ref_config("tiny")
    torch.manual_seed(0)
    model = GemRef(config).to(DEV)
    data = SyntheticData(config.data_config(batch_size=64, length_dist="heavy_tail", fill=0.3))
    counters.clear()
    compiled = gem_compile(model)
    for step in range(4):
        batch = data.batch(step)
        features = {k: [t.to(DEV) for t in v] if isinstance(v, list) else v.to(DEV)
                    for k, v in batch.features().items()}
        labels, label_mask = batch.labels.to(DEV), batch.label_mask.to(DEV)
        out = compiled(**features)
        grads = torch.autograd.grad(masked_bce_loss(out, labels, label_mask), list(model.parameters()))
        ref = model(**features)
        ref_grads = torch.autograd.grad(masked_bce_loss(ref, labels, label_mask), list(model.parameters()))
        # the attention kernels' float32 dots may run in TF32: exactness itself is checked on CPU
        torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-2)
        for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
            torch.testing.assert_close(g, r, atol=5e-3, rtol=5e-2, msg=lambda m, name=name: f"{name}: {m}")
    assert counters["gemcompile"]["unpad"] == config.n_seq
    assert counters["stats"]["unique_graphs"] == 1
