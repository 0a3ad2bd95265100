"""The unpad pass: token-wise regions of padded models run on packed tokens with eager's outputs and
gradients at every position (padded ones included); token-mixing ops, values whose padding a reader
sees, and masks of other lengths are left padded, with a reason."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from gemcompile import GemConfig, explain, gem_compile

B, N, D_IN, D = 4, 9, 6, 8
LENGTH_SETS = ([9, 0, 3, 5], [9, 9, 9, 9], [0, 0, 0, 0], [1, 2, 8, 4], [4, 7, 0, 9])


def valid_mask(lengths, n=N):
    return torch.arange(n)[None, :] < lengths[:, None]


class Ffn(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h))))


class MaskedResidualFfn(nn.Module):
    """The common form: a masked input projection, residual FFN blocks re-masked, masked mean pooling."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.ffn1, self.ffn2 = Ffn(), Ffn()

    def forward(self, x, lengths):
        valid = valid_mask(lengths)
        h = self.inp(x) * valid[..., None]
        h = h + self.ffn1(h) * valid[..., None]
        h = h + self.ffn2(h) * valid[..., None]
        return h.sum(1) / lengths.clamp(min=1)[:, None]


class ReturnsPaddedRows(nn.Module):
    """Near-miss: the last FFN is not re-masked and the (B, N, D) result is returned: its padded rows
    are bias values the caller sees, so everything after the masked projection must stay padded."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.ffn = Ffn()

    def forward(self, x, lengths):
        h = self.inp(x) * valid_mask(lengths)[..., None]
        return h + self.ffn(h)


class TokenMixingInside(nn.Module):
    """A cumulative sum over the sequence sits between token-wise blocks: it mixes tokens, so it runs
    padded on a scattered copy and the next block gathers its result back."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.ffn = Ffn()

    def forward(self, x, lengths):
        valid = valid_mask(lengths)[..., None]
        h = self.inp(x) * valid
        h = h + torch.cumsum(h, dim=1) * valid
        h = h + self.ffn(h) * valid
        return h.amax(1)


class PositionAndSampleTerms(nn.Module):
    """Broadcast operands: a (N, D) position table, a (B, 1, D) per-sample context, a (1, 1, D) scale."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.pos = nn.Parameter(torch.randn(N, D))
        self.ctx = nn.Linear(3, D)
        self.scale = nn.Parameter(torch.randn(1, 1, D))
        self.ffn = Ffn()

    def forward(self, x, lengths, c):
        valid = valid_mask(lengths)[..., None]
        h = (self.inp(x) + self.pos + self.ctx(c)[:, None, :]) * self.scale * valid
        h = h + self.ffn(h) * valid
        return (h * h).sum((1, 2))


class Pooling(nn.Module):
    """Learned queries attend over projected keys/values of the padded sequence (SDPA with the key mask):
    the key/value projections are pad-blind exits into the jagged attention kernel."""

    def __init__(self, key_lengths_offset: int = 0, width: int = 32):  # 2 heads of 16: the kernel's range
        super().__init__()
        self.inp = nn.Linear(D_IN, width)
        self.queries = nn.Parameter(torch.randn(1, 2, 3, width // 2))
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.key_lengths_offset = key_lengths_offset

    def forward(self, x, lengths):
        h = self.inp(x) * valid_mask(lengths)[..., None]
        k = self.k(h).unflatten(-1, (2, -1)).transpose(1, 2)
        v = self.v(h).unflatten(-1, (2, -1)).transpose(1, 2)
        keys = valid_mask(lengths - self.key_lengths_offset if self.key_lengths_offset else lengths)
        o = F.scaled_dot_product_attention(self.queries.expand(x.shape[0], -1, -1, -1), k, v,
                                           attn_mask=keys[:, None, None, :])
        return o.flatten(1)


class OffsetMask(nn.Module):
    """The mask holds one token fewer than lengths (e.g. a trailing target token excluded)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.ffn = Ffn()

    def forward(self, x, lengths):
        valid = (torch.arange(N)[None, :] < (lengths[:, None] - 1))[..., None]
        h = self.inp(x) * valid
        h = h + self.ffn(h) * valid
        return h.sum(1)


