"""Masks whose values torch computes in their dtype, not in exact arithmetic: each keeps only key 0 (or every
key) in eager, while the same formula over unbounded integers / reals would read as the lengths mask. The
rewrite must equal eager (masks/values.stored_as, masks/bitwise.py)."""

import pytest
import torch
import torch.nn.functional as F

from gemcompile import explain, gem_compile

B, H, L, D = 4, 2, 12, 16

SPELLINGS = {
    # fp32: 1 + 1e8 rounds to 1e8, so the mask is 0 everywhere
    "absorbed": lambda m: (m.float() + 1e8 - 1e8) != 0,
    "underflow": lambda m: (m.float() * 1e-46) != 0,  # 1e-46 is 0 in fp32
    "int32_wraps": lambda m: (m.int() * 2 ** 32).bool(),
    "uint8_wraps": lambda m: (m.to(torch.uint8) * 256).bool(),
    "cast_wraps": lambda m: torch.where(m, 256, 0).to(torch.uint8).bool(),
    # ~ on integers is bitwise: ~0 = 255 and ~1 = 254 in uint8, -1 and -2 in int64: every key kept
    "invert_uint8": lambda m: (~(~m).to(torch.uint8)).bool(),
    "bitwise_not_long": lambda m: torch.bitwise_not((~m).long()).bool(),
    "bitwise_and_long": lambda m: ((m.long() * 2) & m.long()).bool(),  # 2 & 1 = 0
    "bitwise_xor_uint8": lambda m: (m.to(torch.uint8) ^ 1).bool(),  # the padding, kept as an integer op
    # an integer where stores its values in its dtype (uint8: -1 is 255; int8: 200 is -56), and a 0-d tensor
    # compared with a uint8 one is cast to uint8 first (260 is 4): every key kept, or keys 0..3 only
    "where_uint8_wraps": lambda m: torch.where(m, torch.arange(L, dtype=torch.uint8), torch.tensor(-1)) < 100,
    "where_int8_wraps": lambda m: torch.where(m, torch.arange(L, dtype=torch.int8), torch.tensor(200)) >= 0,
    "compare_0d_uint8": lambda m: m & (torch.arange(L, dtype=torch.uint8) < torch.tensor(260)),
    # the same spellings where the values survive: still the lengths mask
    "exact_fp32": lambda m: (m.float() + 1e3 - 1e3) != 0,
    "invert_bool": lambda m: ~~m,
}


def _attention(spelling):
    def f(q, k, v, n):
        m = torch.arange(L)[None, :] < n[:, None]
        keep = SPELLINGS[spelling](m) | (torch.arange(L) == 0)  # key 0 always: no row without a key
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    return f


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_mask_values_are_read_in_their_dtype(spelling):
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = _attention(spelling)
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    n = torch.tensor([12, 7, 3, 0])
    ref = f(q, k, v, n)
    out = gem_compile(f)(q, k, v, n)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if spelling in ("exact_fp32", "invert_bool"):  # provably the lengths mask: rewritten
        assert explain(f, q, k, v, n).counts.get("jagged_attention", 0) == 1


def _fp16_softmax(fill):
    def f(q, k, v, n):
        s = q @ k.transpose(-1, -2)
        valid = torch.arange(L)[None, :] < n[:, None]
        s = s + (1 - valid.half())[:, None, None, :] * fill
        return torch.softmax(s, -1) @ v
    return f


def test_a_fill_that_overflows_in_its_dtype_is_inf():
    # (1 - m.half()) * -1e9 is -inf in fp16: eager SDPA gives the empty sequence zeros, a finite fill would have
    # given it the mean of v
    torch.manual_seed(0)
    torch._dynamo.reset()

    def f(q, k, v, n):
        valid = torch.arange(L)[None, :] < n[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=((1 - valid.half()) * -1e9)[:, None, None, :])

    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16) for _ in range(3))
    n = torch.tensor([12, 7, 3, 0])
    torch.testing.assert_close(gem_compile(f)(q, k, v, n), f(q, k, v, n), atol=2e-3, rtol=2e-3)
    assert explain(f, q, k, v, n).counts.get("jagged_attention", 0) == 1


def test_an_added_fill_on_a_coarse_grid_stops_on_an_empty_sequence():
    # fp16 s + (-1e4) rounds s to multiples of 8: eager's empty row is neither softmax(s) nor uniform here
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = _fp16_softmax(-1e4)
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16) for _ in range(3))  # |s| bound > 4: not rounded away
    compiled = gem_compile(f)
    full = torch.tensor([12, 7, 3, 1])
    torch.testing.assert_close(compiled(q, k, v, full), f(q, k, v, full), atol=2e-3, rtol=2e-3)
    with pytest.raises(RuntimeError, match="does not round to the fill"):
        compiled(q, k, v, torch.tensor([12, 7, 3, 0]))


def test_a_nan_fill_is_not_a_drop():
    # masked_fill(~m, nan): every row of a sequence with a padded key is NaN in eager; no kernel skips them to that
    torch.manual_seed(0)
    torch._dynamo.reset()

    def f(q, k, v, n):
        m = (torch.arange(L)[None, :] < n[:, None])[:, None, None, :]
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~m, float("nan")), -1) @ v

    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    n = torch.tensor([12, 7, 3, 0])
    assert explain(f, q, k, v, n).counts.get("jagged_attention", 0) == 0
    torch.testing.assert_close(gem_compile(f)(q, k, v, n), f(q, k, v, n), equal_nan=True)


def test_explain_reports_a_check_that_stops_the_example_run():
    torch.manual_seed(0)
    torch._dynamo.reset()
    f = _fp16_softmax(-1e4)
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16) for _ in range(3))
    report = explain(f, q, k, v, torch.tensor([12, 7, 3, 0]))
    assert report.stopped is not None and "does not round to the fill" in report.stopped
    assert "stopped at a check" in str(report)
