"""Argument checks shared by the ops, what each kernel serves, and the switch for length-value checks on
CUDA.

Shape, rank, dtype and device checks are cheap host-side metadata checks: they always run, also on
fake tensors while tracing, so a bad call fails at compile time with a message naming the argument.

Length *values* are data. On CPU they are always checked (a cheap reduction, no device round trip).
On CUDA a check would need a host sync (`.item()`), which the ops must never do by default: the CUDA
kernels instead clamp every length into ``[0, L]`` (memory safety; a length above L means "all L
positions", exactly what the eager padded mask ``arange(L) < length`` means). Turn on
:func:`strict_length_checks` while debugging to make the CUDA path check the values too (one host
sync per op call) and raise ``ValueError`` on a length outside ``[0, L]``::

    from gemcompile.lowering.common.checks import strict_length_checks
    strict_length_checks(True)             # from now on
    with strict_length_checks(True): ...   # only inside the block
"""

from __future__ import annotations

import torch

from .opkit import is_fake

__all__ = [
    "KERNEL_HEAD_DIMS",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "check_attention_layout",
    "check_bias",
    "check_flags",
    "check_index_vector",
    "check_kv_mask",
    "check_length_values",
    "check_number",
    "check_qkv_tensors",
    "check_uniform_keys",
    "kernel_supports",
    "should_check_values",
    "strict_length_checks",
    "strict_length_checks_enabled",
]

MIN_HEAD_DIM = 16
"""Smallest head dim the Triton kernels serve (tl.dot needs K >= 16)."""
MAX_HEAD_DIM = 128
"""Largest head dim the Triton kernels serve (register and shared-memory budget of one tile)."""
KERNEL_HEAD_DIMS = (MIN_HEAD_DIM, MAX_HEAD_DIM)
"""Head dims the jagged attention and GDPA kernels serve (inclusive); other sizes are refused by the ops."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_strict = False


def kernel_supports(block: int, window: int, head_dim: int) -> str | None:
    """Block attention: None when the CUDA kernels serve these static arguments, else the reason they do
    not (the op then runs the dense reference: correct, slow). For the block_attention pass: refuse what
    this rejects.

    Any block >= 1 and window >= 0 is served (power-of-two blocks up to the tile size take the fused
    one-tile-per-block kernels); the head dim must be a power of two in [16, 128] (rotary at D = 16 is
    applied with torch around the kernels, since the fused rotation needs D/2 >= 16)."""
    if block < 0 or window < -1:
        return f"block must be >= 0 and window >= -1, got block={block}, window={window}"
    if block == 0 and window < 0:
        return "neither a block nor a window: this is plain jagged attention (use jagged_attention)"
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM) or head_dim & (head_dim - 1):
        return f"head dim {head_dim} is not a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    return None


class strict_length_checks:
    """Turn value checks of lengths/offsets on CUDA on or off.

    Calling it sets the switch for the whole process; used as a context manager it restores the previous
    value on exit. CPU tensors are always checked, whatever the switch says.
    """

    def __init__(self, enabled: bool = True):
        global _strict
        if not isinstance(enabled, bool):
            raise TypeError(f"strict_length_checks(enabled) expects a bool, got {type(enabled).__name__}")
        self.previous = _strict
        _strict = enabled

    def __enter__(self) -> "strict_length_checks":
        return self

    def __exit__(self, *exc) -> None:
        global _strict
        _strict = self.previous


def strict_length_checks_enabled() -> bool:
    """Whether CUDA calls check length values (with a host sync)."""
    return _strict


def should_check_values(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` are checked: real tensors on CPU always, on CUDA under strict checks."""
    if is_fake(t):
        return False
    return t.device.type == "cpu" or _strict


