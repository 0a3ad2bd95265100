"""gemcompile::block_attention on CUDA (the Triton kernels) against the float64 reference.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_block_attention_gpu.py
Most tests pin one config per kernel (``single_config``) so that they compile few kernel variants;
``test_every_autotune_config`` checks each config of the autotune lists for the benchmark's variants
(bf16, block 64, D 64 and 128, with and without rotary), which also warms the Triton cache for
benchmarks/block_attention.py.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import triton
from kernel_checks import pin_tiles, rel

import gemcompile.lowering  # noqa: F401
from gemcompile.lowering.block_attention import triton as kernels
from gemcompile.lowering.block_attention.op import block_attention
from gemcompile.lowering.block_attention.flops import block_attention_pairs
from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward
from gemcompile.lowering.common.checks import strict_length_checks

ops = torch.ops.gemcompile
DEV = "cuda"
# relative-norm error bounds (forward, backward) against float64 math on the same (rounded) inputs
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (3e-3, 8e-3),
    torch.bfloat16: (1.5e-2, 3e-2),
}


def _pin(monkeypatch, closed_fwd, closed_bwd, fwd, dkdv, dq):
    tables = (kernels._CLOSED_FWD_SHAPES, kernels._CLOSED_BWD_SHAPES)
    for kernel, shape, table in zip((kernels._closed_fwd_kernel, kernels._closed_bwd_kernel),
                                    (closed_fwd, closed_bwd), tables):
        # a shape-table key: (BLOCK, warps) or (BLOCK, warps, HEADS), built as the kernels' own list builds it
        monkeypatch.setattr(kernel, "configs", kernels._closed_configs({shape: ()}))
        if shape in table:  # listed for some variants only: it would not serve the others (general kernels)
            monkeypatch.setitem(table, shape, (kernels._S, kernels._SR, kernels._L, kernels._LR))
    pin_tiles(monkeypatch, {kernels._fwd_kernel: fwd, kernels._bwd_dkdv_kernel: dkdv,
                            kernels._bwd_dq_kernel: dq})


@pytest.fixture
def single_config(monkeypatch):
    """One config per kernel that compiles without spills for every head dim, rotary mode and half dtype
    (closed tiles of 64 rows: blocks up to 64 take the closed kernels, 128 the general ones)."""
    _pin(monkeypatch, (64, 8), (64, 8), (64, 32, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2))
    assert all(kernels.closed_tile_serves(64, D, rotary) for D in (32, 64, 128)
               for rotary in ("none", "half", "interleaved"))


def draw_lengths(B, L, g):
    """0, 1, L, odd, L - 1, then uniform: every special case in every batch."""
    special = [0, 1, L, (L // 2) | 1, L - 1]
    rand = torch.randint(0, L + 1, (B,), generator=g)
    return torch.tensor([special[i] if i < len(special) else int(rand[i]) for i in range(B)])


def make_case(B, H, L, D, dtype, tables="shared", seed=0, table_dtype=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(DEV, dtype) for _ in range(3))
    lengths = draw_lengths(B, L, g).to(DEV)
    cos = sin = None
    if tables != "none":
        # real RoPE tables: angle = position * inverse frequency, duplicated into both halves / pairs
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]
        if tables == "interleaved_tables":  # each frequency on a pair of neighbouring columns
            angle = angle.repeat_interleave(2, -1)
        else:  # each frequency in both halves
            angle = torch.cat((angle, angle), -1)
        if tables == "per_sample":  # e.g. positions shifted per sample
            angle = angle[None] + torch.rand(B, 1, D, generator=g, dtype=torch.float64)
        cos, sin = (f(angle).to(DEV, table_dtype or dtype) for f in (torch.cos, torch.sin))
    return q, k, v, lengths, cos, sin


def run_op(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, grad_out, kv_mask=None,
           q_lengths=None):
    # detach (not clone): permuted and expanded views must reach the op with their strides
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = ops.block_attention(*leaves, lengths, block, window, causal, cos, sin, rotary, scale, kv_mask, None,
                              q_lengths)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


def check_case(q, k, v, lengths, block, window, causal, cos, sin, rotary, seed=1, kv_mask=None,
               q_lengths=None):
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)
    out, grads = run_op(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale, grad_out, kv_mask,
                        q_lengths)
    d64 = [x.double() for x in (q, k, v)]
    t64 = [None if t is None else t.double() for t in (cos, sin)]
    ref_out, ref_lse = reference_forward(*d64, lengths, block, window, causal, *t64, rotary, scale, kv_mask,
                                         q_lengths=q_lengths)
    ref = reference_backward(grad_out.double(), *d64, ref_out, ref_lse, lengths, block, window, causal, *t64,
                             rotary, scale, kv_mask, q_lengths=q_lengths)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    empty = torch.isposinf(ref_lse)
    assert (out[empty] == 0).all()  # rows without an allowed key are exactly zero
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert not got.isnan().any(), name
        assert rel(got, want) < bwd_tol, (name, rel(got, want))
    if kv_mask is not None:  # keys the mask drops get exactly zero dK and dV
        dropped = (~kv_mask)[:, None, :, None].expand_as(grads[1])
        assert (grads[1][dropped] == 0).all() and (grads[2][dropped] == 0).all()


CASES = [  # dtype, D, L, block, window, causal, rotary, tables
    (torch.bfloat16, 64, 4096, 64, -1, False, "half", "shared"),  # the benchmark's case
    (torch.bfloat16, 128, 2048, 64, -1, True, "interleaved", "per_sample"),
    (torch.bfloat16, 64, 1000, 16, -1, False, "none", "none"),  # four blocks per 64-row tile
    (torch.bfloat16, 128, 1024, 32, 8, False, "half", "shared"),  # block and window
    (torch.bfloat16, 64, 777, 128, -1, False, "half", "shared"),  # general kernels: block > tile
    (torch.bfloat16, 128, 1500, 128, -1, True, "none", "none"),
    (torch.bfloat16, 64, 2048, 0, 256, True, "half", "shared"),  # sliding window
    (torch.bfloat16, 128, 1024, 0, 64, False, "interleaved", "per_sample"),
    (torch.bfloat16, 64, 1000, 48, -1, False, "none", "none"),  # a block that is not a power of two
    (torch.float16, 32, 1024, 64, -1, False, "half", "shared"),
    (torch.float16, 16, 512, 32, 5, False, "half", "per_sample"),  # D = 16: rotary applied around the kernels
    (torch.float32, 64, 600, 64, -1, False, "interleaved", "shared"),
    (torch.float32, 128, 512, 0, 33, True, "none", "none"),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (f"{str(c[0])[6:]}-D{c[1]}-L{c[2]}-block{c[3]}-w{c[4]}-{'causal' if c[5] else 'full'}"
                   f"-{c[6]}"),
)
def test_matches_float64_reference(single_config, case):
    dtype, D, L, block, window, causal, rotary, tables = case
    if rotary == "interleaved" and tables == "shared":
        tables = "interleaved_tables"
    q, k, v, lengths, cos, sin = make_case(7, 2, L, D, dtype, tables, seed=D + L)
    check_case(q, k, v, lengths, block, window, causal, cos, sin, rotary)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=["closed", "closed_window", "general"])
def test_q_lengths_skip_rows(single_config, case):
    """Rows past q_lengths (what the pass gives when the model zeroes them afterwards) are 0 with zero dq;
    the other rows and dk, dv match the reference, for q_lengths equal to, below and above the lengths."""
    dtype, D, L, block, window, causal, rotary, tables = case
    q, k, v, lengths, cos, sin = make_case(6, 2, L, D, dtype, tables, seed=L + 1)
    for q_lengths in (lengths, (lengths.flip(0) * 3) // 4):
        check_case(q, k, v, lengths, block, window, causal, cos, sin, rotary, q_lengths=q_lengths)
    skipped = (torch.arange(L, device=DEV)[None, :] >= q_lengths[:, None])[:, None, :, None].expand_as(q)
    grad_out = torch.randn(q.shape, device=DEV, dtype=dtype)
    out, (dq, _, _) = run_op(q, k, v, lengths, block, window, causal, cos, sin, rotary, 0.125, grad_out,
                             q_lengths=q_lengths)
    assert (out[skipped] == 0).all() and (dq[skipped] == 0).all()


def test_float32_tables_with_bf16_inputs(single_config):
    q, k, v, lengths, cos, sin = make_case(5, 2, 700, 64, torch.bfloat16, seed=3, table_dtype=torch.float32)
    check_case(q, k, v, lengths, 64, -1, False, cos, sin, "half")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rotary", ["none", "half"])
def test_every_autotune_config(monkeypatch, D, rotary):
    """Each closed-kernel config the autotuner may pick for the benchmark's variants (bf16, block 64)."""
    variant = kernels._variant(D, kernels.ROTARY_CODES[rotary])
    fwd = [c for c, kinds in kernels._CLOSED_FWD_SHAPES.items() if variant in kinds and c[0] % 64 == 0]
    bwd = [c for c, kinds in kernels._CLOSED_BWD_SHAPES.items() if variant in kinds and c[0] % 64 == 0]
    tables = "none" if rotary == "none" else "shared"
    q, k, v, lengths, cos, sin = make_case(6, 2, 1024, D, torch.bfloat16, tables, seed=D)
    for i in range(max(len(fwd), len(bwd))):
        general = ((64, 32, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2))
        _pin(monkeypatch, fwd[i % len(fwd)], bwd[i % len(bwd)], *general)
        check_case(q, k, v, lengths, 64, -1, False, cos, sin, rotary)


