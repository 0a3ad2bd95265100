"""Per-token losses on the labels' rows and dropout on packed rows, through gem_compile on CUDA (Inductor and
the kernels) against eager: the CPU tests (tests/integration/test_unpad_losses.py, test_unpad_token_wise_ops.py)
run the same rewrites under aot_eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_unpad_losses_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import GemConfig, explain, gem_compile
from tests.compiled_vs_eager import assert_compiled_matches_eager
from tests.integration.test_unpad_losses import LOSSES, ItemHead, MaskedItemModel, _inputs
from tests.integration.test_unpad_token_wise_ops import _check_dropout_on_packed_rows

DEV = "cuda"


@pytest.mark.parametrize("buckets", [0, 3])
@pytest.mark.parametrize("name", ["module", "none_over_the_count", "nll_of_log_softmax", "class_weights",
                                  "logits_permuted_none"])
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
    assert_compiled_matches_eager(model, ids, labels, atol=1e-4, config=config)


def test_a_masked_item_model_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MaskedItemModel().to(DEV)
    assert_compiled_matches_eager(model, *(t.to(DEV) for t in _inputs(0)), atol=1e-4)


def test_dropout_on_packed_rows_keeps_or_drops_each_element():
    torch._dynamo.reset()
    _check_dropout_on_packed_rows(True, compile_fn=gem_compile, device=DEV, atol=1e-4)
