"""Sparse row gradients + SparseAdagrad (runtime/tables/sparse_{tables,adagrad}.py) against the dense
path they replace: nn.Embedding / nn.EmbeddingBag with a dense gradient and torch.optim.Adagrad.

On the CPU in fp32 an nn.Embedding looked up once per step must match bit for bit (weights, Adagrad sums,
outputs). Bags and tables looked up several times per step match within fp32 rounding: torch's CPU bag
backward adds a row's contributions in another order than the order of the ids."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad
from gemcompile.runtime.tables.sparse_tables import (SparseGradEmbedding, SparseGradEmbeddingBag,
                                                       use_sparse_row_gradients)

ROWS, DIM = 50, 6


class Lookups(nn.Module):
    """One table, looked up `uses` times per forward, then a small dense head."""

    def __init__(self, table: nn.Module, uses: int = 1):
        super().__init__()
        self.table, self.uses = table, uses
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets=None):
        outs = [self.table(ids if offsets is None else ids, *(() if offsets is None else (offsets,)))
                for _ in range(self.uses)]
        out = sum(o * (k + 1) for k, o in enumerate(outs))
        return self.head(out).pow(2).sum(), out


def _tables():
    return {
        "embedding": lambda: nn.Embedding(ROWS, DIM),
        "embedding-padding": lambda: nn.Embedding(ROWS, DIM, padding_idx=0),
        "bag-sum-2d": lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0),
        "bag-mean-2d": lambda: nn.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=0),
        "bag-sum-offsets": lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum"),
        "bag-mean-last-offset": lambda: nn.EmbeddingBag(ROWS, DIM, mode="mean", include_last_offset=True),
    }


def _batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    hot = (torch.rand(8, 5, generator=g) ** 2 * 12).long()  # small ids repeat often; 0 is frequent
    if kind.startswith("embedding"):
        return (hot,)
    if kind.endswith("2d"):
        return (hot,)
    sizes = torch.randint(0, 4, (7,), generator=g)  # empty bags included
    ids = torch.randint(0, ROWS, (int(sizes.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    if kind.endswith("last-offset"):
        offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    return ids, offsets


def _train(model, optimizers, kind, steps=3):
    outs = []
    for step in range(steps):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss, out = model(*_batch(kind, step))
        loss.backward()
        for opt in optimizers:
            opt.step()
        outs.append(out.detach())
    return outs


def _pair(kind, uses=1):
    torch.manual_seed(0)
    dense = Lookups(_tables()[kind](), uses)
    sparse = copy.deepcopy(dense)
    tables = use_sparse_row_gradients(sparse)
    assert tables == [sparse.table]
    dense_opts = [torch.optim.Adagrad([dense.table.weight], lr=0.3), torch.optim.SGD(dense.head.parameters(), lr=0.1)]
    sparse_opts = [SparseAdagrad(tables, lr=0.3), torch.optim.SGD(sparse.head.parameters(), lr=0.1)]
    return dense, dense_opts, sparse, sparse_opts


@pytest.mark.parametrize("kind", list(_tables()))
def test_bit_exact_against_dense_adagrad(kind):
    dense, dense_opts, sparse, sparse_opts = _pair(kind)
    want, got = _train(dense, dense_opts, kind), _train(sparse, sparse_opts, kind)
    assert sparse.table.weight.grad is None  # no (rows x dim) gradient
    d_state, s_state = dense_opts[0].state[dense.table.weight], sparse_opts[0].state[sparse.table.weight]
    assert not torch.equal(dense.table.weight, _pair(kind)[0].table.weight)  # training moved the table
    assert torch.equal(d_state["step"], s_state["step"])
    if kind.startswith("embedding"):
        for w, g in zip(want, got):
            assert torch.equal(w, g)
        assert torch.equal(dense.table.weight, sparse.table.weight)
        assert torch.equal(d_state["sum"], s_state["sum"])
    else:
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sparse.table.weight, dense.table.weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_state["sum"], d_state["sum"], rtol=1e-5, atol=1e-7)
        untouched = d_state["sum"].sum(1) == 0  # rows no step looked up: exactly as initialised
        assert untouched.any() and torch.equal(sparse.table.weight[untouched], dense.table.weight[untouched])


def test_several_lookups_per_step_within_rounding():
    dense, dense_opts, sparse, sparse_opts = _pair("embedding-padding", uses=3)
    _train(dense, dense_opts, "embedding-padding"), _train(sparse, sparse_opts, "embedding-padding")
    torch.testing.assert_close(sparse.table.weight, dense.table.weight, rtol=1e-6, atol=1e-7)
    assert torch.equal(sparse.table.weight[0], dense.table.weight[0])  # padding row untouched


class TiedOutput(nn.Module):
    """An item table that is also the output layer (logits = h @ table.weight.T, SASRec / BERT4Rec style)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(ROWS, DIM, padding_idx=0)

    def forward(self, ids):
        h = self.table(ids).mean(1)  # (B, DIM)
        return torch.log_softmax(h @ self.table.weight.T, -1)[:, 1].sum(), h