def _pin_closed(monkeypatch, bwd, D, rotary, fwd=None):
    """The closed backward pinned to one config (an option outside the default lists), the forward to fwd
    (default (64, 8 warps)). Each is listed for every variant while pinned, else a config the table gives
    other variants only would route this one to the general kernels."""
    fwd = fwd or triton.Config({"BLOCK": 64, "HEADS": 1}, num_warps=8, num_stages=1)
    for table, cfg in ((kernels._CLOSED_FWD_SHAPES, fwd), (kernels._CLOSED_BWD_SHAPES, bwd)):
        every = (kernels._S, kernels._SR, kernels._L, kernels._LR)
        monkeypatch.setitem(table, kernels._closed_shape(cfg), every)
    monkeypatch.setattr(kernels._closed_fwd_kernel, "configs", [fwd])
    monkeypatch.setattr(kernels._closed_bwd_kernel, "configs", [bwd])
    assert kernels.closed_tile_serves(64, D, rotary)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rotary", ["half", "interleaved"])
@pytest.mark.parametrize("warps,heads,stages", [(8, 1, 1), (8, 2, 2), (4, 1, 1)])
def test_closed_backward_partner_swap_without_gather(monkeypatch, D, rotary, warps, heads, stages):
    """R_SPLIT (the closed backward's R^T by reshapes and a split, an autotune option not in the default
    lists): Triton's layouts for it, on the GPU, against the float64 reference, at the configs the config
    sweep (benchmarks/block_closed_configs.py) times, on rows whose stride is not a multiple of 16 elements
    (q, k, v sliced from a wider tensor)."""
    _pin_closed(monkeypatch, triton.Config({"BLOCK": 64, "HEADS": heads, "R_SPLIT": 1}, num_warps=warps,
                                           num_stages=stages), D, rotary)
    q, k, v, lengths, cos, sin = make_case(5, 3, 520, D + 8, torch.bfloat16, "per_sample", seed=D)
    q, k, v = (x[..., :D] for x in (q, k, v))
    cos, sin = (t[..., :D] for t in (cos, sin))
    check_case(q, k, v, lengths, 64, -1, False, cos, sin, rotary)


