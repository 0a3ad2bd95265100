"""The versions that decide what a compiled graph looks like (folded into every pass uuid)."""

import functools

__version__ = "0.1.0"


@functools.cache
def versions() -> dict[str, str]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # triton is optional off Linux; the CPU path never needs it
        triton_version = "absent"
    return {"gemcompile": __version__, "torch": torch.__version__, "triton": triton_version}
