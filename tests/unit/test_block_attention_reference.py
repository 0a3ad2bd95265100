"""gemcompile::block_attention on CPU (the plain-PyTorch reference path): semantics and gradients against
float64 padded SDPA with an explicit boolean mask (rotary written out here, independently), opcheck,
input errors, FLOP counting and torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gemcompile.lowering  # noqa: F401  (registers the ops)
from gemcompile.lowering.block_attention.flops import block_attention_pairs, padded_block_attention_pairs
from gemcompile.lowering.block_attention.op import block_attention
from gemcompile.lowering.common.checks import kernel_supports

ops = torch.ops.gemcompile


# ---------------------------------------------------------------------------------------------------
# The eager model the pass rewrites: a padded bool mask and SDPA, rotary in plain PyTorch.


def eager_mask(lengths, L, block, window, causal):
    """(B, 1, L, L) bool, written per pair with loops' worth of clarity (broadcast comparisons)."""
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    ok = j < lengths[:, None, None]
    if block > 0:
        ok = ok & (i // block == j // block)
    if window >= 0:
        ok = ok & (j >= i - window) & (j <= i + window)
    if causal:
        ok = ok & (j <= i)
    return ok[:, None]


def eager_rotary(x, cos, sin, rotary):
    """x (B, H, L, D); cos/sin broadcastable to (B, 1, L, D) after adding the head axis."""
    if rotary == "none":
        return x
    D = x.shape[-1]
    cos = cos if cos.dim() == 4 else (cos[None] if cos.dim() == 2 else cos)[:, None]
    sin = sin if sin.dim() == 4 else (sin[None] if sin.dim() == 2 else sin)[:, None]
    if rotary == "half":
        rotated = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
    else:  # out[2i] = -x[2i+1], out[2i+1] = x[2i]
        rotated = torch.empty_like(x)
        rotated[..., 0::2] = -x[..., 1::2]
        rotated[..., 1::2] = x[..., 0::2]
    return x * cos + rotated * sin


def eager_block_attention(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale):
    L = q.shape[2]
    q, k = eager_rotary(q, cos, sin, rotary), eager_rotary(k, cos, sin, rotary)
    mask = eager_mask(lengths, L, block, window, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def make_case(B=4, H=2, L=37, D=16, dtype=torch.float64, seed=0, lengths=None, table_shape="shared"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    if lengths is None:
        rand = [int(x) for x in torch.randint(0, L + 1, (B,), generator=g)]
        lengths = torch.tensor([L, 0, 1, (L // 2) | 1] + rand)[:B]
    shape = {"shared": (L, D), "per_sample": (B, L, D), "4d": (1, 1, L, D)}[table_shape]
    theta = torch.randn(shape, generator=g, dtype=torch.float64)
    return q, k, v, lengths, theta.cos().to(dtype), theta.sin().to(dtype)


PATTERNS = [  # block, window, causal
    (8, -1, False),
    (16, -1, True),
    (0, 3, False),
    (0, 5, True),
    (8, 2, False),
    (12, -1, False),  # a block that is not a power of two
    (64, -1, False),  # a block larger than L
]


@pytest.mark.parametrize("block,window,causal", PATTERNS)
@pytest.mark.parametrize("rotary", ["none", "half", "interleaved"])
def test_matches_eager_sdpa_everywhere(block, window, causal, rotary):
    q, k, v, lengths, cos, sin = make_case(seed=block + window)
    if rotary == "none":
        cos = sin = None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ops.block_attention(*leaves, lengths, block, window, causal, cos, sin, rotary, 0.3)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = eager_block_attention(*ref_leaves, lengths, block, window, causal, cos, sin, rotary, 0.3)
    assert not ref.isnan().any()  # SDPA's safe softmax: rows without a key are 0
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # every row, padded ones too
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, ref_leaves, g)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("table_shape", ["per_sample", "4d"])
def test_table_shapes(table_shape):
    q, k, v, lengths, cos, sin = make_case(B=3, L=20, table_shape=table_shape, seed=3)
    if table_shape == "4d":
        cos, sin = cos.expand(3, 1, 20, 16), sin.expand(3, 1, 20, 16)  # a (B, 1, L, D) broadcast view
    out = ops.block_attention(q, k, v, lengths, 8, -1, False, cos, sin, "half", 0.25)
    ref = eager_block_attention(q, k, v, lengths, 8, -1, False, cos, sin, "half", 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_padded_rows_of_the_last_partial_block_see_its_keys():
    q, k, v, _, _, _ = make_case(B=1, H=1, L=16, seed=5)
    lengths = torch.tensor([5])
    out = ops.block_attention(q, k, v, lengths, 8, -1, False, None, None, "none", 0.3)
    assert (out[0, 0, 5:8] != 0).all()  # padded rows 5..7 share the block of keys 0..4
    assert (out[0, 0, 8:] == 0).all()  # the second block holds no valid key
    out = ops.block_attention(q, k, v, lengths, 0, 2, False, None, None, "none", 0.3)
    assert (out[0, 0, :7] != 0).all() and (out[0, 0, 7:] == 0).all()  # row 6 sees key 4 at distance 2


def test_lse_is_inf_exactly_on_rows_without_keys():
    q, k, v, lengths, _, _ = make_case(B=3, L=24, lengths=torch.tensor([24, 9, 0]), seed=6)
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 8, -1, False, None, None, "none", 0.3)
    has_key = eager_mask(lengths, 24, 8, -1, False).any(-1).expand_as(lse)
    assert torch.equal(torch.isposinf(lse), ~has_key)
    assert (out[~has_key] == 0).all()


def test_half_precision_inputs_compute_in_float32():
    q, k, v, lengths, cos, sin = make_case(dtype=torch.bfloat16, seed=7)
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 8, 3, True, cos, sin, "interleaved", 0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    d64 = [x.double() for x in (q, k, v, cos, sin)]
    ref = eager_block_attention(*d64[:3], lengths, 8, 3, True, *d64[3:], "interleaved", 0.3)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_gradcheck_float64():
    q, k, v, lengths, cos, sin = make_case(B=2, H=1, L=9, D=4, lengths=torch.tensor([9, 6]), seed=8)
    inputs = [x.requires_grad_(True) for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.block_attention(q, k, v, lengths, 4, 2, True, cos, sin, "half", 0.4),
        inputs,
        fast_mode=True,
    )


def test_eager_function_matches_the_ops():
    """The eager fast path (taken for plain CUDA tensors) computes what the custom ops compute; run here
    on CPU, where it uses the reference."""
    from gemcompile.lowering.block_attention.op import EagerBlockAttention

    q, k, v, lengths, cos, sin = make_case(seed=9)
    args = (lengths, 8, 4, False, cos, sin, "half", 0.3)
    a = [x.clone().requires_grad_(True) for x in (q, k, v)]
    b = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out_a = EagerBlockAttention.apply(*a, *args)
    out_b = ops.block_attention_fwd(*b, *args)[0]
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    g = torch.randn_like(out_a)
    for x, y in zip(torch.autograd.grad(out_a, a, g), torch.autograd.grad(out_b, b, g)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# opcheck


def _opcheck_cases():
    q, k, v, lengths, cos, sin = make_case(B=3, H=2, L=10, D=8, lengths=torch.tensor([10, 0, 7]), seed=4)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 4, -1, False, cos, sin, "half", 0.3)
    g = torch.randn_like(out)
    projected = torch.randn(3, 10, 3, 2, 8, dtype=torch.float64)  # (B, L, 3, H, D), as a projection makes
    pq, pk, pv = (x.transpose(1, 2).requires_grad_(True) for x in projected.unbind(2))  # (B, H, L, D) views
    return [
        ("fwd_block_rotary", ops.block_attention_fwd.default,
         (qr, kr, vr, lengths, 4, -1, False, cos, sin, "half", 0.3)),
        ("fwd_window_causal", ops.block_attention_fwd.default,
         (qr, kr, vr, lengths, 0, 2, True, None, None, "none", 0.3)),
        ("fwd_permuted_views", ops.block_attention_fwd.default,
         (pq, pk, pv, lengths, 4, 1, False, None, None, "none", 0.3)),
        ("bwd", ops.block_attention_bwd.default,
         (g, q, k, v, out, lse, lengths, 4, -1, False, cos, sin, "half", 0.3)),
        ("public", ops.block_attention.default,
         (qr, kr, vr, lengths, 4, 3, True, cos[None], sin[None], "interleaved", 0.3)),
        ("fwd_q_lengths", ops.block_attention_fwd.default,
         (qr, kr, vr, lengths, 4, 1, False, cos, sin, "half", 0.3, None, None, torch.tensor([5, 0, 10]))),
        ("bwd_q_lengths", ops.block_attention_bwd.default,
         (g, q, k, v, out, lse, lengths, 4, -1, False, cos, sin, "half", 0.3, None, None, lengths)),
    ]


def test_q_lengths_skip_the_rows_a_model_zeroes():
    """Rows i >= q_lengths[b] come out 0 and the others as without q_lengths, so a model that zeroes those
    rows afterwards gets the same outputs and gradients (what the pass folds, passes/masks/rows.py)."""
    q, k, v, lengths, cos, sin = make_case(B=3, H=2, L=10, D=8, lengths=torch.tensor([10, 0, 7]), seed=5)
    q_lengths = torch.tensor([6, 3, 10])  # fewer, more and as many rows as keys
    rows = (torch.arange(10)[None, :] < q_lengths[:, None])[:, None, :, None]
    w = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for given in (q_lengths, None):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = ops.block_attention(*leaves, lengths, 4, 1, False, cos, sin, "half", 0.3, None, None, given)
        if given is not None:
            assert (out[~rows.expand_as(out)] == 0).all()
        masked = out * rows
        grads.append((masked, torch.autograd.grad((masked * w).sum(), leaves)))
    (got, got_grads), (want, want_grads) = grads
    torch.testing.assert_close(got, want)
    for g, g_ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g, g_ref)
    assert (got_grads[0][~rows.expand_as(q)] == 0).all()  # dq of the skipped rows


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


# ---------------------------------------------------------------------------------------------------
# Errors


def _args(**over):
    q, k, v, lengths, cos, sin = make_case(B=2, L=8, D=16, lengths=torch.tensor([8, 3]))
    args = {"q": q, "k": k, "v": v, "lengths": lengths, "block": 4, "window": -1, "causal": False,
            "cos": cos, "sin": sin, "rotary": "half", "scale": 0.25}
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,error,match",
    [
        ({"q": torch.randn(2, 8, 16, dtype=torch.float64)}, ValueError, "q must be 4-D"),
        ({"k": torch.randn(2, 2, 9, 16, dtype=torch.float64)}, ValueError, "one shape"),
        ({"v": torch.randn(2, 2, 8, 16)}, TypeError, "one dtype"),
        ({"q": torch.randn(2, 2, 8, 16).int()}, TypeError, "q must be float16"),
        ({"rotary": "rope"}, ValueError, "rotary must be one of"),
        ({"cos": torch.randn(8, 8, dtype=torch.float64)}, ValueError, "cos must be"),
        ({"sin": torch.randn(3, 8, 16, dtype=torch.float64)}, ValueError, "sin must be"),
        ({"sin": torch.randn(2, 2, 8, 16, dtype=torch.float64)}, ValueError, "sin must be"),
        ({"cos": None}, TypeError, "cos must be a torch.Tensor"),
        ({"rotary": "none"}, ValueError, "must be None when rotary is 'none'"),
        ({"block": -1}, ValueError, "block must be >= 0"),
        ({"window": -2}, ValueError, "window must be >= -1"),
        ({"block": 0, "window": -1}, ValueError, "jagged_attention"),
        ({"block": True}, TypeError, "block must be an int"),
        ({"lengths": torch.tensor([8, 3, 1])}, ValueError, "lengths must be 1-D of size B"),
        ({"lengths": torch.tensor([8.0, 3.0])}, TypeError, "int32 or int64"),
        ({"lengths": torch.tensor([9, 3])}, ValueError, r"lengths\[0\] = 9 is outside"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
    ],
)
def test_bad_inputs_raise_clear_errors(over, error, match):
    args = _args(**over)
    with pytest.raises(error, match=match):
        block_attention(**args)
    if isinstance(args["block"], bool) or not isinstance(args["causal"], bool):
        return  # the dispatcher converts or rejects these before our checks run
    with pytest.raises(error, match=match):
        ops.block_attention(*args.values())


def test_odd_head_dim_with_rotary():
    q = torch.randn(2, 1, 8, 15, dtype=torch.float64)
    table = torch.randn(8, 15, dtype=torch.float64)
    with pytest.raises(ValueError, match="even head dim"):
        block_attention(q, q, q, torch.tensor([8, 3]), 4, cos=table, sin=table, rotary="half")
    out = block_attention(q, q, q, torch.tensor([8, 3]), 4)  # without rotary any head dim runs here
    assert out.shape == q.shape


def test_tables_that_require_grad_are_refused():
    args = _args()
    args["cos"] = args["cos"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="cos requires grad"):
        block_attention(**args)
    with torch.no_grad():
        block_attention(**args)  # nothing to differentiate: fine


def test_kernel_supports():
    assert kernel_supports(64, -1, 64) is None
    assert kernel_supports(0, 128, 128) is None
    assert kernel_supports(48, 7, 16) is None  # any block and window
    assert "power of two" in kernel_supports(64, -1, 96)
    assert "power of two" in kernel_supports(64, -1, 256)
    assert "jagged_attention" in kernel_supports(0, -1, 64)
    assert kernel_supports(-1, -1, 64) is not None


# ---------------------------------------------------------------------------------------------------
# FLOPs


@pytest.mark.parametrize("block,window,causal", PATTERNS + [(1, -1, True), (5, 0, False)])
def test_pair_count_matches_the_mask(block, window, causal):
    L = 37
    lengths = torch.tensor([0, 1, 5, 16, 17, 36, 37, 40])
    valid_rows = torch.arange(L)[None, :] < lengths.clamp(max=L)[:, None]
    mask = eager_mask(lengths.clamp(max=L), L, block, window, causal)[:, 0] & valid_rows[:, :, None]
    assert block_attention_pairs(lengths, L, block, window, causal) == int(mask.sum())
    full = eager_mask(torch.full((3,), L), L, block, window, causal).sum()
    assert padded_block_attention_pairs(3, L, block, window, causal) == int(full)


def test_flop_counter_counts_useful_pairs():
    lengths = torch.tensor([32, 0, 9, 17])
    q, k, v, lengths, cos, sin = make_case(B=4, H=2, L=32, D=16, lengths=lengths, seed=11)
    q.requires_grad_(True)
    pairs = block_attention_pairs(lengths, 32, 8, 3, True)
    with FlopCounterMode(display=False) as counter:
        ops.block_attention(q, k, v, lengths, 8, 3, True, cos, sin, "half", 0.3).sum().backward()
    assert counter.get_total_flops() == int(3.5 * 4 * 2 * 16 * pairs)


# ---------------------------------------------------------------------------------------------------
# torch.compile


def test_compile_fullgraph_without_recompiles():
    B, H, L, D = 3, 2, 24, 16
    q, k, v, _, cos, sin = make_case(B, H, L, D, seed=12)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def f(q, k, v, lengths):
        return ops.block_attention(q, k, v, lengths, 8, 4, False, cos, sin, "half", 0.3).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            lengths = torch.randint(0, L + 1, (B,), generator=torch.Generator().manual_seed(seed))
            got = torch.autograd.grad(compiled(*leaves, lengths), leaves)
            want = torch.autograd.grad(f(*leaves, lengths), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------
# kv_mask: keys j with kv_mask[b, j] False take no part (positions stay absolute)

MASK_KINDS = ["holes", "left_padding", "right_padding", "empty_row", "all_true", "expanded"]


def make_kv_mask(kind, B, L, seed=0):
    """(B, L) bool key mask of one kind; "expanded" is a (1, L) mask expanded to (B, L) (batch stride 0)."""
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(L)[None, :]
    if kind == "holes":
        return torch.rand(B, L, generator=g) > 0.4
    if kind == "left_padding":  # a valid suffix
        return j >= torch.randint(0, L + 1, (B, 1), generator=g)
    if kind == "right_padding":
        return j < torch.randint(0, L + 1, (B, 1), generator=g)
    if kind == "empty_row":
        mask = torch.rand(B, L, generator=g) > 0.3
        mask[1] = False
        return mask
    if kind == "all_true":
        return torch.ones(B, L, dtype=torch.bool)
    if kind == "expanded":
        return (torch.rand(1, L, generator=g) > 0.3).expand(B, L)
    raise ValueError(kind)


def eager_masked_attention(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask):
    L = q.shape[2]
    q, k = eager_rotary(q, cos, sin, rotary), eager_rotary(k, cos, sin, rotary)
    mask = eager_mask(lengths, L, block, window, causal) & kv_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


KV_MASK_PATTERNS = [(8, -1, False), (16, -1, True), (0, 3, False), (8, 2, True), (12, -1, False)]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("block,window,causal", KV_MASK_PATTERNS)
@pytest.mark.parametrize("rotary", ["none", "half"])
def test_kv_mask_matches_eager_sdpa(kind, block, window, causal, rotary):
    q, k, v, lengths, cos, sin = make_case(seed=block + window + 40)
    if rotary == "none":
        cos = sin = None
    kv_mask = make_kv_mask(kind, 4, 37, seed=block + 3)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ops.block_attention(*leaves, lengths, block, window, causal, cos, sin, rotary, 0.3, kv_mask)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = eager_masked_attention(*ref_leaves, lengths, block, window, causal, cos, sin, rotary, 0.3, kv_mask)
    assert not ref.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, ref_leaves, g)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    dropped = (~kv_mask)[:, None, :, None].expand_as(got[1])
    assert (got[1][dropped] == 0).all() and (got[2][dropped] == 0).all()  # exactly zero, not just small


def test_kv_mask_all_true_equals_no_mask_and_empty_row_is_zero():
    q, k, v, lengths, _, _ = make_case(seed=41)
    args = (lengths, 8, 3, False, None, None, "none", 0.3)
    out, lse = ops.block_attention_fwd(q, k, v, *args)
    out_t, lse_t = ops.block_attention_fwd(q, k, v, *args, torch.ones(4, 37, dtype=torch.bool))
    torch.testing.assert_close(out_t, out, rtol=0, atol=1e-15)
    assert torch.equal(torch.isposinf(lse_t), torch.isposinf(lse))
    mask = make_kv_mask("empty_row", 4, 37)
    out_e, lse_e = ops.block_attention_fwd(q, k, v, *args, mask)
    assert (out_e[1] == 0).all() and torch.isposinf(lse_e[1]).all()


def test_kv_mask_positions_stay_absolute():
    """Left padding does not shift positions: a causal row i still sees keys j <= i by absolute index."""
    q, k, v, _, _, _ = make_case(B=1, H=1, L=16, seed=42)
    lengths = torch.tensor([16])
    mask = torch.arange(16)[None, :] >= 5
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 8, -1, True, None, None, "none", 0.3, mask)
    assert torch.isposinf(lse[0, 0, :5]).all() and (out[0, 0, :5] == 0).all()  # rows 0..4 see no key
    assert torch.isfinite(lse[0, 0, 5:]).all()


def test_kv_mask_garbage_in_dropped_keys_never_leaks():
    q, k, v, lengths, cos, sin = make_case(seed=43)
    mask = make_kv_mask("holes", 4, 37, seed=1)
    drop = (~mask)[:, None, :, None]
    args = (lengths, 8, 2, False, cos, sin, "half", 0.3, mask)
    clean = ops.block_attention(q, k, v, *args)
    dirty_k, dirty_v = k.masked_fill(drop, float("nan")), v.masked_fill(drop, float("inf"))
    dirty = ops.block_attention(q, dirty_k, dirty_v, *args)
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_kv_mask_eager_function_matches_the_ops():
    from gemcompile.lowering.block_attention.op import EagerBlockAttention

    q, k, v, lengths, cos, sin = make_case(seed=44)
    args = (lengths, 8, 4, True, cos, sin, "half", 0.3, make_kv_mask("holes", 4, 37))
    a = [x.clone().requires_grad_(True) for x in (q, k, v)]
    b = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out_a = EagerBlockAttention.apply(*a, *args)
    out_b = ops.block_attention_fwd(*b, *args)[0]
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    g = torch.randn_like(out_a)
    for x, y in zip(torch.autograd.grad(out_a, a, g), torch.autograd.grad(out_b, b, g)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_kv_mask_gradcheck_float64():
    q, k, v, lengths, cos, sin = make_case(B=2, H=1, L=9, D=4, lengths=torch.tensor([9, 6]), seed=45)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    inputs = [x.requires_grad_(True) for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.block_attention(q, k, v, lengths, 4, 2, True, cos, sin, "half", 0.4, mask),
        inputs,
        fast_mode=True,
    )


def _kv_mask_opcheck_cases():
    q, k, v, lengths, cos, sin = make_case(B=3, H=2, L=10, D=8, lengths=torch.tensor([10, 0, 7]), seed=46)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    mask = make_kv_mask("holes", 3, 10, seed=2)
    expanded = make_kv_mask("expanded", 3, 10, seed=3)
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 4, -1, False, cos, sin, "half", 0.3, mask)
    g = torch.randn_like(out)
    return [
        ("fwd", ops.block_attention_fwd.default,
         (qr, kr, vr, lengths, 4, -1, False, cos, sin, "half", 0.3, mask)),
        ("fwd_expanded", ops.block_attention_fwd.default,
         (qr, kr, vr, lengths, 0, 2, True, None, None, "none", 0.3, expanded)),
        ("bwd", ops.block_attention_bwd.default,
         (g, q, k, v, out, lse, lengths, 4, -1, False, cos, sin, "half", 0.3, mask)),
        ("public", ops.block_attention.default,
         (qr, kr, vr, lengths, 4, 3, True, cos[None], sin[None], "interleaved", 0.3, mask)),
        ("public_expanded", ops.block_attention.default,
         (qr, kr, vr, lengths, 4, -1, False, None, None, "none", 0.3, expanded)),
    ]


@pytest.mark.parametrize("case", _kv_mask_opcheck_cases(), ids=lambda c: c[0])
def test_kv_mask_opcheck(case):
    _, op, args = case
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize(
    "mask,match",
    [
        (torch.ones(2, 8, dtype=torch.uint8), "kv_mask must be a torch.bool"),
        (torch.ones(2, 9, dtype=torch.bool), r"kv_mask must have shape \(B, Lk\)"),
        (torch.ones(1, 8, dtype=torch.bool), r"kv_mask must have shape \(B, Lk\)"),
        (torch.ones(2, 1, 8, dtype=torch.bool), r"kv_mask must have shape \(B, Lk\)"),
        (torch.ones(2, 8, dtype=torch.bool, device="meta"), "kv_mask is on meta"),
        ([[True] * 8] * 2, "kv_mask must be a torch.Tensor"),
    ],
)
def test_kv_mask_bad_inputs_raise(mask, match):
    args = _args(kv_mask=mask)
    with pytest.raises(TypeError if isinstance(mask, list) else ValueError, match=match):
        block_attention(**args)
    if isinstance(mask, torch.Tensor):
        with pytest.raises(ValueError, match=match):
            ops.block_attention(*args.values())


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("block,window,causal", PATTERNS + [(1, -1, True), (5, 0, False)])
def test_kv_mask_pair_count_matches_the_mask(kind, block, window, causal):
    L = 37
    lengths = torch.tensor([0, 1, 5, 16, 17, 36, 37, 40])
    kv_mask = make_kv_mask(kind, 8, L, seed=block)
    valid_rows = torch.arange(L)[None, :] < lengths.clamp(max=L)[:, None]
    mask = eager_mask(lengths.clamp(max=L), L, block, window, causal)[:, 0] & valid_rows[:, :, None]
    mask = mask & kv_mask[:, None, :]
    assert block_attention_pairs(lengths, L, block, window, causal, kv_mask) == int(mask.sum())


def test_kv_mask_flop_counter_counts_useful_pairs():
    lengths = torch.tensor([32, 0, 9, 17])
    q, k, v, lengths, cos, sin = make_case(B=4, H=2, L=32, D=16, lengths=lengths, seed=47)
    q.requires_grad_(True)
    mask = make_kv_mask("holes", 4, 32, seed=5)
    pairs = block_attention_pairs(lengths, 32, 8, 3, True, mask)
    assert pairs < block_attention_pairs(lengths, 32, 8, 3, True)
    with FlopCounterMode(display=False) as counter:
        ops.block_attention(q, k, v, lengths, 8, 3, True, cos, sin, "half", 0.3, mask).sum().backward()
    assert counter.get_total_flops() == int(3.5 * 4 * 2 * 16 * pairs)


def test_kv_mask_compile_fullgraph_without_recompiles():
    B, H, L, D = 3, 2, 24, 16
    q, k, v, lengths, cos, sin = make_case(B, H, L, D, seed=48)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def f(q, k, v, mask):
        return ops.block_attention(q, k, v, lengths, 8, 4, False, cos, sin, "half", 0.3, mask).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            mask = make_kv_mask("holes", B, L, seed=seed)
            got = torch.autograd.grad(compiled(*leaves, mask), leaves)
            want = torch.autograd.grad(f(*leaves, mask), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
