"""Per-token losses on the labels' rows and dropout on packed rows, through gem_compile on CUDA (Inductor and
the kernels) against eager: the CPU tests (tests/integration/test_unpad_losses.py, test_unpad_token_wise_ops.py)
run the same rewrites under aot_eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_unpad_losses_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, explain, gem_compile
from tests.integration.test_unpad_losses import LOSSES, ItemHead, MaskedItemModel, _inputs
from tests.integration.test_unpad_token_wise_ops import DropoutFfn, _ids_and_lengths, _seeded

DEV = "cuda"


def _matches_eager(model, *inputs, config=GemConfig()):
    params = list(model.parameters())
    out, ref = gem_compile(model, config=config)(*inputs), model(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    for g, r in zip(torch.autograd.grad(out, params, materialize_grads=True, allow_unused=True),
                    torch.autograd.grad(ref, params, materialize_grads=True, allow_unused=True), strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("buckets", [0, 3])
@pytest.mark.parametrize("name", ["module", "none_over_the_count", "nll_of_log_softmax", "class_weights"])
def test_a_loss_on_the_labels_rows_matches_eager(name, buckets):
    torch._dynamo.reset()
    loss, ignore = LOSSES[name]
    torch.manual_seed(0)
    model = ItemHead(loss).to(DEV)
    ids, labels = (t.to(DEV) for t in _inputs(ignore))
    config = GemConfig(unpad={"token_buckets": buckets})
    reads = [r.metrics["packed_row_reads"] for r in explain(model, ids, labels, config=config).rewrites
             if r.pass_name == "unpad"]
    assert reads == [{"per-token loss": 1}], reads
    _matches_eager(model, ids, labels, config=config)


def test_a_masked_item_model_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MaskedItemModel().to(DEV)
    _matches_eager(model, *(t.to(DEV) for t in _inputs(0)))


def test_dropout_on_packed_rows_keeps_or_drops_each_element():
    torch._dynamo.reset()
    p = 0.5
    model = _seeded(DropoutFfn, p, True, True).to(DEV).train()
    ids, lengths = (t.to(DEV) for t in _ids_and_lengths())
    out, f = gem_compile(model)(ids, lengths)
    valid = (torch.arange(ids.shape[1], device=DEV)[None, :] < lengths[:, None])[..., None]
    x = model.emb(ids) * valid
    close = lambda a, b: (a - b).abs() <= 1e-4 + 1e-4 * b.abs()  # noqa: E731
    kept, dropped = close(out, x + f / (1 - p)), close(out, x)
    assert bool((kept | dropped).all()), "dropout's output is neither 0 nor the scaled input"
    kept &= ~dropped | (f == 0)
    assert 0.3 < kept[valid.expand_as(kept)].float().mean().item() < 0.7
    keep = kept.float() / (1 - p)
    e = model.emb(ids)
    ref = (model.fc2(F.gelu(model.fc1(e))) * keep + e) * valid
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
