"""The jagged kernels' TMA loads (common/ragged_tma.py), run by the Triton interpreter on CPU: the forward
streams q, k, v through ragged descriptors, the dK/dV kernel q and dO, the dQ kernel k and v.

Each case runs forward and backward twice, through the ragged descriptors and with the pointer loads
(GEMCOMPILE_TMA's switch), and checks that the TMA launches really used them, that both give the same
output, lse and gradients bit for bit, and that they match the float64 reference; padded rows hold NaN, so
a load that reads past a sequence shows up. Layouts: (B, H, L, D) contiguous, (B, L, H, D) permuted (heads
side by side in a row), q shared by the batch, packed keys and values (and packed q), expanded heads; with
causal, a bias, zero-length and full-length sequences. Near misses take the pointer path: a kv_mask, a head
dim that is not a power of two, fp32, a row stride that is not 16-byte aligned, k and v laid out
differently. float16 only: the interpreter computes bfloat16 dots wrongly (the GPU tests cover bfloat16).
"""

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: run on a machine without CUDA (conftest sets TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from gemcompile.lowering.common import ragged_tma
from gemcompile.lowering.jagged_attention import packed_triton
from gemcompile.lowering.jagged_attention import triton as kernels
from gemcompile.lowering.jagged_attention.packed import packed_reference_forward
from gemcompile.lowering.jagged_attention.reference import reference_forward
from tests.grids import pairwise

KERNELS = {"fwd": kernels._fwd_kernel, "dkdv": kernels._bwd_dkdv_kernel, "dq": kernels._bwd_dq_kernel}


@pytest.fixture
def launches(monkeypatch):
    """USE_TMA of every launch of the three kernels, in order, as (kernel name, USE_TMA)."""
    seen = []
    real = kernels.launch
    names = {kernel: name for name, kernel in KERNELS.items()}

    def spy(kernel, grid, args, consts, buckets):
        if kernel in names:
            seen.append((names[kernel], consts["USE_TMA"]))
        return real(kernel, grid, args, consts, buckets)

    monkeypatch.setattr(kernels, "launch", spy)
    return seen


def both_paths(monkeypatch, launches, fn):
    """fn() with TMA, then with pointer loads -> (TMA results, pointer results, {kernel: USE_TMA} of the
    first run)."""
    start = len(launches)
    with_tma = fn()
    used = dict(launches[start:])
    monkeypatch.setattr(kernels, "TMA_ENABLED", False)
    start = len(launches)
    pointer = fn()
    monkeypatch.setattr(kernels, "TMA_ENABLED", True)
    assert not any(tma for _, tma in launches[start:])
    return with_tma, pointer, used


def forward_backward(q, k, v, ql, kl, bias, causal, scale, grad_seed=0):
    """(out, lse, dq, dk, dv) of the padded launchers, dO random with NaN in padded query rows."""
    out, lse = kernels.jagged_attention_forward_triton(q, k, v, ql, kl, bias, causal, scale)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    if ql is not None:
        g = dirty(g, ql, 2)
    dq, dk, dv, _ = kernels.jagged_attention_backward_triton(g, q, k, v, out, lse, ql, kl, bias, causal,
                                                             scale, False)
    return out, lse, dq, dk, dv


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def dirty(t, lengths, dim):
    """NaN in the rows at or past each batch's length along ``dim`` (the length dim of a (B, ..) tensor)."""
    pos = torch.arange(t.shape[dim])
    shape = [1] * t.dim()
    shape[0], shape[dim] = -1, t.shape[dim]
    pad = (pos[None, :] >= lengths[:, None]).view(shape)
    return t.masked_fill(pad, float("nan"))


def lengths_with_edges(B, L, g):
    """0, L and 1 first, then random lengths."""
    rand = torch.randint(0, L + 1, (B,), generator=g)
    rand[:3] = torch.tensor([0, L, 1])[: min(B, 3)]
    return rand


def bhld_inputs(layout, B, H, L, D, g):
    if layout == "bhld":
        q, k, v = (torch.randn(B, H, L, D, generator=g).half() for _ in range(3))
    elif layout == "blhd":  # one (B, L, 3, H, D) projection, permuted: heads side by side in a row
        qkv = torch.randn(B, L, 3, H, D, generator=g).half()
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    else:  # keys and values of one head expanded over the heads (head stride 0)
        q = torch.randn(B, H, L, D, generator=g).half()
        k, v = (torch.randn(B, 1, L, D, generator=g).half().expand(B, H, L, D) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("layout,causal,with_bias", pairwise(
    {x: x for x in ("bhld", "blhd", "expanded_heads")}, {"full": False, "causal": True},
    {"no_bias": False, "bias": True}))
def test_tma_forward_matches_pointer_loads_and_reference(monkeypatch, launches, layout, causal, with_bias):
    B, H, L, D = 4, 2, 45, 32
    g = torch.Generator().manual_seed(7 + causal + 2 * with_bias)
    q, k, v = bhld_inputs(layout, B, H, L, D, g)
    ql, kl = lengths_with_edges(B, L, g), lengths_with_edges(B, L, g).flip(0)
    bias = torch.randn(1, H, L, L, generator=g).half() if with_bias else None
    if layout != "expanded_heads":  # (an expanded view cannot be written in place of its rows)
        q, k, v = dirty(q, ql, 2), dirty(k, kl, 2), dirty(v, kl, 2)
    tma, pointer, used = both_paths(
        monkeypatch, launches, lambda: forward_backward(q, k, v, ql, kl, bias, causal, D ** -0.5))
    assert used == {"fwd": True, "dkdv": True, "dq": True}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tma, pointer):
        assert torch.equal(a, b), name
        assert not a.isnan().any(), name
    out, lse = tma[:2]
    clean = [torch.nan_to_num(t) for t in (q, k, v)]  # the reference reads padded rows too (masked)
    ref_out, ref_lse = reference_forward(*(t.double() for t in clean), ql, kl,
                                         None if bias is None else bias.double(), causal, D ** -0.5)
    assert rel(out, ref_out) < 3e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-3, atol=1e-3)


