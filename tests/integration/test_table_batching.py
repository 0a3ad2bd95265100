"""passes/table_batching.py: sparsely trained embedding-bag tables looked up one by one become one
sparse_embedding_bags call per group of tables that can share it; lookups that cannot (another dim, mode,
padding id or ids width, offsets, ids computed from a member's output, a table trained densely) keep
their own. Trained through the rewritten graph, outputs, tables and Adagrad sums equal eager's bit for bit
(the CPU path is each table's own kernel)."""

import copy

import torch
from torch import nn
from torch._dynamo.utils import counters

from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad
from gemcompile.runtime.tables.sparse_tables import use_sparse_row_gradients
from tests.rewritten import rewritten

B, ROWS = 6, 40


class ManyTables(nn.Module):
    """Tables 0-2 and 3-4 can share a call each; 5-9 are near-misses; `dense` keeps a dense gradient."""

    def __init__(self):
        super().__init__()
        bag = lambda dim=8, mode="sum", padding_idx=0: nn.EmbeddingBag(ROWS, dim, mode=mode,  # noqa: E731
                                                                       padding_idx=padding_idx)
        self.tables = nn.ModuleList([bag(), bag(), bag(), bag(mode="mean"), bag(mode="mean"),
                                     bag(dim=16), bag(padding_idx=None), bag(), bag(), bag()])
        self.dense = nn.EmbeddingBag(ROWS, 8, mode="sum", max_norm=1.0)  # max_norm: not eligible, stays dense
        self.out = nn.Linear(8 * 9 + 16 + 8, 1)

    def forward(self, ids, narrow_ids, flat_ids, offsets):
        pooled = [table(ids[:, t]) for t, table in enumerate(self.tables[:7])]
        pooled.append(self.tables[7](narrow_ids))  # ids 2 wide, the others 4
        derived = (pooled[0].detach() > 0).long()[:, :4] * 3 + 1  # ids from table 0's output
        pooled.append(self.tables[8](derived))
        pooled.append(self.tables[9](flat_ids, offsets))  # 1-D ids with offsets
        pooled.append(self.dense(ids[:, 0]))
        return self.out(torch.cat(pooled, dim=-1)).squeeze(-1)


def _inputs(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, ROWS, (B, 7, 4), generator=g)
    ids[:, :, -1] = 0  # padding
    return (ids, torch.randint(0, ROWS, (B, 2), generator=g), torch.randint(0, ROWS, (15,), generator=g),
            torch.tensor([0, 2, 2, 7, 9, 14]))


def _train(model, runner, steps=3):
    tables = use_sparse_row_gradients(model)
    sparse = SparseAdagrad(tables, lr=0.1)
    dense = torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith("tables.")], lr=0.1)
    outs = []
    for step in range(steps):
        out = runner(*_inputs(step))
        (out.square().sum()).backward()
        for opt in (sparse, dense):
            opt.step()
            opt.zero_grad()
        outs.append(out.detach())
    return outs, sparse


def test_groups_what_can_share_a_call_and_trains_like_eager():
    torch.manual_seed(0)
    eager = ManyTables()
    compiled = copy.deepcopy(eager)
    counters.clear()
    graphs = []
    want, want_opt = _train(eager, eager)
    got, got_opt = _train(compiled, rewritten(compiled, graphs))
    assert counters["gemcompile"]["table_batching"] == 2
    (graph,) = [g.graph for g in graphs]
    bags = [n for n in graph.nodes if n.target is torch.ops.gemcompile.sparse_embedding_bags.default]
    assert sorted(len(n.args[1]) for n in bags) == [2, 3]
    alone = [n for n in graph.nodes if n.target is torch.ops.gemcompile.sparse_embedding.default]
    assert len(alone) == 5  # dim 16, no padding id, 2 wide, derived ids, offsets
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(want_opt.param_groups[0]["params"], got_opt.param_groups[0]["params"]):
        assert torch.equal(want_opt.state[p]["sum"], got_opt.state[q]["sum"])


def test_turned_off_leaves_every_lookup_alone():
    from gemcompile import GemConfig
    from gemcompile.passes import PIPELINE
    from gemcompile.passes.base import instantiate, run_pre_grad

    model = ManyTables()
    use_sparse_row_gradients(model)
    counters.clear()
    seen = []

    def backend(gm, example_inputs):
        run_pre_grad(gm, instantiate(PIPELINE, GemConfig(table_batching={"enabled": False})), example_inputs)
        seen.append(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*_inputs(0))
    assert counters["gemcompile"]["table_batching"] == 0
    assert sum(n.target is torch.ops.gemcompile.sparse_embedding.default for n in seen[0].graph.nodes) == 10


def test_gem_ref_pools_its_tables_in_one_call():
    """GEM-ref's sparse features (one EmbeddingBag each) in one call; its sequence lookups stay (they are
    lookups, packed by unpad)."""
    cfg = gem_ref_config("tiny")
    data = SyntheticData(cfg.data_config(4, fill=0.5, seed=0))
    model = GemRef(cfg)
    use_sparse_row_gradients(model)
    counters.clear()
    graphs = []
    batch = data.batch(0)
    masked_bce_loss(rewritten(model, graphs)(**batch.features()), batch.labels, batch.label_mask).backward()
    (bags,) = [n for n in graphs[0].graph.nodes if n.target is torch.ops.gemcompile.sparse_embedding_bags.default]
    assert len(bags.args[1]) == cfg.n_tables and counters["gemcompile"]["table_batching"] == 1
