"""How the Triton kernels of every op are launched: the interpreter switch and a launcher that asks the
autotuner once per tuning key.

``INTERPRET``: TRITON_INTERPRET=1 (the CPU tests set it) runs the kernels in Triton's interpreter; the kernel
files then keep one small config per kernel so that the tests stay fast.
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET", "launch"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_BEST_CONFIG: dict = {}
"""(kernel, tuning key) -> (the kernel's config list, the config the autotuner chose from it)."""


def launch(kernel, grid, args: tuple, consts: dict, buckets: tuple[int, ...]) -> None:
    """Launch an autotuned kernel. The first launch of a tuning key goes through the autotuner; later ones
    go straight to the tuned kernel with the config it chose: the autotuner rebuilds dicts of all ~45
    arguments on every launch (about 0.1 ms of host time per launch on the H200 machine's CPU).

    The key holds what the autotuner keys on: the values of the kernel's autotune-key arguments (the
    length ``buckets`` and the flags, passed in ``consts`` with the other constexprs) and the dtypes of the
    tensor arguments."""
    key = (kernel, *buckets, *consts.values(), *(a.dtype for a in args if isinstance(a, torch.Tensor)))
    tuned = _BEST_CONFIG.get(key)
    if tuned is None or tuned[0] is not kernel.configs:  # (tests pin configs by replacing the list)
        kernel[grid](*args, **consts)
        _BEST_CONFIG[key] = (kernel.configs, kernel.best_config)
    else:
        kernel.fn.run(*args, grid=grid, warmup=False, **consts, **tuned[1].all_kwargs())
