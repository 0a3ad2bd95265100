"""Each op of the unpad pass's token-wise table (passes/token_wise.py), run packed inside a region:
eager's outputs and gradients at every position, and the op really inside the packed region; ops that
mix tokens (or name the B / N dims) stay outside it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemcompile import explain, gem_compile
from tests.rewritten import unpad_gemms_matching_eager

B, N, D = 3, 7, 8
LENGTHS = torch.tensor([7, 0, 4])

# name -> (op on h (B, N, D) -> (B, N, D), the op's name: expected among the packed ops, or, for an op that
# mixes tokens, expected NOT among them)
OPS = {
    "gelu": (lambda h: F.gelu(h), "gelu"),
    "silu_tanh_approx_gelu": (lambda h: F.silu(h) + F.gelu(h, approximate="tanh"), "silu"),
    "sigmoid_mul": (lambda h: h * torch.sigmoid(h), "sigmoid"),
    "clamp_where": (lambda h: torch.where(h > 0, h, 0.1 * h).clamp(-2, 2), "where"),
    "softmax_last": (lambda h: torch.softmax(h, dim=-1), "softmax"),
    "sum_keepdim": (lambda h: h - h.mean(-1, keepdim=True), "mean"),
    "unflatten_flatten": (lambda h: h.unflatten(-1, (2, 4)).flatten(2), "unflatten"),
    "transpose_trailing": (lambda h: h.unflatten(-1, (2, 4)).transpose(2, 3).flatten(2), "transpose"),
    "getitem_slice_cat": (lambda h: torch.cat([h[..., 4:], h[..., :4]], dim=-1), "cat"),
    "getitem_full_slices": (lambda h: torch.cat([h[:, :, 4:], h[:, :, :4]], dim=2), "getitem"),
    "rms_norm": (lambda h: F.rms_norm(h, (D,)), "rms_norm"),
    "masked_fill": (lambda h: h.masked_fill(h < -1, 0.0), "masked_fill"),
    "pow_exp": (lambda h: torch.exp(-h.pow(2)), "exp"),
    "to_dtype": (lambda h: h.double().float(), "double"),
    # head splits and merges as model code writes them (HF BERT's x.size()[:-1] + (heads, dim))
    "view_head_split": (lambda h: h.view(B, N, 2, 4).transpose(2, 3).reshape(B, N, D), "view"),
    "view_of_sizes": (lambda h: h.view(h.size(0), h.size(1), 2, 4).flatten(2), "view"),
    "view_size_tuple": (lambda h: h.view(h.size()[:-1] + (4, 2)).sum(-1).repeat_interleave(2, -1), "view"),
    "reshape_minus_one": (lambda h: torch.reshape(h, (B, N, -1, 4)).flatten(2), "reshape"),
    # pieces of a fused projection (unpad_splits.py: written as the slices they are)
    "split_fused_qkv": (lambda h: (lambda q, k, v: q * k + v)(*torch.cat([h, 2 * h, -h], -1).split(D, dim=-1)),
                        "getitem"),
    "split_sizes_list": (lambda h: torch.cat(h.split([5, 3], dim=2)[::-1], dim=-1), "getitem"),
    "chunk_uneven": (lambda h: torch.cat(h.chunk(3, dim=-1)[::-1], dim=-1), "getitem"),
    "tensor_split_indices": (lambda h: torch.cat(torch.tensor_split(h, (2, 6), dim=-1)[::-1], -1), "getitem"),
    "unbind_heads": (lambda h: (lambda a, b: torch.cat([a * b, a - b], -1))(*h.unflatten(-1, (2, 4)).unbind(2)),
                     "getitem"),
    # x @ W by a weight of its own (UniSRec's MoE gate ``x @ self.w_gate``) beside another reader of x
    "matmul_by_a_weight": (lambda h: torch.cat([h[..., :5], h @ torch.linspace(-1, 1, D * 3).view(D, 3)], -1),
                           "matmul"),
    "matmul_by_a_vector": (lambda h: h * (h @ torch.linspace(-1, 1, D))[..., None], "matmul"),
    # mixing tokens: must stay out of the packed region, result still exact
    "matmul_over_tokens": (lambda h: (h.transpose(1, 2) @ h).sum(1, keepdim=True).expand(-1, N, -1), "-matmul"),
    "split_over_tokens": (lambda h: torch.cat(h.split([3, 4], dim=1)[::-1], dim=1), "-getitem"),
    "cumsum_over_tokens": (lambda h: torch.cumsum(h, dim=1), "-cumsum"),
    "mean_over_tokens": (lambda h: h - h.mean(1, keepdim=True), "-mean"),
    "roll_over_tokens": (lambda h: torch.roll(h, 1, dims=1), "-roll"),
    "view_folding_tokens": (lambda h: h.reshape(B, N * D).flip(-1).view(B, N, D), "-view"),
    "view_swapping_rows": (lambda h: h.view(N, B, D).flip(0).view(B, N, D), "-view"),
}


class OneOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.inp = nn.Linear(5, D)
        self.out = nn.Linear(D, D)

    def forward(self, x, lengths):
        valid = (torch.arange(N)[None, :] < lengths[:, None])[..., None]
        h = self.inp(x) * valid
        h = h + self.out(self.op(h)) * valid
        return h


@pytest.mark.parametrize("name", list(OPS))
def test_token_wise_op_packed_exactly(name):
    op, expected = OPS[name]
    torch.manual_seed(0)
    model = OneOp(op)
    x = torch.randn(B, N, 5, requires_grad=True)
    report = explain(model, x, LENGTHS)
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    packed_ops = rewrite.metrics["op_counts"]  # op name -> how many run packed
    if not expected.startswith("-"):
        assert expected in packed_ops, packed_ops
        assert rewrite.metrics["gemms"] == 2
    else:
        assert expected[1:] not in packed_ops, packed_ops
    compiled = gem_compile(model)
    out = compiled(x, LENGTHS)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    ref = model(x, LENGTHS)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-4)


def test_embedding_lookup_of_padded_ids_is_packed():
    class Ids(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(11, D, padding_idx=0)
            self.proj = nn.Linear(D, D)

        def forward(self, ids, lengths):
            valid = (torch.arange(N)[None, :] < lengths[:, None])[..., None]
            return (self.proj(self.table(ids)) * valid).sum(1)

    model = Ids()
    ids = torch.randint(0, 11, (B, N))
    report = explain(model, ids, LENGTHS)
    (rewrite,) = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert rewrite.metrics["op_counts"].get("embedding") == 1
    compiled = gem_compile(model)
    out = compiled(ids, LENGTHS)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    ref = model(ids, LENGTHS)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}])
def test_embedding_lookup_that_reads_every_id_stays_padded(option):
    """``max_norm`` renormalizes (in place) the weight rows of every id looked up, pad positions' ids too, and
    ``scale_grad_by_freq`` divides the weight's gradient by each id's count over the whole (B, N) ids: neither
    is token-wise, so the lookup stays outside the packed region. Pad positions hold real ids; the table is
    tied to the scoring head (SASRec's), so a row renormalized in eager only would change the output."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(11, D, **option)
            self.proj = nn.Linear(D, D)

        def forward(self, ids, lengths):
            valid = (torch.arange(N)[None, :] < lengths[:, None])[..., None]
            u = (F.gelu(self.proj(self.table(ids))) * valid).sum(1)
            return u @ self.table.weight.t()

    torch.manual_seed(0)
    ids = torch.randint(1, 11, (B, N), generator=torch.Generator().manual_seed(1))
    model, ref_model = Tied(), Tied()
    with torch.no_grad():
        model.table.weight.mul_(3.0)  # rows above max_norm: eager renormalizes each one it looks up
    ref_model.load_state_dict(model.state_dict())
    report = explain(Tied(), ids, LENGTHS)
    packed = [r for r in report.rewrites if r.pass_name == "unpad"]
    assert all(r.metrics["op_counts"].get("embedding", 0) == 0 for r in packed), packed
    out, ref = gem_compile(model)(ids, LENGTHS), ref_model(ids, LENGTHS)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(model.table.weight, ref_model.table.weight)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), list(ref_model.parameters()))):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=2e-5)  # sums of squares of outputs near 10