def test_a_table_tied_to_the_output_layer_gets_one_dense_update():
    torch.manual_seed(0)
    dense = TiedOutput()
    sparse = copy.deepcopy(dense)
    tables = use_sparse_row_gradients(sparse)
    d_opt, s_opt = torch.optim.Adagrad(dense.parameters(), lr=0.3), SparseAdagrad(tables, lr=0.3)
    for step in range(3):
        ids = _batch("embedding", step)[0]
        for model, opt in ((dense, d_opt), (sparse, s_opt)):
            opt.zero_grad()
            model(ids)[0].backward()
            opt.step()
    torch.testing.assert_close(sparse.table.weight, dense.table.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s_opt.state[sparse.table.weight]["sum"], d_opt.state[dense.table.weight]["sum"],
                               rtol=1e-6, atol=1e-7)
    assert torch.equal(s_opt.state[sparse.table.weight]["step"], torch.tensor(3.0))


def test_checkpoint_state_is_dense_adagrads():
    """A SparseAdagrad state dict loads into dense Adagrad and back: same keys, same tensors."""
    dense, dense_opts, sparse, sparse_opts = _pair("embedding")
    _train(sparse, sparse_opts, "embedding", steps=2)
    dense_opts[0].load_state_dict(sparse_opts[0].state_dict())
    state = dense_opts[0].state[dense.table.weight]
    assert torch.equal(state["sum"], sparse_opts[0].state[sparse.table.weight]["sum"])
    assert "row_grad_token" not in sparse.state_dict() and set(sparse.state_dict()) == set(dense.state_dict())


def test_a_resumed_optimizer_updates_the_loaded_state():
    """load_state_dict gives the tables new sum tensors: the steps after it must read and write those (step()
    keeps each table's layout while its sum is the same tensor), and match a run that never stopped."""
    _, _, sparse, sparse_opts = _pair("embedding")
    _train(sparse, sparse_opts, "embedding", steps=2)
    saved = copy.deepcopy((sparse.state_dict(), [o.state_dict() for o in sparse_opts]))

    def third_step():
        for opt in sparse_opts:
            opt.zero_grad(set_to_none=True)
        sparse(*_batch("embedding", 2))[0].backward()
        for opt in sparse_opts:
            opt.step()
        return sparse.table.weight.detach().clone(), sparse_opts[0].state[sparse.table.weight]["sum"].clone()

    want_w, want_sum = third_step()
    sparse.load_state_dict(saved[0])
    for opt, state in zip(sparse_opts, saved[1]):
        opt.load_state_dict(state)
    got_w, got_sum = third_step()
    assert torch.equal(got_w, want_w) and torch.equal(got_sum, want_sum)


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(ROWS, DIM), nn.Embedding(ROWS, DIM)

    def forward(self, ids, use_b):
        out = self.a(ids).sum() + (self.b(ids).pow(2).sum() if use_b else 0)
        return out


def test_step_counts_follow_dense_adagrad_across_a_save_and_load():
    """Each table counts a step only when it was looked up (as dense Adagrad counts a table with a gradient);
    the counts are views of one buffer (SparseAdagrad._Plan), which must survive torch.save / load_state_dict
    and keep counting per table."""
    torch.manual_seed(0)
    dense = TwoTables()
    sparse = copy.deepcopy(dense)
    d_opt = torch.optim.Adagrad(dense.parameters(), lr=0.3)
    s_opt = SparseAdagrad(use_sparse_row_gradients(sparse), lr=0.3)

    def steps(uses):
        for use_b in uses:
            ids = _batch("embedding", len(uses))[0]
            for model, opt in ((dense, d_opt), (sparse, s_opt)):
                opt.zero_grad(set_to_none=True)
                model(ids, use_b).backward()
                opt.step()
        return [float(s_opt.state[t.weight]["step"]) for t in (sparse.a, sparse.b)]

    assert steps([True, False, False]) == [3.0, 1.0]
    buffer = io.BytesIO()
    torch.save(s_opt.state_dict(), buffer)
    buffer.seek(0)
    s_opt.load_state_dict(torch.load(buffer))
    assert steps([False, True]) == [5.0, 2.0]
    for s_table, d_table in ((sparse.a, dense.a), (sparse.b, dense.b)):
        assert torch.equal(s_opt.state[s_table.weight]["step"], d_opt.state[d_table.weight]["step"])
        assert torch.equal(s_opt.state[s_table.weight]["sum"], d_opt.state[d_table.weight]["sum"])


