"""Masks built under torch.vmap (passes/masks/vmap.py), as Hugging Face's masking utilities build them for
GPT-2, Llama, Qwen2 and Mistral: a mask function of scalar (batch, head, query, key) indices, vmapped once
per dim, reading the padding mask at [batch, key]. The lowering to broadcast ops must give the same tensor
(checked on masks returned as they are, over in_dims / out_dims / levels), the attention over it is
rewritten, compiled == eager, and a region holding an op the lowering does not model is left as written."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemcompile import explain, gem_compile
from gemcompile.passes.masks.vmap import lower_vmapped_masks

B, H, L, D = 4, 2, 12, 16


def vmap_over_bhqk(fn):
    """One vmap per index, the key innermost (the order transformers' _vmap_for_bhqkv nests them)."""
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return fn


def padding_and_causal(pm, causal=True, window=0, getitem=False):
    def keep(b, h, q, kv):
        ok = q.new_ones((), dtype=torch.bool)
        if causal:
            ok = ok & (kv <= q)
        if window:
            ok = ok & (kv > q - window)
        if getitem == "eq":  # a comparison spelled as its method (transformers' function mode records that)
            return ok & pm.long()[b, kv].__eq__(1)
        if getitem == "lengths":  # the lengths read by one index tensor, n[b] (a tuple before)
            return ok & (kv < pm.sum(-1)[b])
        return ok & (pm[b, kv] if getitem else torch.ops.aten.index(pm, [b, kv]))

    return keep


class HfStyleAttention(torch.nn.Module):
    def __init__(self, causal=True, fill=None, window=0, getitem=False):
        super().__init__()
        self.causal, self.fill, self.window, self.getitem = causal, fill, window, getitem

    def forward(self, q, k, v, attention_mask):
        device = q.device
        kv_arange = torch.arange(L, device=device)
        kv_arange += 0  # transformers adds the cache offset in place
        fn = vmap_over_bhqk(padding_and_causal(attention_mask.bool(), self.causal, self.window, self.getitem))
        mask = fn(torch.arange(q.shape[0], device=device), torch.arange(1, device=device),
                  torch.arange(L, device=device), kv_arange)
        if self.fill is not None:  # the eager path: a float mask of 0 and finfo.min
            mask = torch.where(mask, torch.tensor(0.0, device=device), self.fill)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inputs(seed=0, left=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([L, 1, 5, 9])
    positions = torch.arange(L)[None, :]
    mask = (positions >= L - lengths[:, None]) if left else (positions < lengths[:, None])
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    return q, k, v, mask.long()


@pytest.mark.parametrize("causal, fill, window, getitem", [
    (True, None, 0, False), (False, None, 0, False), (True, torch.finfo(torch.float32).min, 0, False),
    (True, None, 4, False), (True, None, 0, True), (True, None, 0, "eq"), (True, None, 0, "lengths")])
def test_hf_style_vmapped_mask_is_rewritten_and_equals_eager(causal, fill, window, getitem):
    model = HfStyleAttention(causal, fill, window, getitem)
    q, k, v, mask = _inputs()
    report = explain(model, q, k, v, mask)
    served = report.counts["jagged_attention"] + report.counts["block_attention"]
    assert served == 1, [r.reason for r in report.refusals]
    assert not any("_batch_dim" in r.reason for r in report.refusals)
    out, ref = gem_compile(model)(q, k, v, mask), model(q, k, v, mask)
    valid = mask.bool()[:, None, :, None]  # rows with a valid key: every valid query row (right padding)
    torch.testing.assert_close(out * valid, ref * valid, atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad((out * valid).square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * valid).square().sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def test_left_padded_causal_batch_compiles_once_over_changing_masks():
    model = HfStyleAttention(causal=True)
    counters.clear()
    compiled = gem_compile(model)
    for seed in range(4):
        q, k, v, mask = _inputs(seed, left=True)
        lengths = torch.randint(1, L + 1, (B,), generator=torch.Generator().manual_seed(seed))
        mask = (torch.arange(L)[None, :] >= L - lengths[:, None]).long()
        out, ref = compiled(q, k, v, mask), model(q, k, v, mask)
        keep = (mask.bool()[:, None, :, None]).expand_as(out)  # left padding: a valid row sees its own key
        torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)
    assert counters["gemcompile"]["jagged_attention"] == 1
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("in_dim, out_dim", [(0, 0), (1, 0), (0, 1), (1, 1), (-1, -1)])
def test_a_vmapped_mask_returned_as_it_is_equals_eager(in_dim, out_dim):
    """The lowering alone: whatever the in_dims and out_dims, the tensor that leaves vmap is vmap's. Each
    mapped element is a pair of indices (logical rank 1), so the dims' positions matter."""
    def build(pm, rows, cols):
        def keep(r, c):  # r, c: (2,) each
            return ((c <= r) | ((r - c) % 3 == 0)) & torch.ops.aten.index(pm, [r, c])

        inner = torch.vmap(keep, in_dims=(None, in_dim), out_dims=out_dim)
        return torch.vmap(inner, in_dims=(in_dim, None), out_dims=out_dim)(rows, cols)

    g = torch.Generator().manual_seed(1)
    pm = torch.rand(6, 5, generator=g) > 0.3
    rows, cols = torch.randint(0, 6, (4, 2), generator=g), torch.randint(0, 5, (3, 2), generator=g)
    if in_dim in (1, -1):
        rows, cols = rows.T.contiguous(), cols.T.contiguous()
    ref = build(pm, rows, cols)
    after = explain(build, pm, rows, cols).graph_after
    assert not [n for n in after.graph.nodes if "batch_dim" in str(n.target)], after.code  # lowered
    out = gem_compile(build)(pm, rows, cols)
    assert out.shape == ref.shape and torch.equal(out, ref)


def test_a_region_with_an_op_the_lowering_does_not_model_is_left_as_written():
    class Model(torch.nn.Module):
        def forward(self, q, k, v, attention_mask):
            pm = attention_mask.bool()
            fn = vmap_over_bhqk(lambda b, h, i, j: (torch.sin(j.float()) < 2.0) & torch.ops.aten.index(pm, [b, j]))
            mask = fn(torch.arange(B), torch.arange(1), torch.arange(L), torch.arange(L))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    model = Model()
    q, k, v, mask = _inputs()
    report = explain(model, q, k, v, mask)
    assert report.counts["jagged_attention"] == 0
    (refusal,) = [r for r in report.refusals if r.pass_name == "jagged_attention"]
    assert "_remove_batch_dim" in refusal.reason
    valid = mask.bool()[:, None, :, None]
    torch.testing.assert_close(gem_compile(model)(q, k, v, mask) * valid, model(q, k, v, mask) * valid)


def test_a_graph_without_vmap_is_untouched():
    graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
    before = [n.format_node() for n in graph.nodes]
    assert lower_vmapped_masks(graph) == 0
    assert [n.format_node() for n in graph.nodes] == before