class FusedQkv(nn.Module):
    """One Linear for q, k and v: GPT-2 / nanoGPT cut it with ``split`` before the head split; timm-style code
    splits it into (3, B, H, N, D) heads first and takes the pieces with ``unbind(0)`` or ``qkv[i]``."""

    def __init__(self, layout: str, e=32, heads=2):  # head dim 16: the smallest the kernel serves
        super().__init__()
        self.layout, self.e, self.heads = layout, e, heads
        self.emb, self.ln = nn.Embedding(30, e), nn.LayerNorm(e)
        self.qkv, self.o = nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, ids, lengths):
        b, n = ids.shape
        valid = torch.arange(n)[None] < lengths[:, None]
        x = self.emb(ids)
        f = self.qkv(self.ln(x))
        if self.layout == "split":
            heads = lambda t: t.view(b, n, self.heads, -1).transpose(1, 2)  # noqa: E731
            q, k, v = (heads(t) for t in f.split(self.e, dim=2))
        else:
            qkv = f.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0) if self.layout == "unbind" else (qkv[0], qkv[1], qkv[2])
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        x = x + self.o(a.transpose(1, 2).reshape(b, n, self.e))
        return (x * valid[..., None]).sum(1)


@pytest.mark.parametrize("layout", ["split", "unbind", "index"])
def test_fused_qkv_packs_the_projection(layout):
    model, (ids, lengths) = _seeded(FusedQkv, layout), _ids_and_lengths()
    report = explain(model, ids, lengths)
    assert not [r for r in report.refusals if r.pass_name == "unpad"], report.refusals
    regions = [r.metrics for r in report.rewrites if r.pass_name == "unpad"]
    assert sum(r["gemms"] for r in regions) == 2, regions
    if layout == "split":
        assert regions[0]["op_counts"].get("getitem", 0) >= 3
    _assert_packed_equals_eager(model, ids, lengths)


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


