"""The Triton kernels of block attention, run by the Triton interpreter on CPU (TRITON_INTERPRET=1, set by
conftest), against the float64 reference. The launchers are called directly with CPU tensors.

Under the interpreter each kernel has one small config: closed kernels use 32-row tiles (blocks 16 and
32 take them; 64 and 128 take the general kernels, whose tiles are 32x16 / 16x32), so the default runs
cover both kernel families; ``pinned`` tests cover the 64-row closed tile (block 64 = one block per
tile, block 16 = four blocks per tile) and other general tile shapes. bfloat16 is not tested here: the
triton 3.9 interpreter computes tl.dot on bfloat16 wrongly; the GPU tests cover it.
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
        allow_module_level=True,
    )
triton = pytest.importorskip("triton")

from gemcompile.lowering.block_attention import triton as kernels
from gemcompile.lowering.block_attention.reference import reference_backward, reference_forward
from gemcompile.lowering.block_attention.triton import (
    block_attention_backward_triton,
    block_attention_forward_triton,
    closed_tile_serves,
)

TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (3e-3, 8e-3)}  # (forward, backward) relative-norm error
LSE_TOL = {torch.float32: 1e-4, torch.float16: 4e-3}  # absolute (fp16: rotated q and k are rounded to fp16)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B, H, L, D, dtype, tables="shared", seed=0, lengths=None, table_dtype=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(3))
    if lengths is None:  # 0, 1, full, odd, then random
        special = [L, 0, 1, (L // 3) | 1]
        lengths = torch.tensor([special[i] if i < 4 else int(torch.randint(0, L + 1, (1,), generator=g))
                                for i in range(B)])
    cos = sin = None
    if tables != "none":
        shape = {"shared": (L, D), "per_sample": (B, L, D), "shared_4d": (1, 1, L, D)}[tables]
        theta = torch.rand(shape, generator=g) * 6.3
        cos, sin = theta.cos().to(table_dtype or dtype), theta.sin().to(table_dtype or dtype)
    return q, k, v, lengths, cos, sin


def check(q, k, v, lengths, block, window, causal, cos, sin, rotary, scale=0.3, seed=1, kv_mask=None,
          q_lengths=None):
    dtype = q.dtype
    args = (lengths, block, window, causal, cos, sin, rotary, scale, kv_mask)
    out, lse = block_attention_forward_triton(q, k, v, *args, q_lengths=q_lengths)
    d64 = [x.double() for x in (q, k, v)]
    t64 = [None if t is None else t.double() for t in (cos, sin)]
    ref_out, ref_lse = reference_forward(*d64, lengths, block, window, causal, *t64, rotary, scale, kv_mask,
                                         q_lengths=q_lengths)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == dtype and out.is_contiguous() and out.shape == q.shape
    assert not out.isnan().any()
    assert rel(out, ref_out) < fwd_tol, rel(out, ref_out)
    empty = torch.isposinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty)
    assert (out[empty] == 0).all()  # rows without an allowed key are exactly zero
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=0, atol=LSE_TOL[dtype])

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    skipped = None
    if q_lengths is not None:  # rows not computed: exactly 0, and whatever reaches them does not leak back
        skipped = (torch.arange(q.shape[2])[None, :] >= q_lengths[:, None])[:, None, :, None].expand_as(out)
        assert (out[skipped] == 0).all() and torch.isposinf(lse[skipped[..., 0]]).all()
        grad_out = grad_out.masked_fill(skipped, float("nan"))
    grads = block_attention_backward_triton(grad_out, q, k, v, out, lse, *args, q_lengths=q_lengths)
    grad_ref = grad_out.double() if skipped is None else grad_out.double().masked_fill(skipped, 0.0)
    want = reference_backward(grad_ref, *d64, ref_out, ref_lse, lengths, block, window, causal, *t64,
                              rotary, scale, kv_mask, q_lengths=q_lengths)
    if skipped is not None:
        assert (grads[0][skipped] == 0).all()  # dq of rows not computed
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert not got.isnan().any(), name
        assert rel(got, ref) < bwd_tol, (name, rel(got, ref))
    if kv_mask is not None:  # keys the mask drops get exactly zero dK and dV
        dropped = (~kv_mask)[:, None, :, None].expand_as(grads[1])
        assert (grads[1][dropped] == 0).all() and (grads[2][dropped] == 0).all()
    return out, lse, grads


CASES = [  # block, window, causal, rotary, tables, dtype, L
    (16, -1, False, "none", "none", torch.float32, 48),  # closed: two blocks per 32-row tile
    (32, -1, True, "half", "shared", torch.float16, 67),  # closed, one block per tile, partial last tile
    (16, 5, False, "interleaved", "per_sample", torch.float32, 48),  # closed, block and window
    (64, -1, False, "half", "shared_4d", torch.float32, 80),  # general kernels: block larger than the tile
    (128, -1, True, "interleaved", "shared", torch.float16, 136),  # two 128 blocks, the second partial
    (0, 1, False, "none", "none", torch.float16, 40),
    (0, 5, True, "half", "per_sample", torch.float16, 53),
    (0, 64, False, "none", "none", torch.float32, 80),  # window wider than a tile
    (12, -1, False, "interleaved", "shared", torch.float32, 50),  # a block that is not a power of two
    (24, 7, True, "none", "none", torch.float16, 61),
]


@pytest.mark.parametrize(
    "case", CASES,
    ids=lambda c: f"block{c[0]}-w{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}-{c[4]}-{str(c[5])[6:]}",
)
def test_kernels_match_reference(case):
    block, window, causal, rotary, tables, dtype, L = case
    q, k, v, lengths, cos, sin = make_inputs(5 if L < 64 else 4, 2, L, 32, dtype, tables, seed=L + block)
    check(q, k, v, lengths, block, window, causal, cos, sin, rotary)


@pytest.mark.parametrize("block,window,causal,rotary,L", [
    (16, -1, False, "none", 48),  # closed kernels
    (0, 5, True, "half", 45),  # general kernels
    (64, 3, False, "none", 80),  # general kernels, block larger than the tile
])
def test_query_rows_past_q_lengths_are_skipped(block, window, causal, rotary, L):
    """q_lengths (the rows the model keeps; the pass gives the lengths) smaller than, equal to and larger
    than the key lengths: computed rows match the reference, the others are 0 with zero dq and no part in
    dk, dv even when their upstream gradient is NaN."""
    tables = "none" if rotary == "none" else "shared"
    q, k, v, lengths, cos, sin = make_inputs(5, 2, L, 32, torch.float32, tables, seed=L)
    q_lengths = torch.tensor([L // 2, 0, 3, L // 2, L])  # against lengths [L, 0, 1, L // 3 | 1, random]
    check(q, k, v, lengths, block, window, causal, cos, sin, rotary, q_lengths=q_lengths,
          kv_mask=make_kv_mask("holes", 5, L, seed=3) if block == 64 else None)


def test_window_zero_is_the_diagonal():
    """Each row attends only itself: out = v on rows with a key, and no gradient reaches q and k."""
    q, k, v, lengths, _, _ = make_inputs(3, 1, 40, 32, torch.float32, "none", seed=2)
    out, lse = block_attention_forward_triton(q, k, v, lengths, 0, 0, False, None, None, "none", 0.3)
    has_key = (torch.arange(40)[None, :] < lengths[:, None])[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[has_key], v[has_key], rtol=1e-6, atol=1e-6)
    assert (out[~has_key] == 0).all()
    g = torch.randn_like(out)
    args = (lengths, 0, 0, False, None, None, "none", 0.3)
    dq, dk, _ = block_attention_backward_triton(g, q, k, v, out, lse, *args)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5


def _pin_closed(monkeypatch, tile):
    config = [triton.Config({"BLOCK": tile}, num_warps=4, num_stages=1)]
    monkeypatch.setattr(kernels._closed_fwd_kernel, "configs", config)
    monkeypatch.setattr(kernels._closed_bwd_kernel, "configs", config)


@pytest.mark.parametrize("block,rotary", [(64, "half"), (16, "interleaved")])
def test_closed_64_row_tiles(monkeypatch, block, rotary):
    """Block 64 in 64-row tiles (the benchmark's case: one key tile per query tile) and block 16 with four
    blocks per tile (the block-diagonal mask inside the tile)."""
    _pin_closed(monkeypatch, 64)
    assert closed_tile_serves(block, 32, rotary)
    q, k, v, lengths, cos, sin = make_inputs(4, 2, 150, 32, torch.float16, "per_sample", seed=block,
                                             lengths=torch.tensor([150, 0, 65, 63]))
    check(q, k, v, lengths, block, -1, False, cos, sin, rotary)
    check(q, k, v, lengths, block, 3, True, None, None, "none")


@pytest.mark.parametrize("rotary,D", [("half", 32), ("half", 64), ("interleaved", 32)])
def test_closed_backward_partner_swap_without_gather(monkeypatch, rotary, D):
    """R_SPLIT (an autotune option of the closed backward): R^T's partner columns by reshapes and a split
    instead of tl.gather, for both rotary layouts, against the float64 reference."""
    monkeypatch.setattr(kernels._closed_fwd_kernel, "configs",
                        [triton.Config({"BLOCK": 64}, num_warps=4, num_stages=1)])
    monkeypatch.setattr(kernels._closed_bwd_kernel, "configs",
                        [triton.Config({"BLOCK": 64, "HEADS": 2, "R_SPLIT": 1}, num_warps=4, num_stages=1)])
    q, k, v, lengths, cos, sin = make_inputs(3, 3, 130, D, torch.float16, "per_sample", seed=D,
                                             lengths=torch.tensor([130, 0, 70]))
    check(q, k, v, lengths, 64, -1, False, cos, sin, rotary)


@pytest.mark.parametrize("heads_per_program,H", [(1, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("packed_rows", [False, True], ids=["lengths", "q_lengths"])
def test_closed_kernels_heads_per_program(monkeypatch, heads_per_program, H, packed_rows):
    """HEADS heads of a tile per program (a loop over heads): with H not a multiple of HEADS the last
    program's heads past H are computed from clamped addresses and never stored; zero-length and skipped
    query rows still write exact zeros for every head."""
    config = [triton.Config({"BLOCK": 32, "HEADS": heads_per_program}, num_warps=4, num_stages=1)]
    monkeypatch.setattr(kernels._closed_fwd_kernel, "configs", config)
    monkeypatch.setattr(kernels._closed_bwd_kernel, "configs", config)
    q, k, v, lengths, cos, sin = make_inputs(3, H, 70, 32, torch.float32, "shared",
                                             seed=H + heads_per_program, lengths=torch.tensor([70, 0, 33]))
    q_lengths = torch.tensor([50, 10, 70]) if packed_rows else None
    check(q, k, v, lengths, 32, -1, False, cos, sin, "half", q_lengths=q_lengths)
    check(q, k, v, lengths, 16, -1, True, None, None, "none", q_lengths=q_lengths)


def test_closed_shape_keys_round_trip(monkeypatch):
    """Every key of the closed kernels' shape tables builds a config whose key is that key again (the tables
    and the pruner agree on which variants a config serves), "split" (R_SPLIT) included."""
    monkeypatch.setattr(kernels, "INTERPRET", False)  # the GPU's lists, not the interpreter's one config
    for table in (kernels._CLOSED_FWD_SHAPES, kernels._CLOSED_BWD_SHAPES):
        for key in table:
            (config,) = kernels._closed_configs({key: ()})
            assert kernels._closed_shape(config) == key, key
            assert bool(config.kwargs.get("R_SPLIT")) == (key[-1] == "split"), key


@pytest.mark.parametrize("fwd_tiles,tiles,heads,H", [(1, 2, 1, 2), (3, 3, 2, 3), (2, 1, 1, 3)])
def test_closed_kernels_tiles_per_program(monkeypatch, fwd_tiles, tiles, heads, H):
    """TILES (an autotune option of both closed kernels): one pipelined loop over TILES tiles x HEADS heads
    per program, without a branch. Tiles past a length (or past L, when L is not a multiple of TILES tiles)
    read nothing and store exact zeros (out 0, lse +inf); skipped query rows, kv masks and rotary as with
    one tile."""
    monkeypatch.setattr(kernels._closed_fwd_kernel, "configs",
                        [triton.Config({"BLOCK": 32, "HEADS": heads, "TILES": fwd_tiles}, num_warps=4,
                                       num_stages=1)])
    monkeypatch.setattr(kernels._closed_bwd_kernel, "configs",
                        [triton.Config({"BLOCK": 32, "HEADS": heads, "TILES": tiles}, num_warps=4,
                                       num_stages=1)])
    q, k, v, lengths, cos, sin = make_inputs(3, H, 130, 32, torch.float32, "per_sample", seed=tiles,
                                             lengths=torch.tensor([130, 0, 45]))
    check(q, k, v, lengths, 32, -1, False, cos, sin, "half")
    check(q, k, v, lengths, 16, -1, True, None, None, "none", q_lengths=torch.tensor([100, 0, 20]))
    check(q, k, v, lengths, 32, -1, False, None, None, "none", kv_mask=make_kv_mask("holes", 3, 130, seed=2))
    # keys past each length: exact zeros in dK and dV; tiles wholly past it (they read nothing): in dQ too
    args = (lengths, 32, -1, False, cos, sin, "half", 0.3, None)
    out, lse = kernels.block_attention_forward_triton(q, k, v, *args)
    dq, dk, dv = kernels.block_attention_backward_triton(torch.randn_like(out), q, k, v, out, lse, *args)
    row = torch.arange(130)[None, :]
    padded, dead = row >= lengths[:, None], row >= (lengths[:, None] + 31) // 32 * 32
    assert dead.any() and (dq.transpose(1, 2)[dead] == 0).all()
    assert (dk.transpose(1, 2)[padded] == 0).all() and (dv.transpose(1, 2)[padded] == 0).all()
    assert (out.transpose(1, 2)[dead] == 0).all() and torch.isposinf(lse.transpose(1, 2)[dead]).all()


def test_general_kernels_other_tile_shapes(monkeypatch):
    """Loop bounds of the general kernels with square 64 tiles and with tall/wide tiles."""
    for fwd, dkdv in (((64, 64), (64, 64)), ((16, 64), (64, 16))):
        monkeypatch.setattr(kernels._fwd_kernel, "configs", [triton.Config(
            {"BLOCK_M": fwd[0], "BLOCK_N": fwd[1]}, num_warps=4, num_stages=1)])
        monkeypatch.setattr(kernels._bwd_dq_kernel, "configs", [triton.Config(
            {"BLOCK_M": fwd[0], "BLOCK_N": fwd[1]}, num_warps=4, num_stages=1)])
        monkeypatch.setattr(kernels._bwd_dkdv_kernel, "configs", [triton.Config(
            {"BLOCK_M": dkdv[0], "BLOCK_N": dkdv[1]}, num_warps=4, num_stages=1)])
        q, k, v, lengths, cos, sin = make_inputs(3, 1, 90, 32, torch.float32, "shared", seed=fwd[0])
        check(q, k, v, lengths, 0, 20, True, cos, sin, "half")
        check(q, k, v, lengths, 64, 40, False, None, None, "none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_permuted_blhd_views(dtype):
    """q, k, v as permuted views of a (B, L, 3, H, D) projection, read through their strides."""
    B, L, H, D = 3, 45, 2, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, L, 3, H, D, generator=g).to(dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert not q.is_contiguous()
    lengths = torch.tensor([45, 5, 0])
    theta = torch.rand(L, D, generator=g)
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    for block, window in ((16, -1), (0, 6)):
        out, _, _grads = check(q, k, v, lengths, block, window, True, cos, sin, "half")
        contiguous = [x.contiguous() for x in (q, k, v)]
        out_c, _ = block_attention_forward_triton(*contiguous, lengths, block, window, True, cos, sin, "half",
                                                  0.3)
        torch.testing.assert_close(out, out_c, rtol=0, atol=0)


def test_float32_tables_with_half_inputs():
    q, k, v, lengths, cos, sin = make_inputs(3, 2, 40, 32, torch.float16, "shared", seed=4,
                                             table_dtype=torch.float32)
    check(q, k, v, lengths, 16, -1, False, cos, sin, "interleaved")


def test_rotary_at_head_dim_16_is_applied_around_the_kernels():
    q, k, v, lengths, cos, sin = make_inputs(3, 2, 40, 16, torch.float32, "per_sample", seed=5)
    check(q, k, v, lengths, 16, -1, False, cos, sin, "half")
    check(q, k, v, lengths, 0, 4, True, cos, sin, "interleaved")


def test_zero_lengths_and_lengths_outside_the_range():
    B, H, L, D = 3, 2, 40, 32
    q, k, v, _, _, _ = make_inputs(B, H, L, D, torch.float32, "none", seed=6)
    zeros = torch.zeros(B, dtype=torch.int32)
    for block, window in ((16, -1), (0, 3)):
        args = (zeros, block, window, False, None, None, "none", 0.3)
        out, lse = block_attention_forward_triton(q, k, v, *args)
        assert (out == 0).all() and torch.isposinf(lse).all()
        grads = block_attention_backward_triton(torch.randn_like(out), q, k, v, out, lse, *args)
        assert all((g == 0).all() for g in grads)
        # the kernels clamp lengths into [0, L] (the CUDA path checks values only in strict mode)
        wild = torch.tensor([-5, 99, 7])
        out, lse = block_attention_forward_triton(q, k, v, wild, block, window, True, None, None, "none", 0.3)
        want, _ = block_attention_forward_triton(q, k, v, wild.clamp(0, L), block, window, True, None, None,
                                                 "none", 0.3)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_padding_garbage_never_leaks():
    """Keys and values past the length are never read (padded QUERY rows are read: they have outputs)."""
    B, H, L, D = 3, 1, 40, 32
    q, k, v, _, cos, sin = make_inputs(B, H, L, D, torch.float32, "shared", seed=7)
    lengths = torch.tensor([40, 19, 0])
    pad = (torch.arange(L)[None, :] >= lengths[:, None])[:, None, :, None]
    dirty_k, dirty_v = k.masked_fill(pad, float("nan")), v.masked_fill(pad, float("inf"))
    for block, window in ((16, -1), (0, 9)):
        args = (lengths, block, window, False, cos, sin, "half", 0.3)
        clean_out, clean_lse = block_attention_forward_triton(q, k, v, *args)
        out, lse = block_attention_forward_triton(q, dirty_k, dirty_v, *args)
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
        g = torch.randn_like(out)
        got = block_attention_backward_triton(g, q, dirty_k, dirty_v, out, lse, *args)
        want = block_attention_backward_triton(g, q, k, v, clean_out, clean_lse, *args)
        for a, b in zip(got, want):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_is_deterministic_and_reads_expanded_grads():
    B, H, L, D = 3, 1, 40, 32
    q, k, v, lengths, cos, sin = make_inputs(B, H, L, D, torch.float16, "shared", seed=8)
    for block, window in ((32, -1), (0, 7)):
        args = (lengths, block, window, True, cos, sin, "interleaved", 0.2)
        out, lse = block_attention_forward_triton(q, k, v, *args)
        g = torch.randn_like(out)
        first = block_attention_backward_triton(g, q, k, v, out, lse, *args)
        second = block_attention_backward_triton(g, q, k, v, out, lse, *args)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        ones = torch.ones((), dtype=out.dtype).expand_as(out)  # grad of out.sum(): all strides 0
        got = block_attention_backward_triton(ones, q, k, v, out, lse, *args)
        want = block_attention_backward_triton(ones.contiguous(), q, k, v, out, lse, *args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_closed_tile_serves():
    assert closed_tile_serves(16, 64) and closed_tile_serves(32, 64)
    assert not closed_tile_serves(64, 64)  # the interpreter's closed tile is 32 rows
    assert not closed_tile_serves(12, 64) and not closed_tile_serves(0, 64)


# ---------------------------------------------------------------------------------------------------
# kv_mask


def make_kv_mask(kind, B, L, seed=0):
    """(B, L) bool key mask of one kind; "expanded" is a (1, L) mask expanded to (B, L) (batch stride 0)."""
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(L)[None, :]
    if kind == "holes":
        return torch.rand(B, L, generator=g) > 0.4
    if kind == "left_padding":  # a valid suffix; the last sample's first 40 keys (over a tile) are dropped
        start = torch.randint(0, L // 2 + 1, (B, 1), generator=g)  # (at most half: not degenerate)
        start[-1] = min(40, L)
        return j >= start
    if kind == "right_padding":
        return j < torch.randint(0, L + 1, (B, 1), generator=g)
    if kind == "empty_row":
        mask = torch.rand(B, L, generator=g) > 0.3
        mask[0] = False
        return mask
    if kind == "all_true":
        return torch.ones(B, L, dtype=torch.bool)
    if kind == "expanded":
        return (torch.rand(1, L, generator=g) > 0.3).expand(B, L)
    raise ValueError(kind)


MASK_KINDS = ["holes", "left_padding", "right_padding", "empty_row", "all_true", "expanded"]
KV_MASK_CASES = [  # block, window, causal, rotary, tables, dtype, L
    (16, -1, False, "none", "none", torch.float32, 70),  # closed kernels
    (32, 4, True, "half", "shared", torch.float16, 67),  # closed, block and window
    (64, -1, True, "interleaved", "per_sample", torch.float32, 80),  # general kernels
    (0, 9, False, "none", "none", torch.float16, 75),  # window: general kernels
    (12, -1, False, "half", "shared", torch.float32, 50),  # a block that is not a power of two
]


# each mask kind with two of the cases, the cases taking turns (the full grid costs minutes under the
# interpreter; the GPU tests run every kind with every case)
KV_MASK_GRID = [(KV_MASK_CASES[(i + j) % len(KV_MASK_CASES)], kind)
                for i, kind in enumerate(MASK_KINDS) for j in (0, 2)]


@pytest.mark.parametrize(
    "case,kind", KV_MASK_GRID,
    ids=[f"block{c[0]}-w{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}-{str(c[5])[6:]}-{k}"
         for c, k in KV_MASK_GRID],
)
def test_kv_mask_kernels_match_reference(case, kind):
    block, window, causal, rotary, tables, dtype, L = case
    B = 4
    q, k, v, lengths, cos, sin = make_inputs(B, 2, L, 32, dtype, tables, seed=L + block)
    kv_mask = make_kv_mask(kind, B, L, seed=L)
    check(q, k, v, lengths, block, window, causal, cos, sin, rotary, kv_mask=kv_mask)
    if kind == "left_padding":  # lengths from data: full lengths, the mask alone says which keys are valid
        check(q, k, v, torch.full((B,), L), block, window, causal, cos, sin, rotary, kv_mask=kv_mask)


@pytest.mark.parametrize("block,window", [(64, -1), (16, 3)])
def test_kv_mask_closed_64_row_tiles(monkeypatch, block, window):
    _pin_closed(monkeypatch, 64)
    q, k, v, lengths, cos, sin = make_inputs(4, 2, 150, 32, torch.float16, "per_sample", seed=block,
                                             lengths=torch.tensor([150, 0, 65, 150]))
    for kind in ("holes", "left_padding"):
        check(q, k, v, lengths, block, window, True, cos, sin, "half", kv_mask=make_kv_mask(kind, 4, 150))


def test_kv_mask_general_kernels_other_tile_shapes(monkeypatch):
    for fwd, dkdv in (((64, 64), (64, 64)), ((16, 64), (64, 16))):
        for kernel, (m, n) in ((kernels._fwd_kernel, fwd), (kernels._bwd_dq_kernel, fwd),
                               (kernels._bwd_dkdv_kernel, dkdv)):
            monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4,
                                                                  num_stages=1)])
        q, k, v, lengths, _, _ = make_inputs(3, 1, 150, 32, torch.float32, "none", seed=fwd[0],
                                             lengths=torch.tensor([150, 150, 120]))
        mask = make_kv_mask("left_padding", 3, 150, seed=9) & make_kv_mask("holes", 3, 150, seed=9)
        check(q, k, v, lengths, 0, 20, True, None, None, "none", kv_mask=mask)
        check(q, k, v, lengths, 128, -1, False, None, None, "none", kv_mask=mask)


def test_kv_mask_range():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]],
                        dtype=torch.bool)
    lengths = torch.tensor([6, 6, 4, 3])
    got = kernels.kv_mask_range(mask, lengths, 6)
    assert got.dtype == torch.int32
    assert got.tolist() == [[1, 5], [6, 0], [0, 4], [6, 0]]  # no valid key: [L, 0)


def test_kv_mask_garbage_in_dropped_keys_never_leaks():
    B, H, L, D = 3, 1, 70, 32
    q, k, v, lengths, cos, sin = make_inputs(B, H, L, D, torch.float32, "shared", seed=10)
    mask = make_kv_mask("left_padding", B, L, seed=3) & make_kv_mask("holes", B, L, seed=3)
    drop = (~mask)[:, None, :, None]
    dirty_k, dirty_v = k.masked_fill(drop, float("nan")), v.masked_fill(drop, float("inf"))
    for block, window in ((16, -1), (0, 9)):
        args = (lengths, block, window, False, cos, sin, "half", 0.3, mask)
        clean_out, clean_lse = block_attention_forward_triton(q, k, v, *args)
        out, lse = block_attention_forward_triton(q, dirty_k, dirty_v, *args)
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
        g = torch.randn_like(out)
        got = block_attention_backward_triton(g, q, dirty_k, dirty_v, out, lse, *args)
        want = block_attention_backward_triton(g, q, k, v, clean_out, clean_lse, *args)
        for a, b in zip(got, want):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kv_mask_all_true_matches_no_mask():
    q, k, v, lengths, cos, sin = make_inputs(4, 2, 70, 32, torch.float32, "shared", seed=11)
    ones = torch.ones(4, 70, dtype=torch.bool)
    for block, window in ((16, -1), (0, 9)):
        args = (lengths, block, window, True, cos, sin, "half", 0.3)
        out, lse = block_attention_forward_triton(q, k, v, *args)
        out_m, lse_m = block_attention_forward_triton(q, k, v, *args, ones)
        torch.testing.assert_close(out_m, out, rtol=0, atol=0)
        g = torch.randn_like(out)
        for a, b in zip(block_attention_backward_triton(g, q, k, v, out, lse, *args, ones),
                        block_attention_backward_triton(g, q, k, v, out, lse, *args)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
