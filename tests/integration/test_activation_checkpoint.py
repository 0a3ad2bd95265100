"""gem_compile and torch.utils.checkpoint: a compiled block called inside a checkpoint compiles on its first
call under the checkpoint's saved-tensor hooks; the rewrite's own fake evaluations must not save tensors
there (the recomputation would then count fewer and the backward stop with CheckpointError)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gemcompile import gem_compile

B, L, D, H = 4, 16, 32, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        pos = torch.arange(L)
        mask = (pos[None, :] < lengths[:, None])[:, None, None, :] & (pos[None, :] <= pos[:, None])
        return x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, L, D))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_compiled_block_inside_a_checkpoint_trains_as_eager(reentrant):
    torch.manual_seed(0)
    torch._dynamo.reset()
    block = Block()
    x = torch.randn(B, L, D, requires_grad=True)
    lengths = torch.tensor([16, 1, 7, 11])
    rows = (torch.arange(L)[None, :] < lengths[:, None])[..., None]
    (block(x, lengths) * rows).square().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = gem_compile(block)
    out = torch.utils.checkpoint.checkpoint(compiled, x * 1.0, lengths, use_reentrant=reentrant)
    (out * rows).square().sum().backward()
    for got, want in zip((p.grad for p in block.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class Model(nn.Module):
    """Blocks under torch.utils.checkpoint inside the compiled model (HF's gradient_checkpointing layout)."""

    def __init__(self, mask_outside: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.mask_outside = mask_outside

    def forward(self, x, lengths):
        for block in self.blocks:
            if self.mask_outside:  # the mask reaches the checkpointed region as an input (HF's layout)
                x = torch.utils.checkpoint.checkpoint(_block_with_mask, block, x, _mask(lengths), use_reentrant=False)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, lengths, use_reentrant=False)
        return x


def _mask(lengths):
    pos = torch.arange(L)
    return (pos[None, :] < lengths[:, None])[:, None, None, :] & (pos[None, :] <= pos[:, None])


def _block_with_mask(block, x, mask):
    q, k, v = block.qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
    return x + block.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, L, D))


@pytest.mark.parametrize("mask_outside", [False, True])
def test_attention_inside_checkpointed_regions_of_the_compiled_model(mask_outside):
    from torch._dynamo.utils import counters

    from gemcompile import explain

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model = Model(mask_outside)
    x = torch.randn(B, L, D, requires_grad=True)
    lengths = torch.tensor([16, 1, 7, 0])
    rows = (torch.arange(L)[None, :] < lengths[:, None])[..., None]
    (model(x, lengths) * rows).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = gem_compile(model)(x, lengths)
    (out * rows).square().sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    compiled_rewrites = counters["gemcompile"]["jagged_attention"]
    report = explain(model, x, lengths)
    # built outside, the mask's ops are copied into each region (from the lengths, an extra operand)
    assert report.counts.get("jagged_attention", 0) == 2
    assert compiled_rewrites == 2


def test_torch_func_grad_inside_the_compiled_function():
    # functorch transforms traced into the graph: the kernels' autograd does not run under them, so refused
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    torch._dynamo.reset()
    block = Block()
    params = {name: p.detach() for name, p in block.named_parameters()}
    x, lengths = torch.randn(B, L, D), torch.tensor([16, 1, 7, 11])
    rows = (torch.arange(L)[None] < lengths[:, None])[..., None]

    def grads(p, x, lengths):
        return grad(lambda p: (functional_call(block, p, (x, lengths)) * rows).square().sum())(p)

    want = grads(params, x, lengths)
    got = gem_compile(grads)(params, x, lengths)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)


def test_a_mask_computed_from_activations_outside_a_region_stays_an_input():
    # a mask that depends on an activation is not copied in (not a function of the batch's metadata alone)
    class FromActivations(Model):
        def forward(self, x, lengths):
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(_block_with_mask, block, x, _mask(lengths) & (x[:, None, None, :, 0] > -9),
                                                      use_reentrant=False)
            return x

    from gemcompile import explain

    torch._dynamo.reset()
    model = FromActivations(mask_outside=True)
    x, lengths = torch.randn(B, L, D, requires_grad=True), torch.tensor([16, 1, 7, 0])
    report = explain(model, x, lengths)
    assert report.counts.get("jagged_attention", 0) == 0
    attention = [r for r in report.refusals if r.pass_name != "unpad"]  # (unpad: it does not run in regions)
    assert attention and all("torch.utils.checkpoint region" in r.reason for r in attention)
    torch.testing.assert_close(gem_compile(model)(x, lengths), model(x, lengths), atol=1e-5, rtol=1e-4)