def _ids_and_lengths():
    """A (4, 9) batch of ids with a full, a length-1 and an empty sequence."""
    return torch.randint(1, 30, (4, 9)), torch.tensor([9, 1, 0, 5])


def _assert_packed_equals_eager(model, *inputs):
    """The model compiled with the pre-grad passes: outputs and every parameter's gradient equal eager's."""
    from tests.rewritten import rewritten

    out, ref = rewritten(model)(*inputs), model(*inputs)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    refs = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


class SliceUpdatedInPlace(nn.Module):
    """fairseq's ``q *= scaling`` on a piece of a fused projection: the update reaches f through the view."""

    def __init__(self, e=32):
        super().__init__()
        self.e = e
        self.emb, self.qkv, self.proj = nn.Embedding(30, e), nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, ids, lengths):
        valid = (torch.arange(ids.shape[1])[None, :] < lengths[:, None])[..., None]
        x = self.emb(ids)
        f = self.qkv(x)
        q, k, v = f[..., :self.e], f[..., self.e:2 * self.e], f[..., 2 * self.e:]
        q.mul_(2.0)
        return (x + self.proj(q + k * v)) * valid, f * valid  # f read after the update


def test_a_value_updated_in_place_through_a_view_stays_padded():
    torch.manual_seed(0)
    model = SliceUpdatedInPlace()
    ids, lengths = torch.randint(1, 30, (4, 9)), torch.tensor([9, 1, 0, 5])
    with torch.no_grad():
        reasons = [r.reason for r in explain(model, ids, lengths).refusals if r.pass_name == "unpad"]
        assert any("updated in place" in r for r in reasons), reasons
        torch._dynamo.reset()
        for out, ref in zip(gem_compile(model)(ids, lengths), model(ids, lengths)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


class InputUpdatedBetweenReads(nn.Module):
    """A region input read, updated in place, and read again: a copy gathered once would miss the update."""

    def __init__(self, e=32):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, 3)

    def forward(self, h, lengths):
        valid = torch.arange(h.shape[1])[None, :] < lengths[:, None]
        a = self.fc1(h + 1.0)
        h.mul_(2.0)
        return self.head(torch.relu(a + self.fc2(h))) * valid[..., None]