class SequenceFirst(nn.Module):
    """(N, B, D) layout, mask transposed: its rows are (N, B) and the mask ``n < lengths[b]`` read over them
    is a token vector (unpad_masks.py): packed by it, exact."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.ffn = Ffn()

    def forward(self, x, lengths):
        valid = valid_mask(lengths).t()[..., None]
        h = self.inp(x.transpose(0, 1)) * valid
        h = h + self.ffn(h) * valid
        return h.sum(0)


def run_and_compare(model, make_inputs, expected_unpad: int, expected_gemms: int | None = None):
    """gem_compile(model) over every length set: eager's outputs and gradients, one compile."""
    torch.manual_seed(0)
    counters.clear()
    compiled = gem_compile(model)
    for lengths in LENGTH_SETS:
        inputs = make_inputs(torch.tensor(lengths))
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        for t in leaves:
            t.requires_grad_(True)
        params = list(model.parameters())
        out = compiled(*inputs)
        grads = torch.autograd.grad(out.square().sum(), params + leaves)
        ref = model(*inputs)
        ref_grads = torch.autograd.grad(ref.square().sum(), params + leaves)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, "a new token count recompiled"
    assert counters["gemcompile"]["unpad"] == expected_unpad
    report = explain(model, *make_inputs(torch.tensor(LENGTH_SETS[0])))
    rewrites = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert len(rewrites) == expected_unpad
    if expected_gemms is not None:
        assert sum(r.metrics["gemms"] for r in rewrites) == expected_gemms
    return report


def x_only(lengths):
    torch.manual_seed(1)
    return (torch.randn(B, N, D_IN), lengths)


def test_masked_residual_ffn_runs_packed():
    report = run_and_compare(MaskedResidualFfn(), x_only, expected_unpad=1, expected_gemms=5)
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert rewrite.metrics["macs_per_token"] == D_IN * D + 2 * (D * 2 * D + 2 * D * D)
    assert rewrite.metrics["gathers"] == 1 and rewrite.metrics["scatters"] == 1
    assert "valid_token_index" in report.graph_after.code
    assert "layer_norm" in rewrite.detail and "saves 6 x" in rewrite.detail


def test_padded_rows_a_caller_sees_stay_padded():
    report = run_and_compare(ReturnsPaddedRows(), x_only, expected_unpad=1, expected_gemms=1)
    reasons = [r.reason for r in report.refusals if r.pass_name == "unpad"]
    assert any("stays padded" in r and "graph output" in r for r in reasons), reasons


def test_token_mixing_op_runs_padded_between_packed_blocks():
    report = run_and_compare(TokenMixingInside(), x_only, expected_unpad=1, expected_gemms=3)
    code = report.graph_after.code
    assert "cumsum" in code and "index_put" in code


def test_position_and_sample_operands_are_gathered():
    def inputs(lengths):
        torch.manual_seed(2)
        return (torch.randn(B, N, D_IN), lengths, torch.randn(B, 3))

    run_and_compare(PositionAndSampleTerms(), inputs, expected_unpad=1, expected_gemms=3)


def test_key_value_projections_feed_jagged_attention():
    report = run_and_compare(Pooling(), x_only, expected_unpad=1, expected_gemms=3)
    assert report.counts["jagged_attention"] == 1


def test_attention_over_other_lengths_is_not_pad_blind():
    """The attention keeps one key fewer than the projection's mask: zeroing the projection's padded
    rows is not provably harmless there, so the key/value projections stay padded."""
    report = run_and_compare(Pooling(key_lengths_offset=1), x_only, expected_unpad=1, expected_gemms=1)
    reasons = [r.reason for r in report.refusals if r.pass_name == "unpad"]
    assert sum("stays padded" in r for r in reasons) >= 2, reasons


def test_offset_mask():
    run_and_compare(OffsetMask(), x_only, expected_unpad=1, expected_gemms=3)


def test_sequence_first_layout_runs_packed_by_the_transposed_mask():
    report = run_and_compare(SequenceFirst(), x_only, expected_unpad=1, expected_gemms=3)
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert "tokens where (b - l_lengths_[n] < 0)" in rewrite.detail