def test_add_param_group_refuses_weights_it_was_not_built_with():
    _, _, sparse, sparse_opts = _pair("embedding")
    with pytest.raises(TypeError, match="tables it was built with"):
        sparse_opts[0].add_param_group({"params": [sparse.head.weight]})
    other = use_sparse_row_gradients(Lookups(nn.Embedding(ROWS, DIM)))
    with pytest.raises(TypeError, match="tables it was built with"):
        sparse_opts[0].add_param_group({"params": other[0].weight})


def test_a_grad_scaler_is_refused_by_name_and_no_row_is_updated():
    """torch.amp.GradScaler stopped with its own 'No inf checks were recorded for this optimizer'."""
    _, _, sparse, sparse_opts = _pair("embedding")
    before = sparse.table.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(sparse(*_batch("embedding", 0))[0]).backward()
    scaler.step(sparse_opts[1])  # (the dense head's SGD: scaled as usual)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="does not take torch.amp.GradScaler"):
        warnings.simplefilter("ignore", FutureWarning)  # (torch 2.13 warns that the grad_scaler argument goes)
        scaler.step(sparse_opts[0])
    assert torch.equal(sparse.table.weight, before)


def test_zero_grad_drops_rows_of_a_step_never_taken():
    _, _, sparse, sparse_opts = _pair("embedding")
    before = sparse.table.weight.detach().clone()
    sparse(*_batch("embedding", 0))[0].backward()
    for opt in sparse_opts:
        opt.zero_grad()
        opt.step()
    assert torch.equal(sparse.table.weight, before)


def test_ineligible_tables_stay_dense_and_bad_input_errors():
    model = nn.ModuleDict({"max_norm": nn.Embedding(5, 2, max_norm=1.0), "sparse": nn.Embedding(5, 2, sparse=True),
                           "max_bag": nn.EmbeddingBag(5, 2, mode="max"), "ok": nn.Embedding(5, 2)})
    tables = use_sparse_row_gradients(model)
    assert tables == [model["ok"]] and isinstance(model["ok"], SparseGradEmbedding)
    assert type(model["max_bag"]) is nn.EmbeddingBag and type(model["max_norm"]) is nn.Embedding
    with pytest.raises(IndexError):
        model["ok"](torch.tensor([0, 5]))
    bag = use_sparse_row_gradients(nn.EmbeddingBag(5, 2))[0]
    assert isinstance(bag, SparseGradEmbeddingBag)
    with pytest.raises(ValueError, match="per_sample_weights"):
        bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    with pytest.raises(TypeError, match="SparseGrad tables"):
        SparseAdagrad([nn.Embedding(3, 2)])
    with pytest.raises(ValueError, match="lr_decay"):
        opt = SparseAdagrad([model["ok"]])
        opt.param_groups[0]["lr_decay"] = 0.1
        opt.step()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend):
    """The filing op mutates a forward input from the backward graph: compiled runs must file the same rows."""
    torch._dynamo.reset()
    _, _, eager, eager_opts = _pair("embedding-padding", uses=2)
    compiled, compiled_opts = copy.deepcopy(eager), None
    tables = [compiled.table]
    assert compiled.table.table_key != eager.table.table_key  # a copy files under its own key
    compiled_opts = [SparseAdagrad(tables, lr=0.3), torch.optim.SGD(compiled.head.parameters(), lr=0.1)]
    want = _train(eager, eager_opts, "embedding-padding")
    got = _train(torch.compile(compiled, backend=backend, fullgraph=True), compiled_opts, "embedding-padding")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled.table.weight, eager.table.weight, rtol=1e-6, atol=1e-6)
    assert not torch.equal(compiled.table.weight, _pair("embedding-padding")[0].table.weight)


def test_trains_on_the_cpu_where_triton_is_missing():
    """Triton is a Linux-only dependency: SparseAdagrad on CPU tables must import and step without it (only
    CUDA tables take the batched Triton launch)."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from torch import nn\n"
        "from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad\n"
        "from gemcompile.runtime.tables.sparse_tables import use_sparse_row_gradients\n"
        "model = nn.Sequential(nn.Embedding(10, 4))\n"
        "opt = SparseAdagrad(use_sparse_row_gradients(model), lr=0.5)\n"
        "before = model[0].weight.detach().clone()\n"
        "model(torch.tensor([[1, 2]])).sum().backward()\n"
        "opt.step()\n"
        "changed = (model[0].weight != before).any(1).nonzero().flatten().tolist()\n"
        "assert changed == [1, 2], changed\n"
        "assert 'triton' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