def test_an_input_updated_in_place_between_two_reads_stays_padded():
    from tests.rewritten import rewritten

    torch.manual_seed(0)
    model = InputUpdatedBetweenReads()
    h, lengths = torch.randn(4, 9, 32), torch.tensor([9, 1, 0, 5])
    reasons = [r.reason for r in explain(model, h.clone(), lengths).refusals if r.pass_name == "unpad"]
    assert any("is updated in place by" in r and "through an alias" not in r for r in reasons), reasons
    out, ref = rewritten(model)(h.clone(), lengths), model(h.clone(), lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


class InPlaceActivations(nn.Module):
    """nn.ReLU(inplace=True), F.relu(x, True) and h.relu_() on fresh Linear outputs: the out-of-place ops they
    equal (attention/in_place.py), so the FFN packs."""

    def __init__(self, spelling: str, e=32):
        super().__init__()
        self.spelling = spelling
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, e), nn.Linear(e, 2 * e), nn.Linear(2 * e, e)
        self.act = nn.ReLU(inplace=True)

    def forward(self, ids, lengths):
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        x = self.emb(ids)
        h = self.fc1(x)
        if self.spelling.endswith("_statement"):  # the result unused: h itself is updated (it was dropped as dead)
            self.act(h) if self.spelling == "module_statement" else F.relu(h, inplace=True)
        else:
            h = {"module": lambda: self.act(h), "flag": lambda: F.relu(h, True), "method": lambda: h.relu_()}[
                self.spelling]()
        return (x + self.fc2(h)) * valid[..., None]


@pytest.mark.parametrize("spelling", ["module", "flag", "method", "module_statement", "flag_statement"])
def test_in_place_activations_pack(spelling):
    model, (ids, lengths) = _seeded(InPlaceActivations, spelling), _ids_and_lengths()
    report = explain(model, ids, lengths)
    assert [r.metrics["gemms"] for r in report.rewrites if r.pass_name == "unpad"] == [2], report.refusals
    _assert_packed_equals_eager(model, ids, lengths)


class ConvFfnResidualInPlace(nn.Module):
    """TiSASRec's point-wise FFN: Conv1d over the transposed tokens, then ``outputs += inputs`` on the conv's
    fresh output (an update of that output, not of the input it adds)."""

    def __init__(self, e=32):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, e), nn.Linear(e, 2 * e), nn.Linear(2 * e, e)
        self.conv = nn.Conv1d(e, e, 1)

    def forward(self, ids, lengths):
        valid = (torch.arange(ids.shape[1])[None, :] < lengths[:, None])[..., None]
        h = self.fc2(torch.relu(self.fc1(self.emb(ids)))) * valid
        outputs = self.conv(h.transpose(-1, -2)).transpose(-1, -2)
        outputs += h
        return outputs * valid


def test_a_residual_added_in_place_to_a_conv_output_is_no_update_of_the_input():
    model, (ids, lengths) = _seeded(ConvFfnResidualInPlace), _ids_and_lengths()
    report = explain(model, ids, lengths)
    reasons = [r.reason for r in report.refusals if r.pass_name == "unpad"]
    assert not any("updated in place" in r for r in reasons), reasons  # (conv1d was taken for a view of h)
    # (fc1, fc2 and the kernel-1 conv, a linear on the rows: unpad_transposed_rows.py)
    assert [r.metrics["gemms"] for r in report.rewrites if r.pass_name == "unpad"] == [3], reasons
    _assert_packed_equals_eager(model, ids, lengths)


class ScalarPerPositionMixed(nn.Module):
    """A per-position scalar signal (B, N) mixed across positions by Linear(N, N) (token mixing, MLP-Mixer
    style): the Linear contracts the sequence dim, so it is no token-wise op."""

    def __init__(self):
        super().__init__()
        self.mix, self.mix2 = nn.Linear(9, 9), nn.Linear(9, 9)

    def forward(self, ids, lengths):
        valid = (torch.arange(ids.size(1))[None, :] < lengths[:, None]).float()
        r = ids.float() * 0.1
        return (self.mix2(torch.relu(self.mix(r * valid))) * valid).sum(-1)


@pytest.mark.parametrize("lengths", [[9, 1, 0, 5], [3, 2, 0, 4]])
def test_a_linear_over_the_sequence_dim_of_a_per_position_tensor_stays_padded(lengths):
    """Linear on (B, N) reads all N positions of a row (packed, it ran on the (T,) vector: wrong values when T
    == N, Inductor's size assertion otherwise)."""
    model, (ids, _) = _seeded(ScalarPerPositionMixed), _ids_and_lengths()
    lengths = torch.tensor(lengths)
    report = explain(model, ids, lengths)
    assert not [r for r in report.rewrites if r.pass_name == "unpad"], report
    _assert_packed_equals_eager(model, ids, lengths)


