"""The gdpa_relative_table pass: GDPA over a relative_bias gather reads the table in place, with eager's
outputs and gradients (the table's included); biases that are not plain views of the gather keep the dense
path, with a reason."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile

B, H, L, D = 4, 2, 12, 16


def valid(lengths):
    return torch.arange(L)[None, :] < lengths[:, None]


def causal_silu(q, k, v, n, rab):
    i = torch.arange(L)
    a = F.silu(q @ k.transpose(-2, -1) * 0.25 + rab) / L
    m = valid(n)[:, None, None, :] & valid(n)[:, None, :, None] & (i[None, :] <= i[:, None])
    return (a * m) @ v


def relative(L_, offset):
    i = torch.arange(L_)
    return i[None, :] - i[:, None] + offset


def shared_table(q, k, v, n, x):  # HSTU: one (2L - 1) table, (L, L) bias broadcast over batch and heads
    return causal_silu(q, k, v, n, x["table"][relative(L, L - 1)])


def per_head_table(q, k, v, n, x):  # T5 style: (2L - 1, H) -> (H, L, L)
    return causal_silu(q, k, v, n, x["heads"][relative(L, L - 1)].permute(2, 0, 1))


def per_head_long_table_indexed(q, k, v, n, x):  # a table longer than the span, offset not centered
    return causal_silu(q, k, v, n, x["long"][relative(L, L + 2)].permute(2, 0, 1)[None, :, :, :])


def one_head_table(q, k, v, n, x):  # (T, 1): shared by the heads through a size-1 dim
    return causal_silu(q, k, v, n, x["one"][relative(L, L - 1)].permute(2, 0, 1).unsqueeze(0))


def miss_scaled(q, k, v, n, x):  # 0.5 * rab: not a view of the gather
    return causal_silu(q, k, v, n, 0.5 * x["table"][relative(L, L - 1)])


def miss_mirrored(q, k, v, n, x):  # rab^T reads i - j: a transpose the pass does not follow
    return causal_silu(q, k, v, n, x["table"][relative(L, L - 1)].transpose(0, 1))


def miss_summed(q, k, v, n, x):  # two biases added: the sum is dense
    return causal_silu(q, k, v, n, x["table"][relative(L, L - 1)] + x["dense"])


MODELS = {f.__name__: f for f in (shared_table, per_head_table, per_head_long_table_indexed, one_head_table)}
MISSES = {
    "miss_scaled": (miss_scaled, "mul"),
    "miss_mirrored": (miss_mirrored, "transpose"),
    "miss_summed": (miss_summed, "add"),
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    x = {
        "table": torch.randn(2 * L - 1, generator=g, requires_grad=True),
        "heads": torch.randn(2 * L - 1, H, generator=g, requires_grad=True),
        "long": torch.randn(2 * L + 5, H, generator=g, requires_grad=True),
        "one": torch.randn(2 * L - 1, 1, generator=g, requires_grad=True),
        "dense": torch.randn(L, L, generator=g, requires_grad=True),
    }
    return q, k, v, torch.tensor([L, 5, 1, 0]), x


def _check_against_eager(fn):
    q, k, v, n, x = _inputs()
    counters.clear()
    out = gem_compile(fn, fullgraph=True)(q, k, v, n, x)
    ref = fn(q, k, v, n, x)
    rows = valid(n)[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(torch.where(rows, out, 0), torch.where(rows, ref, 0), atol=2e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    leaves = [q, k, v, *x.values()]
    got = torch.autograd.grad((torch.where(rows, out, 0) * w).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((torch.where(rows, ref, 0) * w).sum(), leaves, allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    return dict(counters["gemcompile"])


@pytest.mark.parametrize("name", list(MODELS))
def test_table_read_in_place_with_eager_values_and_gradients(name):
    q, k, v, n, x = _inputs()
    report = explain(MODELS[name], q, k, v, n, x)
    assert report.counts["gdpa"] == 1 and report.counts["gdpa_relative_table"] == 1, report.refusals
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "gdpa_relative_table"]
    assert "in place" in rewrite.detail
    counts = _check_against_eager(MODELS[name])
    assert counts["gdpa_relative_table"] == 1


@pytest.mark.parametrize("name", list(MISSES))
def test_near_misses_keep_the_dense_bias_with_a_reason(name):
    fn, why = MISSES[name]
    q, k, v, n, x = _inputs()
    report = explain(fn, q, k, v, n, x)
    assert report.counts["gdpa"] == 1
    assert report.counts.get("gdpa_relative_table", 0) == 0
    (refusal,) = [r for r in report.refusals if r.pass_name == "gdpa_relative_table"]
    assert why in refusal.reason, refusal.reason
    assert _check_against_eager(fn).get("gdpa_relative_table", 0) == 0


def test_no_candidate_without_a_relative_bias():
    def clamped(q, k, v, n, x):  # bucketed positions: the relative_bias pass refuses, so no candidate here
        i = torch.arange(L)
        return causal_silu(q, k, v, n, x["table"][(i[None, :] - i[:, None]).clamp(0, L - 1)])

    report = explain(clamped, *_inputs())
    assert report.counts["gdpa"] == 1
    assert not [r for r in report.refusals if r.pass_name == "gdpa_relative_table"]


def test_config_switch_keeps_the_dense_bias():
    q, k, v, n, x = _inputs()
    report = explain(shared_table, q, k, v, n, x, config=GemConfig(gdpa={"read_relative_table": False}))
    assert report.counts["gdpa"] == 1 and report.counts.get("gdpa_relative_table", 0) == 0
