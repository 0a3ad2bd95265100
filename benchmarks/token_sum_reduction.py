"""GPU time of a norm-weight gradient (a sum over tokens) compiled by Inductor, by how the token count is known.

    python benchmarks/token_sum_reduction.py --out $OUT

sum over T of dy * (x - mean) * rstd, bf16 (T, D) inputs, fp32 (T, 1) statistics, as GEM-ref medium's
backward has it (T ~ 265k packed tokens, D 512). Compiled four ways: T static; T dynamic (a backed
symbol); T data-dependent (an unbacked symbol, as packed tokens are) summed as is; and the unbacked T
padded with zero rows to its static bound first (passes/unpad_reductions.py, what gemcompile does where
Inductor cannot split reductions over unbacked sizes). Median CUDA-event ms, and the bandwidth it implies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_json  # noqa: E402


def weight_grad(dy, x, mean, rstd):
    return (dy.float() * ((x.float() - mean) * rstd)).sum(0)


def _time_ms(fn, *args, reps: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=265_076)
    parser.add_argument("--bound", type=int, default=524_288)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    T, D, bound = args.tokens, args.dim, args.bound
    dev = torch.device("cuda")
    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    mean, rstd = torch.randn(T, 1, device=dev), torch.rand(T, 1, device=dev)
    want = weight_grad(dy, x, mean, rstd)
    count = torch.tensor([T], device=dev)

    def unbacked(dy, x, mean, rstd, count, pad):
        n = count.item()
        torch._check(n <= dy.shape[0])
        torch._check_is_size(n)
        parts = [t[:n] for t in (dy, x, mean, rstd)]
        if pad:
            parts = [torch.nn.functional.pad(t, (0, 0, 0, bound - n)) for t in parts]
        return weight_grad(*parts)

    rows = []
    torch._dynamo.config.capture_scalar_outputs = True
    from torch._inductor.choices import InductorChoices
    from torch._inductor.codegen.triton import FixedTritonConfig
    from torch._inductor.virtualized import V

    class Fixed(InductorChoices):
        """Every reduction over one dim with a fixed block config (to time configs against Inductor's)."""

        def __init__(self, config):
            super().__init__()
            self.config = config

        def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
            if features.is_reduction() and groups and set(groups[0]) == {"x", "r0_"} and \
                    not kernel_kwargs.get("override_persistent_reduction"):
                kernel_kwargs = {**kernel_kwargs, "fixed_config": FixedTritonConfig(dict(self.config)),
                                 "override_persistent_reduction": False, "override_cooperative_reduction": False}
            return kernel_kwargs

    def with_choices(fn, config):
        def call(*a):
            with V.set_choices_handler(Fixed(config)):
                return fn(*a)
        return call

    cases = {
        "static": (torch.compile(weight_grad, dynamic=False), (dy, x, mean, rstd)),
        "dynamic": (torch.compile(weight_grad, dynamic=True), (dy, x, mean, rstd)),
        "unbacked": (torch.compile(lambda *a: unbacked(*a, pad=False)), (dy, x, mean, rstd, count)),
        "unbacked_padded": (torch.compile(lambda *a: unbacked(*a, pad=True)), (dy, x, mean, rstd, count)),
    }
    for name, config in {"x64_r8_w8": {"XBLOCK": 64, "R0_BLOCK": 8, "num_warps": 8},
                         "x32_r64_w4": {"XBLOCK": 32, "R0_BLOCK": 64, "num_warps": 4},
                         "x128_r16_w8": {"XBLOCK": 128, "R0_BLOCK": 16, "num_warps": 8},
                         "x64_r32_w8": {"XBLOCK": 64, "R0_BLOCK": 32, "num_warps": 8}}.items():
        for pad in (False, True):
            fn = with_choices(torch.compile(lambda *a, pad=pad: unbacked(*a, pad=pad)), config)
            cases[f"unbacked{'_padded' if pad else ''}_{name}"] = (fn, (dy, x, mean, rstd, count))
    bytes_read = 2 * T * D * 2 + 2 * T * 4
    torch._inductor.config.fx_graph_cache = False  # each case compiles its own kernels
    for name, (fn, inputs) in cases.items():
        torch._dynamo.reset()
        try:
            got = fn(*inputs)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-1)
            ms = _time_ms(fn, *inputs)
            rows.append({"case": name, "ms": ms, "tb_per_s": bytes_read / ms / 1e9})
        except Exception as e:  # report, keep the other cases
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows[-1], flush=True)
    path = write_json("token_sum_reduction", {"benchmark": "token_sum_reduction", "tokens": T, "dim": D,
                                              "bound": bound, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