def check_index_vector(name: str, t, size: int, size_text: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be 1-D of size {size_text} = {size}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; every tensor must be on one device")


def check_qkv_tensors(q, k, v, layout_rank: int, layout_text: str) -> None:
    """q, k, v are tensors of the layout's rank, one float dtype, on one device (no head-dim rule: ops
    that fall back to their reference for other head dims check only this)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != layout_rank:
            raise ValueError(f"{name} must be {layout_rank}-D {layout_text}, got shape {tuple(t.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def check_flags(causal, scale) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_number("scale", scale)


def check_bias(bias, target: tuple, device) -> None:
    """bias: a float tensor on q's device, 4-D and broadcastable to ``target`` = (B, H, Lq, Lk)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q is on {device}")
    if bias.dim() != 4 or any(s not in (1, t) for s, t in zip(bias.shape, target)):
        raise ValueError(
            f"bias must be 4-D and broadcastable to (B, H, Lq, Lk) = {target} (each dim equal or 1), "
            f"got shape {tuple(bias.shape)}"
        )


def check_attention_layout(q, k, v, q_lengths, kv_lengths, kernel: str) -> tuple[int, int, int, int]:
    """q (Bq, H, Lq, D) with Bq in {1, B}, k and v (B, H, Lk, D): tensors of one float dtype and device, a
    head dim the ``kernel`` serves, lengths (B,) index vectors (None: every position valid). Returns
    (B, H, Lq, Lk); TypeError/ValueError naming the argument."""
    check_qkv_tensors(q, k, v, 4, "(batch, heads, length, head_dim)")
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(
            f"q, k and v must share the head dim, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
        )
    if not (MIN_HEAD_DIM <= D <= MAX_HEAD_DIM):
        raise ValueError(
            f"head dim {D} is not supported by the {kernel} (valid: {MIN_HEAD_DIM} <= D <= {MAX_HEAD_DIM})"
        )
    B, H, Lk, _ = k.shape
    if v.shape != k.shape:
        raise ValueError(
            f"k and v must have one shape (B, H, Lk, D), got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] not in (1, B):
        raise ValueError(f"q's batch size must be 1 (shared queries) or k's batch size {B}, got {q.shape[0]}")
    if q.shape[1] != H:
        raise ValueError(f"q and k must have the same number of heads, got q {q.shape[1]}, k {H}")
    if q_lengths is not None:
        check_index_vector("q_lengths", q_lengths, B, "B", q.device)
    if kv_lengths is not None:
        check_index_vector("kv_lengths", kv_lengths, B, "B", q.device)
    return B, H, q.shape[2], Lk


def check_length_values(name: str, lengths: torch.Tensor | None, max_len: int) -> None:
    """Raise ValueError if a length lies outside [0, max_len]; CPU always, CUDA only in strict mode."""
    if lengths is None or not should_check_values(lengths):
        return
    bad = (lengths < 0) | (lengths > max_len)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{i}] = {int(lengths[i])} is outside [0, {max_len}] (the padded length)")


def check_kv_mask(kv_mask, B: int, Lk: int, device) -> None:
    """kv_mask: None or a torch.bool (B, Lk) tensor on q's device, any strides (metadata only)."""
    if kv_mask is None:
        return
    if not isinstance(kv_mask, torch.Tensor):
        raise TypeError(f"kv_mask must be a torch.Tensor or None, got {type(kv_mask).__name__}")
    if kv_mask.dtype != torch.bool:
        raise ValueError(f"kv_mask must be a torch.bool tensor, got dtype {kv_mask.dtype}")
    if kv_mask.dim() != 2 or tuple(kv_mask.shape) != (B, Lk):
        raise ValueError(f"kv_mask must have shape (B, Lk) = {(B, Lk)}, got {tuple(kv_mask.shape)}")
    if kv_mask.device != device:
        raise ValueError(f"kv_mask is on {kv_mask.device} but q is on {device}")


def check_uniform_keys(uniform_keys, B: int, device) -> None:
    """uniform_keys: None or a torch.bool (B,) tensor on q's device (metadata only)."""
    if uniform_keys is None:
        return
    if not isinstance(uniform_keys, torch.Tensor):
        raise TypeError(f"uniform_keys must be a torch.Tensor or None, got {type(uniform_keys).__name__}")
    if uniform_keys.dtype != torch.bool:
        raise ValueError(f"uniform_keys must be a torch.bool tensor, got dtype {uniform_keys.dtype}")
    if uniform_keys.dim() != 1 or tuple(uniform_keys.shape) != (B,):
        raise ValueError(f"uniform_keys must have shape (B,) = {(B,)}, got {tuple(uniform_keys.shape)}")
    if uniform_keys.device != device:
        raise ValueError(f"uniform_keys is on {uniform_keys.device} but q is on {device}")
