"""benchmarks/jagged_attention.py with tile configs taken out of a jagged kernel's autotune list: the 'before'
of a config A/B run in the same lease as the plain benchmark (which is the 'after').

    python benchmarks/jagged_without_config.py dkdv:64,64,4,2 [dq:...] -- --only hopper --cuda-graph ...

Each KERNEL:BLOCK_M,BLOCK_N,warps,stages (KERNEL in fwd, dkdv, dq) drops that config, pointer and TMA variants;
the results file records the drop in ``environment.gemcompile_env`` (GEMCOMPILE_BENCH_VARIANT). The A/B of
2026-12-06 ran this as scratch/dev/bench_without_dkdv64.py (the same code, the config fixed), which its files name.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def drop_configs(drops: list[str]) -> str:
    """Take each KERNEL:M,N,W,S out of that kernel's autotune list (in this process); the description that
    goes into the results file."""
    from gemcompile.lowering.jagged_attention import triton as kernels

    by_name = {"fwd": kernels._fwd_kernel, "dkdv": kernels._bwd_dkdv_kernel, "dq": kernels._bwd_dq_kernel}
    for drop in drops:
        name, _, shape = drop.partition(":")
        if name not in by_name:
            raise SystemExit(f"{drop}: the kernel must be one of {', '.join(by_name)}")
        key = tuple(int(x) for x in shape.split(","))
        kernel = by_name[name]
        kept = [c for c in kernel.configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) != key]
        if len(kept) == len(kernel.configs):
            raise SystemExit(f"{drop}: no such config in the {name} kernel's list")
        if not kept:
            raise SystemExit(f"{drop}: it is the {name} kernel's only config")
        kernel.configs = kept
    return "autotune lists without " + " ".join(drops)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit(__doc__)
    split = argv.index("--")
    os.environ["GEMCOMPILE_BENCH_VARIANT"] = drop_configs(argv[:split])
    bench_args = argv[split + 1:]
    import jagged_attention

    jagged_attention.main(bench_args)


if __name__ == "__main__":
    main(sys.argv[1:])