def test_min_gemms_and_disabled():
    model = MaskedResidualFfn()
    inputs = x_only(torch.tensor(LENGTH_SETS[0]))
    report = explain(model, *inputs, config=GemConfig(unpad={"min_gemms": 6}))
    assert report.counts["unpad"] == 0
    assert any("min_gemms=6" in r.reason for r in report.refusals if r.pass_name == "unpad")
    assert explain(model, *inputs, config=GemConfig(unpad={"enabled": False})).counts["unpad"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    model = MaskedResidualFfn().to(dtype)
    compiled = gem_compile(model)
    x = torch.randn(B, N, D_IN, dtype=dtype)
    lengths = torch.tensor(LENGTH_SETS[3])
    tol = {} if dtype == torch.float64 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(compiled(x, lengths), model(x, lengths), **tol)


def test_packed_gemms_still_get_mxfp8_casts():
    """The mxfp8 pass judges a packed GEMM by its token count's hint or upper bound (B * N), not 'unknown'."""
    model = MaskedResidualFfn()
    inputs = x_only(torch.tensor(LENGTH_SETS[0]))
    mx = {"enabled": True, "recipe": "mxfp8_emulated", "min_m": 1, "min_k": 1, "min_n": 1}
    with_unpad = explain(model, *inputs, config=GemConfig(mxfp8=mx))
    without = explain(model, *inputs, config=GemConfig(mxfp8=mx, unpad={"enabled": False}))
    assert with_unpad.counts["unpad"] == 1
    assert with_unpad.counts["mxfp8"] == without.counts["mxfp8"] > 0


def test_dynamic_batch_is_refused_with_a_reason():
    model = MaskedResidualFfn()
    compiled = gem_compile(model, dynamic=True)
    counters.clear()
    for batch in (3, 5):
        x, lengths = torch.randn(batch, N, D_IN), torch.randint(0, N + 1, (batch,))
        torch.testing.assert_close(compiled(x, lengths), model(x, lengths), atol=1e-5, rtol=1e-4)
    assert counters["gemcompile"]["unpad"] == 0
    assert counters["gemcompile"]["unpad_refused"] >= 1


def _index_spy(calls: list):
    """A CPU implementation of gemcompile::valid_token_index (the op's own) that records, per call, the
    token count T, the rows it returns and its buckets."""
    from gemcompile.lowering.valid_tokens import _valid_token_index

    def spy(lengths, max_len, size_hint=0, buckets=0):
        out = _valid_token_index(lengths, max_len, size_hint, buckets)
        calls.append((int(lengths.clamp(0, max_len).sum()), out.numel(), buckets))
        return out

    return spy


def test_token_buckets_pad_the_packed_rows_to_a_few_capacities():
    """UnpadConfig.token_buckets: the packed length is one of k + 1 capacities; the slack rows (copies of a
    real token) are dropped at the exit, so outputs and every gradient still equal eager, for empty, full and
    mixed batches, in one compile."""
    from gemcompile.lowering.valid_tokens import bucket_capacity

    model = MaskedResidualFfn()
    calls = []
    spy = _index_spy(calls)
    torch.manual_seed(0)
    counters.clear()
    compiled = gem_compile(model, config=GemConfig(unpad={"token_buckets": 3}))
    for lengths in LENGTH_SETS:
        x, lengths = x_only(torch.tensor(lengths))
        x.requires_grad_(True)
        params = list(model.parameters())
        with torch.library._scoped_library("gemcompile", "IMPL") as lib:  # count what the op returns
            lib.impl("valid_token_index", spy, "CPU")
            out = compiled(x, lengths)
        grads = torch.autograd.grad(out.square().sum(), params + [x])
        ref = model(x, lengths)
        ref_grads = torch.autograd.grad(ref.square().sum(), params + [x])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["gemcompile"]["unpad"] == 1
    # B * N = 36 in 3 buckets: capacities 0, 12, 24, 36; T = 17, 36, 0, 15, 20
    sizes = [(t, rows) for t, rows, _ in calls]
    assert sizes == [(17, 24), (36, 36), (0, 0), (15, 24), (20, 24)]
    assert all(bucket_capacity(t, 36, 3) == c for t, c in sizes)
    report = explain(model, *x_only(torch.tensor(LENGTH_SETS[0])), config=GemConfig(unpad={"token_buckets": 3}))
    # the index is bucketed inside the op: no tensor of the exact size T in the graph, whose partitions
    # CUDA-graph trees would otherwise record again for every batch
    nodes = [n for n in report.graph_after.graph.nodes if "valid_token_index" in str(n.target)]
    assert nodes and all(n.args[3] == 3 for n in nodes)
    assert "buckets=3" in str(report)


@pytest.mark.parametrize("count,total,buckets,expected", [
    (0, 36, 3, 0), (1, 36, 3, 12), (12, 36, 3, 12), (13, 36, 3, 24), (36, 36, 3, 36), (5, 7, 2, 7),
    (5, 7, 7, 5), (3, 5, 100, 3), (0, 0, 4, 0)])
def test_pad_to_bucket_pads_with_the_sentinel(count, total, buckets, expected):
    from gemcompile.lowering.valid_tokens import bucket_capacity, pad_to_bucket

    index = torch.arange(count, dtype=torch.int64)
    out = pad_to_bucket(index, total, buckets)
    assert bucket_capacity(count, total, buckets) == expected == out.numel()
    assert torch.equal(out[:count], index) and bool((out[count:] == total).all())


@pytest.mark.parametrize("lengths,max_len,buckets", [([0, 0], 5, 2), ([5, 5], 5, 2), ([3, 0, 4], 4, 3),
                                                     ([1, 2, 3], 4, 100), ([2], 3, 1)])
def test_bucketed_index_ops_equal_the_index_padded_to_its_bucket(lengths, max_len, buckets):
    """valid_token_index and valid_mask_index with buckets: the exact index, then the sentinel B * N."""
    from gemcompile.lowering.valid_tokens import pad_to_bucket, valid_token_index_reference

    lengths = torch.tensor(lengths)
    total = lengths.numel() * max_len
    expected = pad_to_bucket(valid_token_index_reference(lengths, max_len), total, buckets)
    assert torch.equal(torch.ops.gemcompile.valid_token_index(lengths, max_len, 0, buckets), expected)
    valid = torch.arange(max_len)[None, :] < lengths[:, None]
    assert torch.equal(torch.ops.gemcompile.valid_mask_index(valid, 0, buckets), expected)


def test_pad_to_bucket_refuses_bad_arguments():
    from gemcompile.lowering.valid_tokens import pad_to_bucket

    with pytest.raises(ValueError, match="buckets >= 1"):
        pad_to_bucket(torch.arange(3), 10, 0)
    with pytest.raises(ValueError, match="T <= total"):
        pad_to_bucket(torch.arange(11), 10, 2)
    with pytest.raises(ValueError, match="buckets must be >= 0"):
        torch.ops.gemcompile.valid_token_index(torch.tensor([1, 2]), 3, 0, -1)
    with pytest.raises(ValueError, match="buckets must be >= 0"):
        torch.ops.gemcompile.valid_mask_index(torch.ones(2, 3, dtype=torch.bool), 0, -1)
    with pytest.raises(ValueError, match="1-D int64"):
        pad_to_bucket(torch.arange(3, dtype=torch.int32), 10, 2)


@pytest.mark.parametrize("compile_kwargs,buckets", [({}, 0), ({"mode": "reduce-overhead"}, 16),
                                                     ({"options": {"triton.cudagraphs": True}}, 16)])
def test_token_buckets_default_to_bucketed_only_under_cuda_graphs(compile_kwargs, buckets):
    """UnpadConfig.token_buckets = None: exact token counts, unless the compile captures CUDA graphs, where
    an exact count would record a graph per batch (on the CPU Inductor skips the graphs; the pass still
    decides from the mode)."""
    from gemcompile.config import DEFAULT_CUDA_GRAPH_TOKEN_BUCKETS

    assert buckets in (0, DEFAULT_CUDA_GRAPH_TOKEN_BUCKETS)
    calls = []
    spy = _index_spy(calls)
    model = MaskedResidualFfn()
    torch._dynamo.reset()
    compiled = gem_compile(model, **compile_kwargs)
    x, lengths = x_only(torch.tensor(LENGTH_SETS[0]))
    with torch.library._scoped_library("gemcompile", "IMPL") as lib:
        lib.impl("valid_token_index", spy, "CPU")
        out = compiled(x, lengths)
    torch.testing.assert_close(out, model(x, lengths), atol=1e-5, rtol=1e-4)
    assert [b for _, _, b in calls] == [buckets]


def test_a_chain_that_stays_padded_is_one_refusal():
    """A reader of every row (a std over the sequence) keeps its input padded, and with it every token-wise
    value that input is computed from: explain says so once, with the count, not once per tensor."""

    class StdOverRows(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x, lengths):
            keep = (torch.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
            return self.down(F.gelu(self.up(x * keep))).std(dim=1)

    report = explain(StdOverRows(), torch.randn(4, 10, 16), torch.tensor([10, 3, 0, 7]))
    reasons = [r.reason for r in report.refusals if r.pass_name == "unpad"]
    assert len(reasons) == 1, reasons
    assert "std" in reasons[0] and "so do 2 value(s) it is computed from (gelu, " in reasons[0], reasons


def test_an_internal_error_in_the_row_mask_analysis_leaves_the_graph_padded(monkeypatch):
    """A bug of ours while finding the row masks (StableLM's torch.full(..., fill_value=) once raised there)
    must not fail the user's compile: nothing is unpadded, explain names the error, a warning says it, outputs
    equal eager; GEMCOMPILE_STRICT=1 (the suite's default) raises."""
    import gemcompile.passes.unpad as unpad

    def broken(graph):
        raise IndexError("a bug")

    monkeypatch.setattr(unpad, "find_row_masks", broken)
    model = MaskedResidualFfn()
    x, lengths = x_only(torch.tensor(LENGTH_SETS[0]))
    monkeypatch.setenv("GEMCOMPILE_STRICT", "0")
    with pytest.warns(UserWarning, match="internal error of gemcompile"):
        report = explain(model, x, lengths)
    assert report.counts["unpad"] == 0
    assert any("internal error" in r.reason and "a bug" in r.reason for r in report.refusals if r.pass_name == "unpad")
    torch._dynamo.reset()
    with pytest.warns(UserWarning):
        out = gem_compile(model)(x, lengths)
    torch.testing.assert_close(out, model(x, lengths), atol=1e-5, rtol=1e-4)
    monkeypatch.setenv("GEMCOMPILE_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="a bug"):
        explain(model, x, lengths)


def test_an_empty_batch_is_not_packed():
    """B = 0 (Dynamo specializes it): unpad's gather over no tokens failed in Inductor's lowering
    ("index is out of bounds for dimension with size 0"); the region is refused, eager's empty output."""
    torch.manual_seed(0)
    model = MaskedResidualFfn()
    x, lengths = torch.randn(0, N, D_IN), torch.zeros(0, dtype=torch.long)
    report = explain(model, x, lengths)
    assert report.counts["unpad"] == 0
    assert any("empty" in r.reason for r in report.refusals if r.pass_name == "unpad")
    torch._dynamo.reset()
    out, ref = gem_compile(model)(x, lengths), model(x, lengths)
    assert out.shape == ref.shape


class CheckpointedFfns(MaskedResidualFfn):
    """MaskedResidualFfn with each FFN block under torch.utils.checkpoint (HF's gradient_checkpointing)."""

    def forward(self, x, lengths):
        valid = valid_mask(lengths)[..., None]
        h = self.inp(x) * valid
        for ffn in (self.ffn1, self.ffn2):
            h = h + torch.utils.checkpoint.checkpoint(lambda h, ffn=ffn: ffn(h) * valid, h, use_reentrant=False)
        return h.sum(1) / lengths.clamp(min=1)[:, None]


def test_checkpointed_regions_are_said_to_run_padded():
    """Unpad does not run inside activation-checkpointed regions: explain says so (it said nothing)."""
    torch.manual_seed(0)
    model = CheckpointedFfns()
    x, lengths = torch.randn(3, N, D_IN), torch.tensor([N, 0, 2])
    reasons = [r.reason for r in explain(model, x, lengths).refusals if r.pass_name == "unpad"]
    assert any("2 activation-checkpointed region(s)" in r and "run on the padded rows" in r for r in reasons), reasons
