"""Lengths handed to the attention ops as views (a column of a (B, k) metadata tensor, a [::2] slice, an
expanded (1,) tensor): the Triton kernels read lengths, num_targets and orders with unit stride, so such a
vector was read past what it holds (0.3-1.5 relative error; the CPU reference was right). The launchers
take contiguous copies (opkit.contiguous_vectors; key_bounds_and_span its own): strided == contiguous,
forward and backward, through the Triton launchers under the interpreter."""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.block_attention import op as block_op  # noqa: E402
from gemcompile.lowering.common.length_order_triton import key_bounds_and_span, longest_first_order  # noqa: E402
from gemcompile.lowering.gdpa import op as gdpa_op  # noqa: E402
from gemcompile.lowering.jagged_attention import op as jagged_op  # noqa: E402

B, H, L, D = 3, 2, 13, 16
LAYOUTS = {
    "column": lambda: torch.tensor([[13, 2], [5, 7], [1, 1]])[:, 0],
    "every_other": lambda: torch.tensor([13, 0, 5, 0, 1, 0])[::2],
    "expanded": lambda: torch.tensor([6]).expand(B),
}
OPS = {
    "jagged_kv_lengths": lambda q, k, v, n: torch.ops.gemcompile.jagged_attention(q, k, v, None, n, None, False, 0.25),
    "jagged_q_lengths": lambda q, k, v, n: torch.ops.gemcompile.jagged_attention(q, k, v, n, None, None, True, 0.25),
    "gdpa": lambda q, k, v, n: torch.ops.gemcompile.gdpa(q, k, v, None, n, None, "silu", 0.25, 1.0, False, False, 0),
    "block": lambda q, k, v, n: torch.ops.gemcompile.block_attention(q, k, v, n, 4, -1, False, None, None, "none",
                                                                     0.25),
}


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    for module in (jagged_op, gdpa_op, block_op):
        monkeypatch.setattr(module, "use_triton", lambda q: q.dtype != torch.float64)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS))
def test_a_strided_lengths_view_gives_what_its_values_give(op, layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    strided = LAYOUTS[layout]()
    assert not strided.is_contiguous()
    out, ref = OPS[op](q, k, v, strided), OPS[op](q, k, v, strided.contiguous())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    weights = torch.randn(ref.shape, generator=g)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                         torch.autograd.grad((ref * weights).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_key_bounds_and_order_of_a_strided_vector(layout):
    strided = LAYOUTS[layout]()
    mask = torch.arange(L)[None, :] < torch.tensor([9, 13, 2])[:, None]
    for got, want in zip(key_bounds_and_span(mask, strided), key_bounds_and_span(mask, strided.contiguous())):
        assert torch.equal(got, want)
    assert torch.equal(longest_first_order(strided), longest_first_order(strided.contiguous()))