class DropoutFfn(nn.Module):
    """A GELU FFN with dropout on its output, added to its input as FuxiCTR's BST writes the residual
    (``s = self.dropout(ffn(x)); s += x``) or out of place, zeroed by the row mask. Returns the output (and
    with ``with_ffn`` the FFN before dropout, to read which elements dropout kept)."""

    def __init__(self, p: float, in_place: bool, with_ffn: bool = False, e=32):
        super().__init__()
        self.in_place, self.with_ffn = in_place, with_ffn
        self.emb, self.fc1, self.fc2 = nn.Embedding(30, e), nn.Linear(e, 2 * e), nn.Linear(2 * e, e)
        self.dropout = nn.Dropout(p)

    def forward(self, ids, lengths):
        valid = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None])[..., None]
        x = self.emb(ids)
        f = self.fc2(F.gelu(self.fc1(x)))
        if self.in_place:
            s = self.dropout(f)
            s += x
        else:
            s = self.dropout(f) + x
        return (s * valid, f * valid) if self.with_ffn else s * valid


def _packed_gemms(model, *inputs) -> list[int]:
    return [r.metrics["gemms"] for r in explain(model, *inputs).rewrites if r.pass_name == "unpad"]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p, train", [(0.0, True), (0.3, False)])
def test_dropout_that_drops_nothing_packs_exactly(p, train, in_place):
    model, (ids, lengths) = _seeded(DropoutFfn, p, in_place).train(train), _ids_and_lengths()
    assert _packed_gemms(model, ids, lengths) == [2]
    _assert_packed_equals_eager(model, ids, lengths)


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_in_training_packs_and_drops_on_packed_rows(in_place):
    _check_dropout_on_packed_rows(in_place)


def test_dropout_draws_for_the_padded_rows_where_rand_like_does_not_trace(monkeypatch):
    """torch 2.11's rand_like guards on a data-dependent row count (its uniform_ decomposition): the packed
    dropout then draws for the padded rows and gathers the packed ones (unpad_dropout.uniform_like_packed)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    original = torch.rand_like

    def guarded(x, *args, **kwargs):
        if isinstance(x, FakeTensor) and free_unbacked_symbols(x.shape):
            raise RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)")
        return original(x, *args, **kwargs)

    monkeypatch.setattr(torch, "rand_like", guarded)
    _check_dropout_on_packed_rows(False)


def _check_dropout_on_packed_rows(in_place, compile_fn=None, device="cpu", atol=1e-5):
    """Dropout draws its own random mask compiled (``compile_fn``, the pre-grad passes under aot_eager by
    default; tests/gpu passes gem_compile): every element of the output is the FFN's scaled by 1 / (1 - p)
    where kept and 0 where dropped, plus the input; the gradients are eager's through that mask."""
    from tests.rewritten import rewritten

    p = 0.5
    model = _seeded(DropoutFfn, p, in_place, True).to(device).train()
    ids, lengths = (t.to(device) for t in _ids_and_lengths())
    assert _packed_gemms(model, ids, lengths) == [2]
    torch.manual_seed(1)
    out, f = (compile_fn or rewritten)(model)(ids, lengths)
    valid = (torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None])[..., None]
    x = model.emb(ids) * valid
    close = lambda a, b: (a - b).abs() <= atol + 1e-4 * b.abs()  # noqa: E731
    kept, dropped = close(out, x + f / (1 - p)), close(out, x)
    assert bool((kept | dropped).all()), "dropout's output is neither 0 nor the scaled input"
    kept &= ~dropped | (f == 0)
    share = kept[valid.expand_as(kept)].float().mean().item()
    assert 0.3 < share < 0.7, share  # (B x N x E = 360 valid draws at p 0.5)
    params = list(model.parameters())
    grads = torch.autograd.grad(out.square().sum(), params)
    with torch.no_grad():
        keep = kept.float() / (1 - p)
    x = model.emb(ids)  # (not the model in eval mode: its dropout would return f, which s += x updates)
    ref = (model.fc2(F.gelu(model.fc1(x))) * keep + x) * valid
    refs = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, atol=atol, rtol=1e-4)


