"""DIN-style pooling whose token MLP is written on flattened rows (FuxiCTR) or whose scores are transposed to
(B, 1, N) before their fill (DeepCTR-Torch), flattened rows zeroed by a flattened mask, and a kernel-1 Conv1d
FFN over tokens transposed to (B, F, N) (SASRec), through gem_compile on CUDA (Inductor and the kernels)
against eager: the CPU tests (tests/integration/test_unpad_flat_rows.py, test_unpad_zeroings.py,
test_unpad_transposed_rows.py) run the same rewrites under aot_eager.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_unpad_flat_rows_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gemcompile import explain
from tests.compiled_vs_eager import assert_compiled_matches_eager
from tests.integration import test_unpad_flat_rows as flat
from tests.integration import test_unpad_transposed_rows as transposed
from tests.integration import test_unpad_zeroings as zeroings

DEV = "cuda"


def _unpad_gemms(model, *inputs) -> list[int]:
    return [r.metrics["gemms"] for r in explain(model, *inputs).rewrites if r.pass_name == "unpad"]


@pytest.mark.parametrize("use_softmax, gemms", [(False, [3]), (True, [2])])
def test_fuxictr_din_attention_matches_eager(use_softmax, gemms):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = flat.FuxiDinAttention(use_softmax=use_softmax).to(DEV)
    inputs = [t.to(DEV) for t in flat._inputs()]
    assert _unpad_gemms(model, *inputs) == gemms
    assert_compiled_matches_eager(model, *inputs, atol=1e-4)


@pytest.mark.parametrize("name", ["view_minus_one", "flatten_first_two"])
def test_a_flattened_ffn_matches_eager(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = flat.FlatFfn(flat.FLATTENS[name]).to(DEV)
    assert_compiled_matches_eager(model, *(t.to(DEV) for t in flat._inputs()), atol=1e-4)


@pytest.mark.parametrize("name", list(zeroings.TRANSPOSED_FILLS))
@pytest.mark.parametrize("projected", [False, True])
def test_transposed_scores_filled_then_pooled_match_eager(name, projected):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zeroings.TransposedScorePooling(zeroings.TRANSPOSED_FILLS[name], projected=projected).to(DEV)
    assert_compiled_matches_eager(model, *(t.to(DEV) for t in zeroings._inputs()), atol=1e-4)


@pytest.mark.parametrize("name", list(flat.FLAT_ZEROINGS))
def test_flattened_rows_zeroed_by_a_flattened_mask_match_eager(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = flat.FlatFfn(flat.FLATTENS["view_minus_one"], back=False, zeroing=flat.FLAT_ZEROINGS[name]).to(DEV)
    inputs = [t.to(DEV) for t in flat._inputs()]
    assert _unpad_gemms(model, *inputs) == [2]
    assert_compiled_matches_eager(model, *inputs, atol=1e-4)


@pytest.mark.parametrize("kernel, gemms", [(1, [2]), (3, [])])
def test_a_conv_ffn_over_transposed_tokens_matches_eager(kernel, gemms):
    torch._dynamo.reset()
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model = transposed.ConvFfnEncoder(kernel=kernel).to(DEV)
    ids = transposed._ids().to(DEV)
    assert _unpad_gemms(model, ids) == gemms
    assert_compiled_matches_eager(model, ids, atol=1e-4)
