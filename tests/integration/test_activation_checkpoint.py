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