# (warps, HEADS, stages, TILES) that fit a CTA's shared memory (ptxas for sm_90a): with rotary at D 128,
# three stages do not
_TILES_CONFIGS = [(D, rotary, c) for D in (64, 128) for rotary in ("none", "half")
                  for c in ((8, 4, 3, 2), (8, 1, 3, 4), (8, 1, 1, 3))
                  if not (D == 128 and rotary != "none" and c[2] == 3)]


@pytest.mark.parametrize("D,rotary,config", _TILES_CONFIGS)
def test_closed_kernels_tiles_per_program(monkeypatch, D, rotary, config):
    """TILES (the closed kernels' one pipelined loop over tiles x heads, an autotune option not in the
    default lists) on the GPU against the float64 reference, at configs the config sweep times; L not a
    multiple of TILES tiles, so the last program holds tiles past L."""
    warps, heads, stages, tiles = config
    fwd = triton.Config({"BLOCK": 64, "HEADS": 1, "TILES": tiles}, num_warps=4, num_stages=2)
    _pin_closed(monkeypatch, triton.Config({"BLOCK": 64, "HEADS": heads, "TILES": tiles}, num_warps=warps,
                                           num_stages=stages), D, rotary, fwd)
    tables = "none" if rotary == "none" else "per_sample"
    q, k, v, lengths, cos, sin = make_case(5, 3, 520, D, torch.bfloat16, tables, seed=D + tiles)
    check_case(q, k, v, lengths, 64, -1, False, cos, sin, rotary)