def test_tma_forward_shared_q_and_full_keys(monkeypatch, launches):
    """q (1, H, L, D) shared by the batch (batch stride 0), no q_lengths, no kv_lengths (every key)."""
    B, H, L, D = 3, 2, 40, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, H, 24, D, generator=g).half()
    k, v = (torch.randn(B, H, L, D, generator=g).half() for _ in range(2))
    tma, pointer, used = both_paths(
        monkeypatch, launches, lambda: forward_backward(q, k, v, None, None, None, False, 0.3))
    assert used == {"fwd": True, "dkdv": True, "dq": True}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tma, pointer):
        assert torch.equal(a, b), name
    out = tma[0]
    ref_out, _ = reference_forward(q.double().expand(B, -1, -1, -1), k.double(), v.double(), None, None, None,
                                   False, 0.3)
    assert rel(out, ref_out) < 3e-3


@pytest.mark.parametrize("q_packed", [False, True], ids=["dense_q", "packed_q"])
def test_tma_forward_packed_keys(monkeypatch, launches, q_packed):
    """Packed k, v (T, H, D): a sequence's rows start at its offset (the start row of the ragged slice)."""
    B, H, N, D = 4, 2, 37, 32
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([0, 37, 1, 20])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    T = int(offsets[-1])
    k, v = (torch.randn(T, H, D, generator=g).half() for _ in range(2))
    q = torch.randn(T, H, D, generator=g).half() if q_packed else torch.randn(B, H, 16, D, generator=g).half()
    ql = None if q_packed else torch.tensor([16, 3, 0, 9])

    def run():
        return packed_triton.jagged_attention_forward_triton(q, k, v, ql, None, None, q_packed, D ** -0.5,
                                                             token_offsets=offsets, packed_len=N)

    (out, lse), (out_p, lse_p), used = both_paths(monkeypatch, launches, run)
    assert used == {"fwd": True}
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    ref_out, _ = packed_reference_forward(q.double(), k.double(), v.double(), ql, None, None, q_packed,
                                          D ** -0.5, token_offsets=offsets, packed_len=N)
    assert rel(out, ref_out) < 3e-3


def near_misses():
    g = torch.Generator().manual_seed(5)
    B, H, L = 3, 2, 33

    def rand(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=g).to(dtype)

    kl = torch.tensor([33, 4, 0])
    mask = torch.arange(L)[None, :] < kl[:, None]
    mask[0, 3] = False  # a hole
    wide = rand(B, H, L, 36)  # rows of 36 halves (72 bytes): not 16-byte aligned
    k = rand(B, H, L, 32)
    return {
        "kv_mask": (rand(B, H, L, 32), k, rand(B, H, L, 32), {"kv_mask": mask}),
        "head_dim_24": (rand(B, H, L, 24), rand(B, H, L, 24), rand(B, H, L, 24), {}),
        "fp32": (rand(B, H, L, 32, dtype=torch.float32), rand(B, H, L, 32, dtype=torch.float32),
                 rand(B, H, L, 32, dtype=torch.float32), {}),
        "unaligned_rows": (wide[..., :32], wide[..., 2:34], wide[..., 4:36], {}),
        "k_v_layouts_differ": (rand(B, H, L, 32), k, rand(B, L, H, 32).transpose(1, 2), {}),
    }


