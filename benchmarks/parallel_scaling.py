"""Scaling of GEM-ref training with the 5D plan: samples/s per GPU at world 1 (plain model, one GPU) and at
world N (the plan under torchrun, NCCL), with the same per-GPU batch; the ratio is Meta's "scaling ratio".

    python benchmarks/parallel_scaling.py [--out DIR] [--size small] [--batch-per-gpu 256] [--nproc 2]
                                          [--steps 20] [--warmup 5] [--compile eager|gem] [--profile]
    python benchmarks/parallel_scaling.py --smoke      # CPU, gloo, GEM-ref tiny, a few steps

The launcher runs `torchrun --standalone --nproc_per_node=1` and then `--nproc_per_node=N` of this file
in --worker mode (one process per GPU, NCCL; NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
are set unless already set, and recorded). Each step: forward under bf16 autocast, the masked BCE loss
of the global batch, backward, Adam (dense, experts) / Adagrad (tables). Timed: `--steps` steps after
`--warmup`, pre-drawn batches rotated (data generation is not timed), the slowest rank's time. One more
step runs under CollectiveCounter: the collectives per (op, mesh axis), observed and planned, go to the
JSON with the plan's axes and bytes per rank. Then 3 steps synchronized at each phase boundary
(forward + loss, backward, gradient norm, optimizer) give `phase_ms_synchronized`, and with --profile
2 steps under torch.profiler give the top operators by device time. World 1 computes no gradient norm
(nothing to reduce across meshes), which favours it. Target (issue 8): scaling ratio >= 0.9 at N = 2.
Results: `parallel_scaling-<stamp>.json` via harness.write_json ($OUT, else --out, else results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

TARGET = 0.9
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ---------------------------------------------------------------------------------------------------
# Worker: one rank of a torchrun job
# ---------------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from gemcompile.config import ParallelConfig
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config, masked_bce_loss
    from gemcompile.runtime.distributed.apply import ParallelRuntime, init_distributed
    from gemcompile.runtime.distributed.plan import plan_for_model
    from gemcompile.runtime.training.optimizers import build_optimizers

    device_type = "cpu" if args.smoke else "cuda"
    rank, world = init_distributed(device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if args.smoke:
        torch.set_num_threads(1)
    cfg = gem_ref_config(args.size)
    global_batch = args.batch_per_gpu * world
    data = SyntheticData(cfg.data_config(global_batch, fill=args.fill, seed=0))
    batches = [data.batch(i).to(device) for i in range(args.batches)]  # drawn before any timing

    torch.manual_seed(0)
    with device:
        model = GemRef(cfg)
    runtime = None
    if world > 1:  # world 1 is the plain single-GPU model: the baseline a user has without the plan
        plan = plan_for_model(model, ParallelConfig(enabled=True), world)
        runtime = ParallelRuntime.setup(model, plan, device)
        optimizers = runtime.build_optimizers(1e-3, 0.01)
    else:
        optimizers = build_optimizers(model, 1e-3, 0.01)
    runner = model
    if args.compile == "gem":
        from gemcompile import GemConfig, gem_compile
        from gemcompile.runtime.training.parallel import compile_units

        if runtime is None:
            runner = gem_compile(model, config=GemConfig())
        else:
            runner = compile_units(runtime, "gem", GemConfig(), ParallelConfig(enabled=True))

    autocast = torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    def step(i: int, marks: list | None = None) -> float:
        """One training step; with `marks`, synchronizes and appends (phase, seconds) at each boundary."""
        t0 = time.perf_counter()

        def mark(phase: str) -> None:
            nonlocal t0
            if marks is not None:
                sync()
                now = time.perf_counter()
                marks.append((phase, now - t0))
                t0 = now

        batch = batches[i % len(batches)]
        local = batch if runtime is None else runtime.local_batch(batch)
        with autocast:
            logits = runner(**local.features())
        if runtime is None:
            loss = masked_bce_loss(logits.float(), local.labels, local.label_mask)
        else:
            loss = runtime.loss(logits.float(), local.labels, local.label_mask)
        mark("forward")
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        if runtime is not None:  # as runtime/training/train.py: table gradients, the global norm (no clipping)
            runtime.finish_gradients()
            runtime.clip_grad_norm_(None)
        mark("gradients")
        for opt in optimizers:
            opt.step()
        mark("optimizer")
        return loss

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    t_start = time.perf_counter()
    first = step(0)
    first_loss = (first.item() if runtime is None else runtime.global_loss(first))
    for i in range(1, args.warmup):
        step(i)
    sync()
    warm_s = time.perf_counter() - t_start
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        last = step(args.warmup + i)
    sync()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    last_loss = last.item() if runtime is None else runtime.global_loss(last)

    observed = expected = {}
    plan_info = None
    if runtime is not None:
        counter = runtime.meshes.counter()
        with counter:
            step(args.warmup + args.steps)
        sync()
        key = lambda d: {f"{op}@{axis}": n for (op, axis), n in sorted(d.items())}
        observed, expected = key(counter.as_dict()), key(runtime.expected_collectives())
        plan = runtime.plan
        plan_info = {"axes": plan.axes.as_dict(), "embedding_sharding": plan.config.embedding_sharding,
                     "param_bytes_total": plan.total_bytes(), "param_bytes_per_rank": plan.bytes_per_rank()}
    # Where a step's time goes: the phases of 3 steps, synchronized at each boundary (slower than the
    # timed steps; for the split, not the total), and with --profile the top operators by device time.
    phases: dict[str, float] = {}
    for i in range(3):
        marks: list = []
        step(args.warmup + args.steps + 1 + i, marks)
        for phase, seconds in marks:
            phases[phase] = phases.get(phase, 0.0) + 1e3 * seconds / 3
    profile = _profile(lambda i: step(args.warmup + args.steps + 4 + i), sync, device_type) if args.profile else None
    peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else None
    peaks = [peak]
    if world > 1 and peak is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, peak)
        peaks = gathered
    seconds = float(elapsed)
    result = {
        "world": world,
        "size": args.size,
        "batch_per_gpu": args.batch_per_gpu,
        "global_batch": global_batch,
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "warmup_s": round(warm_s, 3),
        "step_ms": 1e3 * seconds / args.steps,
        "samples_per_s": global_batch * args.steps / seconds,
        "samples_per_s_per_gpu": args.batch_per_gpu * args.steps / seconds,
        "loss_first": first_loss,
        "loss_last": last_loss,
        "peak_memory_gib_per_rank": [None if p is None else round(p / 2**30, 2) for p in peaks],
        "collectives_observed": observed,
        "collectives_planned": expected,
        "collectives_as_planned": observed == expected,
        "plan": plan_info,
        "compile": args.compile,
        "phase_ms_synchronized": {k: round(v, 2) for k, v in phases.items()},
        "profile_top_ops": profile,
    }
    if rank == 0:
        Path(args.part).write_text(json.dumps(result))
    dist.destroy_process_group()


def _profile(run_step, sync, device_type: str, steps: int = 2, top: int = 25) -> list[dict]:
    """The operators with the most device time (self) over `steps` steps under torch.profiler, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            run_step(i)
        sync()
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0.0)
        rows.append({"name": e.key[:120], "calls_per_step": e.count / steps,
                     "self_device_ms_per_step": device_us / 1e3 / steps,
                     "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / steps})
    key = "self_device_ms_per_step" if device_type == "cuda" else "cpu_total_ms_per_step"
    rows.sort(key=lambda r: -r[key])
    total = sum(r["self_device_ms_per_step"] for r in rows)
    return [{"name": "(all operators: device ms per step)", "self_device_ms_per_step": total}] + rows[:top]


# ---------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------


def _launch(nproc: int, args: argparse.Namespace, part: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "--worker", "--part", str(part), "--size", args.size,
           "--batch-per-gpu", str(args.batch_per_gpu), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batches", str(args.batches), "--fill", str(args.fill), "--compile", args.compile]
    if args.smoke:
        cmd.append("--smoke")
    if args.profile:
        cmd.append("--profile")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"")[-3000:].decode(errors="replace") + "\n"
                + (e.stderr or b"")[-3000:].decode(errors="replace")).strip()
        return {"world": nproc, "error": f"timed out after {args.timeout_s} s", "log_tail": tail,
                "wall_s": round(time.perf_counter() - start, 1)}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not part.exists():
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        return {"world": nproc, "error": f"exit {proc.returncode}", "log_tail": tail, "wall_s": round(wall, 1)}
    out = json.loads(part.read_text())
    out["wall_s"] = round(wall, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory of the JSON result")
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, GEM-ref tiny, a few steps")
    parser.add_argument("--size", default=None, choices=["tiny", "small", "medium", "large"])
    parser.add_argument("--batch-per-gpu", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the parallel run (GPUs)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--batches", type=int, default=4, help="distinct pre-drawn global batches, rotated")
    parser.add_argument("--fill", type=float, default=0.5)
    parser.add_argument("--compile", choices=["eager", "gem"], default="eager")
    parser.add_argument("--timeout-s", type=int, default=170, help="limit per torchrun job")
    parser.add_argument("--profile", action="store_true",
                        help="also record the top operators by device time of 2 steps (torch.profiler)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.size = args.size or ("tiny" if smoke else "small")
    args.batch_per_gpu = args.batch_per_gpu or (8 if smoke else 256)
    args.steps = args.steps or (3 if smoke else 20)
    args.warmup = args.warmup or (2 if smoke else 5)
    if args.worker:
        _worker(args)
        return 0

    from harness import environment, format_table, write_json

    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENV_DEFAULTS.items()}}
    env.setdefault("PYTHONPATH", str(_HERE.parent))
    if smoke:
        env["OMP_NUM_THREADS"] = "1"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, args.nproc):
            run = _launch(nproc, args, Path(tmp) / f"world{nproc}.json", env)
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("log_tail",)}, default=str)[:600],
                  flush=True)
    one, many = runs
    ratio = None
    if "error" not in one and "error" not in many:
        ratio = many["samples_per_s_per_gpu"] / one["samples_per_s_per_gpu"]
    payload = {
        "benchmark": "parallel_scaling",
        "environment": {**environment(), **{k: env.get(k) for k in ENV_DEFAULTS}},
        "device": "cpu (gloo, smoke)" if smoke else "cuda (nccl)",
        "dtype": "bfloat16 (autocast)",
        "scaling_ratio": ratio,
        "target": TARGET,
        "meets_target": None if ratio is None else ratio >= TARGET,
        "runs": runs,
        "notes": "world 1 = the plain model on one GPU (no plan, no collectives); world N = the 5D plan with "
                 "default axes for one node of N (dp_shard = ep = emb_inner = N). scaling_ratio = samples/s per "
                 "GPU at N / at 1, same per-GPU batch.",
    }
    path = write_json("parallel_scaling" + ("-smoke" if smoke else ""), payload, args.out)
    rows = [{"world": r.get("world"), "step_ms": r.get("step_ms"), "sps": r.get("samples_per_s_per_gpu"),
             "loss": r.get("loss_last"), "coll": r.get("collectives_as_planned"), "err": r.get("error")}
            for r in runs]
    print(format_table(rows, [("world", "world", "d"), ("step_ms", "step ms", ".1f"),
                              ("sps", "samples/s/GPU", ".1f"), ("loss", "last loss", ".4f"),
                              ("coll", "collectives as planned", "") , ("err", "error", "s")]))
    print(f"scaling ratio {ratio if ratio is None else round(ratio, 3)} (target {TARGET}); wrote {path}")
    return 0 if ratio is not None else 1


if __name__ == "__main__":
    sys.exit(main())
