"""What the GPU tests of the attention kernels share: the error measure against float64 math, its bounds,
and pinning a kernel to one config (few compiles per test)."""

import torch
import triton

# relative-norm error bounds (forward, backward) against float64 math on the same (rounded) inputs
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 6e-3),
    torch.bfloat16: (1.2e-2, 3e-2),
}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pin_tiles(monkeypatch, tiles: dict) -> None:
    """kernel -> (BLOCK_M, BLOCK_N, num_warps, num_stages): each kernel's autotune list becomes that one
    config."""
    for kernel, (m, n, w, s) in tiles.items():
        monkeypatch.setattr(
            kernel, "configs", [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)]
        )
