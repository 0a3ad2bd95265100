"""Dropout on the attention probabilities of ``gemcompile::block_attention``: the reference equals eager
``dropout(softmax(s)) @ v`` under the kernels' keep mask (float64, gradcheck), and the general Triton kernels
(interpreter) equal the reference for one seed with blocks, windows, causal, rotary, a key mask, query
lengths and the packed layout; a shape the closed-form kernels serve runs the general ones with dropout."""

import os

import pytest
import torch

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.block_attention.op import block_attention
from gemcompile.lowering.block_attention.reference import allowed_pattern, reference_backward, reference_forward
from gemcompile.lowering.common.dropout import keep_mask, keep_scale
from gemcompile.lowering.common.packed import pack_padded

INTERPRETER = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
SEED = torch.tensor(2**35 + 17)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_reference_equals_eager_dropout_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    B, H, L, D = 2, 2, 12, 16
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([12, 7])
    out = block_attention(q, k, v, lengths, block=4, window=2, causal=True, dropout_p=0.3, dropout_seed=SEED)
    ok = allowed_pattern(L, 4, 2, True, "cpu") & (torch.arange(L) < lengths[:, None, None, None])
    weights = torch.softmax((q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~ok, float("-inf")), -1)
    ref = (weights.nan_to_num(0.0) * keep_mask(SEED, 0.3, B, H, L, L, "cpu") * keep_scale(0.3)) @ v
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    # fast_mode: the Jacobian checked along random directions (2 evaluations, not 2 per input element: the
    # full check took ~50 s of CI's CPU for 1152 inputs); a wrong gradient still fails it
    assert torch.autograd.gradcheck(
        lambda q, k, v: block_attention(q, k, v, lengths, block=4, causal=True, dropout_p=0.3, dropout_seed=SEED),
        (q, k, v), fast_mode=True)


CASES = {
    "block_causal": dict(block=8, window=-1, causal=True),
    "window": dict(block=0, window=5, causal=False),
    "block_window_rotary": dict(block=16, window=6, causal=False, rotary="half"),
    "kv_mask": dict(block=8, window=-1, causal=False, kv_mask=True),
    "q_lengths": dict(block=8, window=-1, causal=True, q_lengths=True),
    "packed": dict(block=8, window=-1, causal=True, packed=True),
    "closed_shape": dict(block=64, window=-1, causal=False),  # a closed-form shape: the general kernels run
}


def block_case(name: str, L: int, D: int, g: torch.Generator):
    """(q, k, v, the launchers' positional arguments after v, their keywords) of CASES[name] (CPU, fp32)."""
    case = dict(CASES[name])
    B, H = 3, 2
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    lengths = torch.tensor([L, 0, L // 2 + 1])
    rotary = case.pop("rotary", "none")
    cos = sin = None
    if rotary != "none":
        theta = torch.rand(L, D, generator=g) * 6.3
        cos, sin = theta.cos(), theta.sin()
    kw = {}
    if case.pop("kv_mask", False):
        kw["kv_mask"] = torch.rand(B, L, generator=g) > 0.3
    if case.pop("q_lengths", False):
        kw["q_lengths"] = torch.tensor([L // 2, 0, 3])
    if case.pop("packed", False):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        q, k, v = (pack_padded(t, offsets, int(offsets[-1])) for t in (q, k, v))
        kw.update(token_offsets=offsets, max_len=L)
    return q, k, v, (lengths, case["block"], case["window"], case["causal"], cos, sin, rotary, 0.3), kw


@pytest.mark.skipif(not INTERPRETER, reason="Triton interpreter on a machine without CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_general_kernels_equal_the_reference_for_one_seed(name):
    from gemcompile.lowering.block_attention import triton as kernels

    g = torch.Generator().manual_seed(1)
    q, k, v, args, kw = block_case(name, 64 if name == "closed_shape" else 24, 16, g)
    drop = dict(dropout_p=0.4, dropout_seed=SEED)
    out, lse = kernels.block_attention_forward_triton(q, k, v, *args, **kw, **drop)
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), *args, **kw, **drop)
    assert _rel(out, ref_out) < 2e-5
    grad = torch.randn(out.shape, generator=g)
    got = kernels.block_attention_backward_triton(grad, q, k, v, out, lse, *args, **kw, **drop)
    want = reference_backward(grad.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, *args, **kw,
                              **drop)
    for a, b in zip(got, want):
        assert _rel(a, b) < 5e-5
