"""Sparse tables on CUDA: the row-wise Adagrad kernel against the plain-PyTorch reference, and a model with
sparse tables compiled by Inductor (the backward mutates a forward input) against the same model in eager."""

import copy

import pytest
import torch
from torch import nn

from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_rows_triton_
from gemcompile.lowering.sparse_embedding.reference import adagrad_rows_reference_
from gemcompile.runtime.training.optimizers import build_optimizers
from gemcompile.runtime.tables.sparse_adagrad import SparseAdagrad

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("rows,dim,n", [(1000, 128, 5000), (7, 33, 300), (1 << 20, 64, 200_000), (10, 16, 0)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_kernel_matches_reference(rows, dim, n, grad_dtype, deterministic):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    weight = torch.randn(rows, dim, device="cuda", generator=g)
    state = torch.rand(rows, dim, device="cuda", generator=g)
    ids = (torch.rand(n, device="cuda", generator=g) ** 3 * rows).long()  # heavy repeats
    ids[::11] = -1
    grads = torch.randn(n, dim, device="cuda", generator=g).to(grad_dtype)
    want_w, want_s = weight.double(), state.double()
    adagrad_rows_reference_(want_w, want_s, ids, grads.double(), 0.05, 1e-10)
    adagrad_rows_triton_(weight, state, ids, grads, 0.05, 1e-10, deterministic=deterministic)
    # fp32 sums of up to thousands of rows against float64: relative error ~ sqrt(k) * 2^-24
    torch.testing.assert_close(state, want_s.float(), rtol=5e-5, atol=1e-5)
    torch.testing.assert_close(weight, want_w.float(), rtol=5e-5, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_looked_up_200k_times_as_accurate_as_dense(deterministic):
    """A 3-row table (GEM-ref's action tables) with 600k lookups: fp32 sums of 200k terms are far from
    float64 whichever way they are added, so the check is against the dense path's own fp32 result."""
    g = torch.Generator(device="cuda").manual_seed(3)
    table = nn.Embedding(3, 128).cuda()
    ids = torch.randint(0, 3, (600_000,), device="cuda", generator=g)
    grad_out = torch.randn(600_000, 128, device="cuda", generator=g)
    weight, state = table.weight.detach().clone(), torch.zeros(3, 128, device="cuda")
    table(ids).backward(grad_out)
    opt = torch.optim.Adagrad(table.parameters(), lr=0.05)
    opt.step()
    exact_w, exact_s = weight.double(), state.double()
    adagrad_rows_reference_(exact_w, exact_s, ids, grad_out.double(), 0.05, 1e-10)
    adagrad_rows_triton_(weight, state, ids, grad_out, 0.05, 1e-10, deterministic=deterministic)
    dense_err = (opt.state[table.weight]["sum"].double() - exact_s).abs().max()
    ours_err = (state.double() - exact_s).abs().max()
    assert ours_err <= 4 * dense_err + 1e-3, (ours_err, dense_err)
    torch.testing.assert_close(weight, table.weight.detach(), rtol=1e-3, atol=1e-4)


class Lookups(nn.Module):
    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(5000, 64, padding_idx=0)
        self.bags = nn.EmbeddingBag(3000, 64, mode="sum", padding_idx=0)
        self.head = nn.Linear(64, 1)

    def forward(self, seq, hot):
        x = self.item(seq).sum(1) + self.item(seq[:, :3]).sum(1) + self.bags(hot)
        return self.head(x).square().mean()


def _lookup_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(step)
    return (torch.randint(0, 5000, (32, 40), device="cuda", generator=g),
            torch.randint(0, 3000, (32, 6), device="cuda", generator=g))


def _train_step(runner, opts, batch) -> torch.Tensor:
    loss = runner(*batch)
    for o in opts:
        o.zero_grad()
    loss.backward()
    for o in opts:
        o.step()
    return loss


def test_inductor_compiled_sparse_tables_equal_eager():
    torch.manual_seed(0)
    eager = Lookups().cuda()
    compiled, dense = copy.deepcopy(eager), copy.deepcopy(eager)
    runs = [(eager, build_optimizers(eager, 1e-3, 0.05, sparse_embeddings=True), eager),
            (compiled, build_optimizers(compiled, 1e-3, 0.05, sparse_embeddings=True),
             torch.compile(compiled, fullgraph=True)),
            (dense, build_optimizers(dense, 1e-3, 0.05), dense)]
    assert isinstance(runs[0][1][-1], SparseAdagrad)
    losses = []
    for model, opts, runner in runs:
        out = []
        for step in range(4):
            out.append(_train_step(runner, opts, _lookup_batch(step)).item())
        losses.append(out)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-5, atol=1e-6)
    for name in ("item.weight", "bags.weight"):
        w = dict(eager.named_parameters())[name]
        torch.testing.assert_close(dict(compiled.named_parameters())[name], w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dict(dense.named_parameters())[name], w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_many_tables_in_one_launch_match_the_reference(weight_dtype):
    """adagrad_tables_triton_ (SparseAdagrad's path for a group's CUDA tables of one dim and dtype) against the
    float64 reference per table: rows of different counts, heavy repeats, padding and ids past a table."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_

    g = torch.Generator(device="cuda").manual_seed(7)
    rows = [1 << 17, 3, 1000, 1 << 20]
    weights = [torch.randn(r, 64, device="cuda", generator=g).to(weight_dtype) for r in rows]
    sums = [torch.rand(r, 64, device="cuda", generator=g) for r in rows]
    ids = [(torch.rand(20_000, device="cuda", generator=g) ** 3 * (r + 2)).long() - 1 for r in rows]
    grads = [torch.randn(20_000, 64, device="cuda", generator=g).bfloat16() for _ in rows]
    want = []
    for w, s, i, gr in zip(weights, sums, ids, grads):
        w64, s64 = w.double(), s.double()
        keep = i < w.shape[0]
        adagrad_rows_reference_(w64, s64, i[keep], gr[keep].double(), 0.05, 1e-10)
        want.append((w64, s64))
    adagrad_tables_triton_(weights, sums, ids, grads, 0.05, 1e-10)
    for (w64, s64), w, s in zip(want, weights, sums):
        torch.testing.assert_close(s, s64.float(), rtol=5e-5, atol=1e-5)
        torch.testing.assert_close(w.float(), w64.to(weight_dtype).float(), rtol=2e-2 if weight_dtype == torch.bfloat16
                                   else 5e-5, atol=1e-5 if weight_dtype == torch.float32 else 1e-2)


def test_many_tables_compile_once_whatever_the_id_count():
    """The batched path's kernels take views and counts that change with the step's ids (the last slot in use
    is a view at the id count): compiled for one count, no other count may compile them again (a compile
    inside a training step costs it a second)."""
    from gemcompile.lowering.sparse_embedding.adagrad_triton import adagrad_tables_triton_
    from gemcompile.runtime.training.triton_compiles import recording_triton_compiles

    weights = [torch.zeros(1000, 32, device="cuda") for _ in range(3)]
    sums = [torch.zeros(1000, 32, device="cuda") for _ in range(3)]

    def step(n):
        ids = [torch.randint(-1, 1000, (n + t,), device="cuda") for t in range(3)]
        adagrad_tables_triton_(weights, sums, ids, [torch.randn(len(i), 32, device="cuda") for i in ids], 0.1, 1e-10)

    step(500)  # compiles here
    compiled: list[str] = []
    with recording_triton_compiles(compiled):
        for n in (501, 502, 503, 512, 515, 4096, 7):
            step(n)
    torch.cuda.synchronize()
    assert compiled == []


def test_a_table_moved_in_memory_between_steps_is_updated_where_it_lives():
    """SparseAdagrad keeps each group's batched tables (their device addresses included) across steps: a
    table whose .data is replaced between steps must be updated in its new storage, as dense Adagrad does."""
    torch.manual_seed(0)
    sparse = Lookups().cuda()
    dense = copy.deepcopy(sparse)
    runs = [(sparse, build_optimizers(sparse, 1e-3, 0.05, sparse_embeddings=True)),
            (dense, build_optimizers(dense, 1e-3, 0.05))]
    for step in range(4):
        for model, opts in runs:
            if step == 2:
                model.bags.weight.data = model.bags.weight.data.clone()
            _train_step(model, opts, _lookup_batch(step))
    for name in ("item.weight", "bags.weight"):
        torch.testing.assert_close(dict(sparse.named_parameters())[name], dict(dense.named_parameters())[name],
                                   rtol=1e-5, atol=1e-6)