@pytest.mark.parametrize("case", list(near_misses()))
def test_near_misses_take_the_pointer_loads(launches, case):
    q, k, v, extra = near_misses()[case]
    kl = torch.tensor([33, 4, 0])
    out, _ = kernels.jagged_attention_forward_triton(q, k, v, kl, kl, None, False, 0.25, **extra)
    assert launches[-1] == ("fwd", False)
    ref_out, _ = reference_forward(q.double(), k.double(), v.double(), kl, kl, None, False, 0.25,
                                   kv_mask=extra.get("kv_mask"))
    assert rel(out, ref_out) < (3e-3 if q.dtype == torch.float16 else 1e-5)


def test_ragged_rows_reads_the_layouts():
    """Row and column offsets of the two layouts; None where TMA cannot read the tensor."""
    B, L, H, D = 2, 8, 4, 16
    bhld = torch.zeros(B, H, L, D, dtype=torch.float16)
    rows = ragged_tma.ragged_rows(bhld, H, D, bhld.stride())
    assert rows.args() == (H * L, L, 0) and rows.desc.shape[-1] == D
    blhd = torch.zeros(B, L, H, D, dtype=torch.bfloat16).transpose(1, 2)
    rows = ragged_tma.ragged_rows(blhd, H, D, blhd.stride())
    assert rows.args() == (L, 0, D) and rows.desc.shape[-1] == H * D
    shared = ragged_tma.ragged_rows(bhld[:1], H, D, (0, *bhld.stride()[1:]))
    assert shared.args() == (0, L, 0)
    assert ragged_tma.ragged_rows(bhld.float(), H, D, bhld.stride()) is None
    odd = torch.zeros(B, H, L, 12, dtype=torch.float16)
    assert ragged_tma.ragged_rows(odd, H, 12, odd.stride()) is None
    # the descriptor built without the constructor's checks has every field the constructor gives
    from triton.tools.tensor_descriptor import TensorDescriptor

    built = TensorDescriptor(bhld, rows.desc.shape, rows.desc.strides, rows.desc.block_shape)
    assert rows.desc.__dict__.keys() == built.__dict__.keys()
    assert all(getattr(rows.desc, k) == getattr(built, k) for k in built.__dict__ if k != "base")
    hook = ragged_tma.tma_pre_hook((("QDesc", "BLOCK_M"),))
    rows = ragged_tma.ragged_rows(bhld, H, D, bhld.stride())
    hook({"QDesc": rows.desc, "BLOCK_M": 64})
    assert rows.desc.block_shape == [1, 1, 64, D]
    hook({"QDesc": None, "BLOCK_M": 64})  # the pointer path: nothing to set


def test_kv_mask_keeps_pointer_loads_of_keys(monkeypatch, launches):
    """With a kv_mask the forward and dQ read k and v with pointers (masked keys' rows may hold NaN, which
    TMA would read); dK/dV still streams q and dO through TMA. Same results either way, no NaN."""
    B, H, L, D = 3, 2, 40, 32
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, H, L, D, generator=g).half() for _ in range(3))
    kl = torch.tensor([40, 17, 0])
    mask = torch.arange(L)[None, :] < kl[:, None]
    mask[0, 5:9] = False  # holes
    mask[1, :3] = False  # left padding
    k, v = (t.masked_fill(~mask[:, None, :, None], float("nan")) for t in (k, v))

    def run():
        out, lse = kernels.jagged_attention_forward_triton(q, k, v, kl, kl, None, False, 0.2, kv_mask=mask)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
        grads = kernels.jagged_attention_backward_triton(grad, q, k, v, out, lse, kl, kl, None, False, 0.2, False,
                                                         kv_mask=mask)
        return (out, lse, *grads[:3])

    tma, pointer, used = both_paths(monkeypatch, launches, run)
    assert used == {"fwd": False, "dkdv": True, "dq": False}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tma, pointer):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), name


def test_small_launches_keep_pointer_loads(monkeypatch):
    """On a GPU a launch below TMA_MIN_WORK keeps its pointer loads (the descriptors' host time would cost
    more than TMA saves); the interpreter's small tests take TMA whatever the size."""
    assert ragged_tma.tma_worth(1)
    monkeypatch.setattr(ragged_tma, "INTERPRET", False)
    assert not ragged_tma.tma_worth(32 * 8 * 512 * 512 * 64)  # B32 H8 L512 D64: host-bound when eager
    assert ragged_tma.tma_worth(32 * 8 * 2048 * 2048 * 64)
    assert ragged_tma.tma_worth(ragged_tma.TMA_MIN_WORK)
    assert not ragged_tma.tma_worth(ragged_tma.TMA_MIN_WORK - 1)
