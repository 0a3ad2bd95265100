"""What the attention kernels serve, read from their ops in lowering/: the one place the attention
families import lowering from. Importing it registers the ops (``torch.ops.gemcompile.*``)."""

from __future__ import annotations

import gemcompile.lowering  # noqa: F401  registers torch.ops.gemcompile.*
from gemcompile.lowering.common import checks

HEAD_DIMS = checks.KERNEL_HEAD_DIMS
"""Head dims the jagged and GDPA Triton kernels serve (inclusive); other sizes are left to the eager path."""

BLOCK_NO_WINDOW = -1
"""gemcompile::block_attention's window argument for "no window" (AttentionMask.window None)."""

GDPA_NO_WINDOW = 0
"""gemcompile::gdpa's window argument for "no window" (AttentionMask.window None)."""


def block_kernel_supports(block: int, window: int, head_dim: int) -> str | None:
    """None when the block-attention kernel serves (block, window, head_dim), else the reason (read from
    the checks module at each call, so a patched ``kernel_supports`` is seen)."""
    return checks.kernel_supports(block, window, head_dim)
