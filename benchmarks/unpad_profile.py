"""Where the GPU time of the unpad sequence-tower step goes: the top CUDA kernels per method.

    python benchmarks/unpad_profile.py --out $OUT      # one GPU; GEM-ref small, B 256, fill 0.7

Compiles the SequenceTower of benchmarks/unpad.py under each variant, times a few steps and profiles
three with torch.profiler; prints and writes (JSON) the kernels that take the most GPU time. Variants:
gem (unpad on), gem-no-unpad, and gem with Inductor's size hint for the packed token count (an unbacked
SymInt) set to B*N*fill instead of Inductor's default fallback, to see whether the kernel choices made
without a hint are what costs time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import environment, write_json
from unpad import build_tower, make_x_sums

from gemcompile import GemConfig, gem_compile
from gemcompile.models.data import SyntheticData


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fill", type=float, default=0.7)
    parser.add_argument("--variants", default="gem,gem-no-unpad,gem-hint")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    tower, model_cfg = build_tower(args.size, 0, device)
    x_sums = make_x_sums(model_cfg, args.batch_size, 0, device, torch.bfloat16)
    data = SyntheticData(model_cfg.data_config(args.batch_size, fill=args.fill, seed=0))
    batches = [data.batch(i).to(device) for i in range(4)]
    padded = args.batch_size * max(model_cfg.seq_max_lens)
    report = {"command": " ".join(sys.argv), "environment": environment(), "fill": args.fill, "variants": {}}

    for variant in args.variants.split(","):
        torch._dynamo.reset()
        config = GemConfig(unpad={"enabled": variant != "gem-no-unpad"})
        runner = gem_compile(tower, config=config)
        patches = {"unbacked_symint_fallback": int(padded * args.fill)} if variant == "gem-hint" else {}

        def step(batch, runner=runner):
            tower.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = runner(batch.seq_items, batch.seq_actions, batch.seq_times, batch.seq_lengths, x_sums)
            out.float().square().mean().backward()

        t0 = time.perf_counter()
        with torch._inductor.config.patch(patches):
            step(batches[0])
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        for i in range(3):
            step(batches[i % 4])
        times = []
        for i in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(batches[i % 4])
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                step(batches[i % 4])
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if cuda_us:
                kernels[e.key] = kernels.get(e.key, 0.0) + cuda_us / 3 / 1000  # ms per step
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
        total = sum(kernels.values())
        print(f"== {variant}: {statistics.median(times):.2f} ms/step (events), GPU kernels {total:.2f} ms/step, "
              f"compile {compile_s:.0f} s", flush=True)
        for name, ms in top:
            print(f"  {ms:7.3f} ms  {name[:150]}", flush=True)
        report["variants"][variant] = {"ms_per_step": statistics.median(times), "gpu_kernel_ms_per_step": total,
                                       "compile_s": compile_s, "top_kernels_ms_per_step": top}
    path = write_json("unpad-profile", report, out_dir=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
