"""TMA loads of a side's row tiles (Hopper), through Triton's ragged tensor descriptors.

A padded (B, H, L, D) tensor whose rows of one (batch, head) are equally strided is read as one long list
of rows, a 2-D (rows, columns) view: row (b, h, l) = start + b * row_b + h * row_h + l (start: the
sequence's start row, nonzero only in a packed layout), and head h's columns from h * col_h. A (B, H, L, D)
layout folds the head into the row (row_h = L, col_h = 0); a (B, L, H, D) one permuted to (B, H, L, D) keeps
the heads side by side in a row (row_h = 0, col_h = the head stride). ``triton.tools.ragged_tma`` then bounds
each load by the sequence's rows [row0, row0 + length) in hardware: rows past the length read as zero, so
garbage or NaN in padded rows never reaches a dot (the contract of the pointer loads,
common/attention_triton.load_rows), and no pointer tensor is built. Compiled for sm_90a (triton 3.6) the
jagged forward at D 128 and 128x64 tiles takes 149 registers this way against 172 with pointer loads
(benchmarks/results/kernel_registers-d128-20261205-182145.json).

The descriptor's box depends on the tile the autotuner picks: :func:`tma_pre_hook` is the configs'
``pre_hook``, which sets each descriptor's box from the config's BLOCK_M / BLOCK_N before a launch
(tuned_launch.launch calls it on its direct path too). :func:`ragged_rows` says whether a tensor can be
read this way (else the kernel keeps its pointer loads); GEMCOMPILE_TMA=0 turns the path off.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.tools.ragged_tma import load_ragged
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - no host descriptors: the kernels keep their pointer loads
    load_ragged = TensorDescriptor = None

from .attention_triton import load_rows
from .tuned_launch import INTERPRET
from gemcompile.env import env_flag

__all__ = ["TMA_ENABLED", "TMA_MIN_WORK", "RaggedRows", "load_tile", "load_tile_or_rows", "ragged_rows",
           "rows_readable", "tma_available", "tma_pre_hook", "tma_worth"]

TMA_ENABLED = env_flag("GEMCOMPILE_TMA", True)
"""Read padded row tiles through TMA where :func:`ragged_rows` allows it (GEMCOMPILE_TMA=0: pointer loads)."""

TMA_MIN_WORK = 1 << 33
"""Padded work B * H * Lq * Lk * D below which a launch keeps its pointer loads (:func:`tma_worth`). Each
descriptor costs host time at every launch (Triton's launcher encodes it). On the H100 machine at B32 H8
L512 D64 the backward's host time per call was 401 / 303 us with TMA against 324 / 228 without, in two
alternating rounds (benchmarks/results/op_host_time-20261205-180950, -181014, -181029, -181045: noisy),
while the GPU time TMA saved per forward+backward (CUDA-graph replay, H100,
jagged_attention-hopper-cudagraph-20261205-173626 / -173711 and -180156 / -180257) was ~0.4 ms at B1152 H4
L1024 D128 (work 6.2e11) and 0.03-0.08 ms at B32 H8 L2048 D64 (6.9e10); at B32 H8 L512 D64 (4.3e9), where an
eager call is host-bound, it was not measured and can only be smaller. The decision depends on static shapes only: the same for the eager warm-up and a CUDA-graph
capture of one graph (a variant first met during a capture would be tuned inside it)."""

_MAX_INT = 0x7FFF0000
_ROWS = 1 << 30  # the ragged dimension's extent: row indices (and b * row_b + h * row_h + L) stay below it
_TMA_DTYPES = (torch.float16, torch.bfloat16)


class RaggedRows:
    """A side's descriptor and how a (batch, head) finds its tile: start row b * row_b + h * row_h (plus the
    sequence's own start row when packed), first column h * col_h."""

    def __init__(self, desc: TensorDescriptor, row_b: int, row_h: int, col_h: int):
        self.desc, self.row_b, self.row_h, self.col_h = desc, row_b, row_h, col_h

    def args(self) -> tuple:
        return self.row_b, self.row_h, self.col_h


_SM90: dict = {}
"""CUDA device index -> whether it has TMA (sm_90 or newer), asked once per device."""


def tma_available(device: torch.device) -> bool:
    """TMA exists from sm_90 on, with a Triton that has host descriptors (the interpreter emulates the
    loads: the CPU tests run this path too)."""
    if TensorDescriptor is None:
        return False
    if INTERPRET:
        return True
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SM90[index]


def tma_worth(work: int) -> bool:
    """Whether a launch of this padded work (B * H * Lq * Lk * D) takes the TMA loads: TMA_MIN_WORK or more
    (always under the interpreter, whose tests are small)."""
    return INTERPRET or work >= TMA_MIN_WORK


def ragged_rows(t: torch.Tensor, H: int, D: int, strides: tuple[int, int, int, int]) -> RaggedRows | None:
    """The ragged descriptor of one side ``t`` (padded (B, H, L, D) or packed (T, H, D)) read with its (b, h,
    l, d) ``strides`` (batch stride 0 when shared by the batch or packed), or None when TMA cannot read it:
    not 16-bit floats, a head dim that is not a power of two (the tile would need a column mask), strides
    or base not 16-byte aligned, a batch stride that is not a whole number of rows, or more rows than the
    ragged dimension holds."""
    layout = _row_layout(t, H, D, strides)
    if layout is None:
        return None
    row_h, col_h, width = layout
    sb, _, sm, _ = strides
    # the ragged trick of triton.tools.ragged_tma (two leading dimensions whose 64-bit address wrap-around
    # moves the bounds to the slice), built here from strides because the side is a strided view
    desc = _descriptor(t, [_MAX_INT, _MAX_INT, _ROWS, width], [2 ** 34 - sm, sm, sm, 1], [1, 1, 16, D])
    return RaggedRows(desc, sb // sm, row_h, col_h)


def rows_readable(t: torch.Tensor, H: int, D: int, strides: tuple[int, int, int, int]) -> bool:
    """Whether :func:`ragged_rows` would read ``t`` (its checks, no descriptor built): what a kernel that makes
    its own descriptors over the same rows needs too (common/warp_specialize.py)."""
    return _row_layout(t, H, D, strides) is not None


def _row_layout(t: torch.Tensor, H: int, D: int, strides) -> tuple[int, int, int] | None:
    """(row_h, col_h, row width) of ``t``'s row list, or None where TMA cannot read it (ragged_rows)."""
    sb, sh, sm, sd = strides
    size = t.element_size()
    if (t.dtype not in _TMA_DTYPES or sd != 1 or sm <= 0 or D & (D - 1) or D * size < 16 or D > 256
            or t.data_ptr() % 16 or (sm * size) % 16 or sb % sm):
        return None
    if sh % sm == 0:  # heads are rows apart: one row list, the head folded into the start row
        row_h, col_h, width = sh // sm, 0, D
    elif (sh * size) % 16 == 0:  # heads side by side in a row: head h is the columns from h * sh
        row_h, col_h, width = 0, sh, (H - 1) * sh + D
    else:
        return None
    storage = t.untyped_storage()
    if (storage.nbytes() - (t.data_ptr() - storage.data_ptr())) // (sm * size) >= _ROWS:
        return None  # a start row (or start + length) could pass the ragged dimension's extent
    return row_h, col_h, width


def _descriptor(t: torch.Tensor, shape: list, strides: list, block_shape: list):
    """A TensorDescriptor without its constructor's checks, which :func:`ragged_rows` has made (host time:
    ~5 us a descriptor against ~1.5 on this CPU; a launch takes up to four): the dataclass's fields set
    directly, every field the names do not give at its default."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(_DEFAULTS, base=t, shape=shape, strides=strides, block_shape=block_shape)
    return desc


_DEFAULTS = {} if TensorDescriptor is None else {
    f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


def tma_pre_hook(pairs: tuple[tuple[str, str], ...]):
    """A config ``pre_hook`` that sets the box of each (descriptor argument, block-size name) pair to the
    config's tile rows; an argument that is None (the pointer path) is left alone."""

    def hook(nargs: dict) -> None:
        for name, block in pairs:
            desc = nargs.get(name)
            if desc is not None:
                desc.block_shape = [1, 1, int(nargs[block]), desc.block_shape[-1]]

    hook.needs = tuple(name for pair in pairs for name in pair)  # (tuned_launch passes only these)
    return hook


@triton.jit
def load_tile(desc, start, length, row0, col0):
    """Rows row0 + [0, BLOCK) of the slice [start, start + length), columns col0 + [0, D), as a (BLOCK, D)
    tile (the descriptor's box); rows at or past ``length`` read as 0."""
    return load_ragged(desc, start, length, [row0, col0])


@triton.jit
def load_tile_or_rows(desc, row0, col0, length, start, base, rows, offs_d, stride_r, stride_d, rows_ok,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                      USE_TMA: tl.constexpr):
    """The tile of rows ``start + [0, BLOCK)`` (``rows``) of a sequence: through its ragged descriptor with
    USE_TMA (rows at or past ``length`` read as 0), else through pointers from ``base``
    (attention_triton.load_rows: rows not ``rows_ok`` read as 0 when MASKED)."""
    if USE_TMA:
        x = load_tile(desc, row0, length, start, col0)
    else:
        x = load_rows(base, rows, offs_d, stride_r, stride_d, rows_ok, HEAD_D, BLOCK_D, MASKED)
    return x
