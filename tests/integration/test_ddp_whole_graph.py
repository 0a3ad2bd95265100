"""gem_compile under DistributedDataParallel: Dynamo's DDP optimizer would cut the graph at each gradient
bucket, handing a mask built before the cut to the attention after it as an input (unprovable). gem_compile
compiles the whole graph; DDP still all-reduces the gradients."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from gemcompile import gem_compile

B, L, E, H = 3, 10, 32, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x, mask):
        q, k, v = (t.view(B, L, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(o.transpose(1, 2).reshape(B, L, E))


class Model(nn.Module):
    """SASRec's layout: the mask is built once at the top and handed to every block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, E)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids, lengths):
        pos = torch.arange(L)
        mask = (pos[None, :] < lengths[:, None])[:, None, None, :] & (pos[None, :] <= pos[:, None])
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap", ["compile_ddp", "ddp_of_compiled"])
def test_attention_is_rewritten_under_ddp_with_small_buckets(one_rank_group, wrap):
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model = Model()
    ids, lengths = torch.randint(1, 50, (B, L)), torch.tensor([L, 4, 0])
    ref = model(ids, lengths)
    tiny = 0.004  # MB: a bucket per layer or so, as a real model's 25 MB buckets split a real graph
    ddp = gem_compile(DDP(model, bucket_cap_mb=tiny)) if wrap == "compile_ddp" else DDP(gem_compile(model), bucket_cap_mb=tiny)
    out = ddp(ids, lengths)
    rows = (torch.arange(L)[None, :] < lengths[:, None])[..., None]
    torch.testing.assert_close(out * rows, ref * rows)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert counters["gemcompile"]["jagged_attention"] == 2


def test_the_string_backend_under_ddp_says_the_graph_is_split(one_rank_group, monkeypatch):
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2000)  # DDP's optimizer wants it <= the others
    torch._dynamo.reset()
    model = DDP(Model(), bucket_cap_mb=0.004)
    ids, lengths = torch.randint(1, 50, (B, L)), torch.tensor([L, 4, 0])
    with pytest.warns(UserWarning, match="splits this DistributedDataParallel model"):
        torch.compile(model, backend="gemcompile")(ids, lengths)