def test_backward_is_deterministic(single_config):
    q, k, v, lengths, cos, sin = make_case(5, 2, 900, 64, torch.bfloat16, seed=4)
    g = torch.randn_like(q)
    for block, window in ((64, -1), (0, 100)):
        args = (lengths, block, window, True, cos, sin, "half", 0.125)
        first = run_op(q, k, v, *args, g)
        second = run_op(q, k, v, *args, g)
        assert torch.equal(first[0], second[0])
        for a, b in zip(first[1], second[1]):
            assert torch.equal(a, b)


def test_zero_lengths_give_zeros_not_nan(single_config):
    q, k, v, _, cos, sin = make_case(4, 2, 256, 64, torch.float16, seed=5)
    zeros = torch.zeros(4, dtype=torch.int32, device=DEV)
    g = torch.randn_like(q)
    for block, window in ((64, -1), (0, 9), (128, -1)):
        out, grads = run_op(q, k, v, zeros, block, window, False, cos, sin, "half", 0.125, g)
        assert (out == 0).all()
        assert all((x == 0).all() for x in grads)


def test_permuted_views(single_config):
    """q, k, v as (B, H, L, D) views of a (B, L, 3, H, D) projection, read in place."""
    B, L, H, D = 5, 700, 4, 64
    x = torch.randn(B, L, 3, H, D, device=DEV, dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
    assert not q.is_contiguous()
    _, _, _, lengths, cos, sin = make_case(B, H, L, D, torch.bfloat16, seed=6)
    check_case(q, k, v, lengths, 64, -1, False, cos, sin, "interleaved")
    check_case(q, k, v, lengths, 0, 50, True, None, None, "none")


def test_no_host_sync(single_config):
    q, k, v, lengths, cos, sin = make_case(6, 2, 1024, 64, torch.bfloat16, seed=7)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def step():
        grads = []
        for block, window in ((64, -1), (0, 128)):
            out = ops.block_attention(*leaves, lengths, block, window, False, cos, sin, "half", 0.125)
            grads += torch.autograd.grad(out, leaves, torch.ones_like(out))
        return grads

    step()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compile_fullgraph_no_recompile(single_config):
    B, H, L, D = 6, 2, 512, 64
    q, k, v, _, cos, sin = make_case(B, H, L, D, torch.bfloat16, seed=8)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def f(q, k, v, lengths):
        out = ops.block_attention(q, k, v, lengths, 64, -1, False, cos, sin, "half", 0.125)
        return out.float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            lengths = torch.randint(0, L + 1, (B,), generator=torch.Generator().manual_seed(seed)).to(DEV)
            got = torch.autograd.grad(compiled(*leaves, lengths), leaves)
            want = torch.autograd.grad(f(*leaves, lengths), leaves)
            for a, b in zip(got, want):
                assert rel(a, b) < 1e-2


def test_eager_path_and_custom_ops_agree_bitwise(single_config):
    """Plain eager calls take the autograd.Function fast path; traced calls take the custom ops. Same
    kernels, deterministic: the results must be identical."""
    from gemcompile.lowering.common.opkit import takes_eager_path

    q, k, v, lengths, cos, sin = make_case(5, 2, 600, 64, torch.bfloat16, seed=9)
    assert takes_eager_path(q)
    g = torch.randn_like(q)
    args = (lengths, 64, 16, True, cos, sin, "half", 0.125)

    def grads(call):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = call(*leaves)
        return (out, *torch.autograd.grad(out, leaves, g))

    fast = grads(lambda q, k, v: ops.block_attention(q, k, v, *args))
    via_ops = grads(lambda q, k, v: ops.block_attention_fwd(q, k, v, *args)[0])
    for a, b in zip(fast, via_ops):
        assert torch.equal(a, b)


def test_int64_addressing_beyond_2_31_elements(single_config):
    """Tensors with more than 2**31 elements: sequence bases need int64 offsets."""
    B, H, L, D = 4100, 4, 1024, 128  # 2.15e9 elements per tensor (4.3 GB in bf16)
    q = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    lengths = torch.randint(0, 9, (B,), device=DEV)
    lengths[-1] = L
    lengths[-2] = 333
    out, lse = ops.block_attention_fwd(q, k, v, lengths, 64, -1, False, None, None, "none", D**-0.5)
    tail = slice(B - 2, B)
    d64 = [x[tail].double() for x in (q, k, v)]
    ref, ref_lse = reference_forward(*d64, lengths[tail], 64, -1, False, None, None, "none", D**-0.5)
    assert rel(out[tail], ref) < TOL[torch.bfloat16][0]
    g = torch.randn_like(out)
    dq, dk, dv = ops.block_attention_bwd(g, q, k, v, out, lse, lengths, 64, -1, False, None, None, "none",
                                         D**-0.5)
    want = reference_backward(g[tail].double(), *d64, ref, ref_lse, lengths[tail], 64, -1, False, None, None,
                              "none", D**-0.5)
    for a, b in zip((dq, dk, dv), want):
        assert rel(a[tail], b) < TOL[torch.bfloat16][1]


def test_strict_length_checks_on_cuda(single_config):
    q, k, v, _, _, _ = make_case(3, 2, 128, 64, torch.float16, "none")
    wild = torch.tensor([170, -3, 64], device=DEV)
    out = ops.block_attention(q, k, v, wild, 64, -1, False, None, None, "none", 0.125)  # clamped into [0, L]
    clamped = ops.block_attention(q, k, v, wild.clamp(0, 128), 64, -1, False, None, None, "none", 0.125)
    assert torch.equal(out, clamped)
    with strict_length_checks(True), pytest.raises(ValueError, match="lengths"):
        ops.block_attention(q, k, v, wild, 64, -1, False, None, None, "none", 0.125)


def test_float64_and_odd_head_dims_use_the_reference():
    q, k, v, lengths, cos, sin = make_case(3, 2, 80, 16, torch.float64, seed=10)
    check_case(q, k, v, lengths, 16, 3, True, cos, sin, "half")
    q, k, v, lengths, _, _ = make_case(3, 2, 80, 96, torch.bfloat16, "none", seed=11)
    out = block_attention(q, k, v, lengths, block=16)
    ref, _ = reference_forward(q.double(), k.double(), v.double(), lengths, 16, -1, False, None, None, "none",
                               96**-0.5)
    assert rel(out, ref) < TOL[torch.bfloat16][0]


def test_flop_counter_on_cuda(single_config):
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, lengths, cos, sin = make_case(4, 2, 256, 64, torch.bfloat16, seed=12)
    q.requires_grad_(True)
    pairs = block_attention_pairs(lengths, 256, 64, -1, False)
    with FlopCounterMode(display=False) as counter:
        ops.block_attention(q, k, v, lengths, 64, -1, False, cos, sin, "half", 0.125).sum().backward()
    assert counter.get_total_flops() == int(3.5 * 4 * 2 * 64 * pairs)


# ---------------------------------------------------------------------------------------------------
# kv_mask


def make_kv_mask(kind, B, L, seed=0):
    """(B, L) bool key mask on the GPU; "expanded" is a (1, L) mask expanded to (B, L) (batch stride 0)."""
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(L)[None, :]
    if kind == "holes":
        mask = torch.rand(B, L, generator=g) > 0.4
    elif kind == "left_padding":  # a valid suffix, starting anywhere in the first half
        mask = j >= torch.randint(0, L // 2 + 1, (B, 1), generator=g)
    elif kind == "right_padding":
        mask = j < torch.randint(L // 2, L + 1, (B, 1), generator=g)
    elif kind == "empty_row":
        mask = torch.rand(B, L, generator=g) > 0.3
        mask[2] = False  # sample 2 has length L: only the mask makes it empty
    elif kind == "all_true":
        mask = torch.ones(B, L, dtype=torch.bool)
    elif kind == "expanded":
        return (torch.rand(1, L, generator=g) > 0.3).to(DEV).expand(B, L)
    else:
        raise ValueError(kind)
    return mask.to(DEV)


KV_MASK_KINDS = ["holes", "left_padding", "right_padding", "empty_row", "all_true", "expanded"]
KV_MASK_CASES = [  # dtype, D, L, block, window, causal, rotary, tables
    (torch.bfloat16, 64, 1000, 64, -1, False, "half", "shared"),  # closed kernels
    (torch.bfloat16, 128, 1000, 16, 8, True, "none", "none"),  # closed, four blocks per tile
    (torch.bfloat16, 64, 1000, 128, -1, True, "interleaved", "per_sample"),  # general: block > tile
    (torch.bfloat16, 128, 1024, 0, 100, False, "half", "shared"),  # sliding window
    (torch.float32, 64, 1000, 64, -1, True, "none", "none"),
    (torch.float32, 128, 777, 0, 33, True, "half", "shared"),
]


@pytest.mark.parametrize("kind", KV_MASK_KINDS)
@pytest.mark.parametrize(
    "case",
    KV_MASK_CASES,
    ids=lambda c: (f"{str(c[0])[6:]}-D{c[1]}-L{c[2]}-block{c[3]}-w{c[4]}-{'causal' if c[5] else 'full'}"
                   f"-{c[6]}"),
)
def test_kv_mask_matches_float64_reference(single_config, case, kind):
    dtype, D, L, block, window, causal, rotary, tables = case
    if rotary == "interleaved" and tables == "shared":
        tables = "interleaved_tables"
    B = 6
    q, k, v, lengths, cos, sin = make_case(B, 2, L, D, dtype, tables, seed=D + L)
    kv_mask = make_kv_mask(kind, B, L, seed=L)
    check_case(q, k, v, lengths, block, window, causal, cos, sin, rotary, kv_mask=kv_mask)
    # the key mask from data: full lengths, the mask alone says which keys are valid
    full = torch.full((B,), L, device=DEV)
    check_case(q, k, v, full, block, window, causal, cos, sin, rotary, kv_mask=kv_mask)


def test_kv_mask_all_true_matches_no_mask_bitwise(single_config):
    q, k, v, lengths, cos, sin = make_case(5, 2, 700, 64, torch.bfloat16, seed=13)
    ones = torch.ones(5, 700, dtype=torch.bool, device=DEV)
    g = torch.randn_like(q)
    for block, window in ((64, -1), (0, 50)):
        args = (lengths, block, window, True, cos, sin, "half", 0.125)
        plain = run_op(q, k, v, *args, g)
        masked = run_op(q, k, v, *args, g, ones)
        assert torch.equal(plain[0], masked[0])
        for a, b in zip(plain[1], masked[1]):
            assert torch.equal(a, b)


def test_kv_mask_no_host_sync(single_config):
    q, k, v, lengths, cos, sin = make_case(6, 2, 1024, 64, torch.bfloat16, seed=14)
    kv_mask = make_kv_mask("holes", 6, 1024)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def step():
        grads = []
        for block, window in ((64, -1), (0, 128)):
            args = (lengths, block, window, False, cos, sin, "half", 0.125, kv_mask)
            out = ops.block_attention(*leaves, *args)
            grads += torch.autograd.grad(out, leaves, torch.ones_like(out))
        return grads

    step()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_kv_mask_eager_path_and_custom_ops_agree_bitwise(single_config):
    q, k, v, lengths, cos, sin = make_case(5, 2, 600, 128, torch.bfloat16, seed=15)
    g = torch.randn_like(q)
    args = (lengths, 64, 16, True, cos, sin, "half", 0.125, make_kv_mask("left_padding", 5, 600))

    def grads(call):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = call(*leaves)
        return (out, *torch.autograd.grad(out, leaves, g))

    fast = grads(lambda q, k, v: ops.block_attention(q, k, v, *args))
    via_ops = grads(lambda q, k, v: ops.block_attention_fwd(q, k, v, *args)[0])
    for a, b in zip(fast, via_ops):
        assert torch.equal(a, b)


def test_kv_mask_compile_fullgraph_no_recompile(single_config):
    B, H, L, D = 6, 2, 512, 64
    q, k, v, _, cos, sin = make_case(B, H, L, D, torch.bfloat16, seed=16)
    lengths = torch.full((B,), L, device=DEV)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def f(q, k, v, kv_mask):
        out = ops.block_attention(q, k, v, lengths, 64, -1, False, cos, sin, "half", 0.125, kv_mask)
        return out.float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            kv_mask = make_kv_mask("holes", B, L, seed=seed)
            got = torch.autograd.grad(compiled(*leaves, kv_mask), leaves)
            want = torch.autograd.grad(f(*leaves, kv_mask), leaves)
            for a, b in zip(got, want):
                assert rel(a, b) < 1e-2
