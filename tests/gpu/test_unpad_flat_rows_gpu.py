"""DIN-style pooling whose token MLP is written on flattened rows (FuxiCTR) or whose scores are transposed to
(B, 1, N) before their fill (DeepCTR-Torch), through gem_compile on CUDA (Inductor and the kernels) against
eager: the CPU tests (tests/integration/test_unpad_flat_rows.py, test_unpad_zeroings.py) run the same rewrites
under aot_eager.

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