class SingleHeadAttention(nn.Module):
    """Single-head SDPA with the head dim added by ``add`` and dropped by ``drop`` (``q[:, None]`` and
    ``o[:, 0]``, or unsqueeze / squeeze), the output projection zeroed at the padding and summed."""

    def __init__(self, add, drop):
        super().__init__()
        self.add, self.drop = add, drop
        self.q, self.k, self.v = nn.Linear(5, 16), nn.Linear(5, 16), nn.Linear(5, 16)
        self.o = nn.Linear(16, 16)

    def forward(self, x, lengths):
        valid = torch.arange(N)[None, :] < lengths[:, None]
        q, k, v = (self.add(p(x)) for p in (self.q, self.k, self.v))
        h = self.drop(F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :]))
        return (self.o(h) * valid[..., None]).sum(1)


HEAD_DIM_SPELLINGS = {
    "index_none_and_zero": (lambda t: t[:, None], lambda t: t[:, 0]),
    "index_with_ellipsis": (lambda t: t[:, None, ...], lambda t: t[:, 0, :, :]),
    "unsqueeze_squeeze": (lambda t: t.unsqueeze(1), lambda t: t.squeeze(1)),
}


@pytest.mark.parametrize("name", list(HEAD_DIM_SPELLINGS))
def test_a_head_dim_added_by_indexing_keeps_the_projections_packed(name):
    torch.manual_seed(0)
    model = SingleHeadAttention(*HEAD_DIM_SPELLINGS[name])
    lengths = torch.tensor([7, 1, 4])  # (eager's SDPA gives NaN for an empty row: no empty sequence here)
    assert sum(unpad_gemms_matching_eager(model, torch.randn(B, N, 5), lengths)) == 4
    assert not [r for r in explain(model, torch.randn(B, N, 5), lengths).refusals if r.pass_name == "unpad"]


class InPlaceResidualBlock(nn.Module):
    """An encoder block with the residuals added in place, as DSIN's PyTorch port and TF-style Transformers
    write them (``out += x`` on the attention output permuted back to (B, N, E); ``ff += out``), keys masked
    by the lengths, a masked mean. The updated tensors are fresh and seen by nothing else, so the updates are
    the out-of-place adds (attention/in_place.py, through the permute) and every GEMM packs. ``shared``: the
    attention output is read again after the update through its (B, H, N, d) form, so the update is seen and
    stays as written."""

    def __init__(self, in_place: bool, shared: bool = False, e=32, heads=2):
        super().__init__()
        self.in_place, self.shared, self.heads = in_place, shared, heads
        self.emb = nn.Embedding(30, e)
        self.q, self.k, self.v = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(e), nn.Linear(e, 2 * e), nn.Linear(2 * e, e)

    def forward(self, ids, lengths):
        x = self.emb(ids)
        B, N, E = x.shape
        mask = torch.arange(N)[None, :] < lengths[:, None]
        split = lambda t: t.view(B, N, self.heads, E // self.heads).permute(0, 2, 1, 3)  # noqa: E731
        s = (split(self.q(x)) @ split(self.k(x)).transpose(-1, -2)).masked_fill(~mask[:, None, None, :], -torch.inf)
        a = s.softmax(-1) @ split(self.v(x))
        out = a.permute(0, 2, 1, 3)
        if self.in_place:
            out += x.view(B, N, self.heads, E // self.heads)
        else:
            out = out + x.view(B, N, self.heads, E // self.heads)
        out = self.norm(out.reshape(B, N, E))
        ff = self.fc2(torch.relu(self.fc1(out)))
        if self.in_place:
            ff += out
        else:
            ff = ff + out
        pooled = (ff * mask[..., None]).sum(1) / lengths.clamp(min=1)[:, None]
        return pooled + a.mean((1, 2, 3))[:, None] if self.shared else pooled


@pytest.mark.parametrize("in_place", [False, True])
def test_residuals_added_in_place_pack_like_out_of_place(in_place):
    model, (ids, _) = _seeded(InPlaceResidualBlock, in_place), _ids_and_lengths()
    lengths = torch.tensor([9, 1, 3, 5])  # (-inf fill: eager is NaN on a sample with no valid key: none empty)
    assert _packed_gemms(model, ids, lengths) == [5]
    _assert_packed_equals_eager(model, ids, lengths)


def test_an_in_place_residual_on_an_output_read_again_matches_eager():
    model, (ids, _) = _seeded(InPlaceResidualBlock, True, True), _ids_and_lengths()
    _assert_packed_equals_eager(model, ids, torch.tensor([9, 1, 3, 5]))
