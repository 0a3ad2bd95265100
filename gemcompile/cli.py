"""The `gemcompile` command: explain | train | bench. A thin layer over the Python API."""

from __future__ import annotations

import argparse
import shlex
import sys


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gem-ref", choices=["gem-ref"], help="the model to explain")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "medium", "large"], help="GEM-ref size")
    parser.add_argument("--batch-size", type=int, default=8, help="batch of the example inputs")
    parser.add_argument("--fill", type=float, default=0.5, help="mean sequence length / max length, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable", action="append", default=[], metavar="PASS",
                        help="turn a pass off (repeatable), e.g. --disable jagged_attention")
    parser.add_argument("--enable", action="append", default=[], metavar="PASS",
                        help="turn on a pass that is off by default (repeatable), e.g. --enable mxfp8")
    parser.add_argument("--memory-budget", type=float, default=None, metavar="FRACTION",
                        help="activation memory budget in (0, 1] (GemConfig.memory.budget): the saved-tensor "
                        "tables then show what it recomputes and the bytes saved with no budget")
    parser.add_argument("--fp8-saved", action="store_true",
                        help="save Linear inputs for their weight gradients in FP8 (GemConfig.memory.fp8_saved): "
                        "the saved-tensor tables show the dtype and bytes before and after")
    parser.add_argument("--graphs", action="store_true", help="also print the Dynamo graph after the passes")
    parser.add_argument("--width", type=int, default=None, help="terminal width for the report")
    _debug_argument(parser)


def _debug_argument(parser: argparse.ArgumentParser) -> None:
    from gemcompile.runtime.training.flags import add_debug_argument

    add_debug_argument(parser)


def explain_gem_ref(size: str = "tiny", *, batch_size: int = 8, fill: float = 0.5, seed: int = 0,
                    config=None, sparse_tables: bool = True):
    """Explain GEM-ref of one size on a synthetic batch: (ExplainReport, Batch). What `gemcompile explain`
    prints, as values (the golden test of the rewrites reads it). ``sparse_tables``: the tables train on
    their looked-up rows, as `gemcompile train` trains them by default (the lookups the passes see)."""
    import torch

    from gemcompile import explain
    from gemcompile.models.data import SyntheticData
    from gemcompile.models.gem import GemRef, gem_ref_config

    model_config = gem_ref_config(size)
    torch.manual_seed(seed)
    batch = SyntheticData(model_config.data_config(batch_size=batch_size, fill=fill, seed=seed)).batch(0)
    # small and large are explained on the meta device: the graph and the passes need shapes, not the
    # gigabytes of their embedding tables
    device = torch.device("cpu" if size == "tiny" else "meta")
    with device:
        model = GemRef(model_config)
    if sparse_tables:
        from gemcompile.runtime.tables.sparse_tables import use_sparse_row_gradients

        use_sparse_row_gradients(model)
    features = {name: [t.to(device) for t in value] if isinstance(value, list) else value.to(device)
                for name, value in batch.features().items()}
    return explain(model, **features, config=config), batch


def run_explain(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gemcompile import GemConfig

    if args.width is not None and not 40 <= args.width <= 1000:
        raise ValueError(f"--width {args.width}: the report needs 40 to 1000 columns")
    sections: dict = {}
    defaults = GemConfig()
    valid = [name for name in GemConfig.__dataclass_fields__ if hasattr(getattr(defaults, name), "enabled")]
    for flag, names, enabled in (("--disable", args.disable, False), ("--enable", args.enable, True)):
        for name in names:
            if name not in valid:
                raise ValueError(f"{flag} {name}: unknown pass; passes: {', '.join(valid)}")
            sections[name] = {"enabled": enabled}
    both = sorted(set(args.disable) & set(args.enable))  # the last flag silently won
    if both:
        raise ValueError(f"--disable {both[0]} and --enable {both[0]}: a pass is either enabled or disabled")
    if args.memory_budget is not None:
        sections["memory"] = {"budget": args.memory_budget}
    if args.fp8_saved:
        sections.setdefault("memory", {})["fp8_saved"] = True
    report, batch = explain_gem_ref(args.size, batch_size=args.batch_size, fill=args.fill, seed=args.seed,
                                    config=GemConfig(**sections))
    console = Console(width=args.width)
    console.print(f"[bold]GEM-ref {args.size}[/bold]: batch {args.batch_size}, fill {args.fill}, "
                  f"padding efficiency {batch.padding_efficiency():.2f}")
    console.print(report)
    savings = unpad_savings_table(report, batch.seq_lengths)
    if savings is not None:
        console.print(savings)
    if args.graphs and report.graph_after is not None:
        console.print(report.graph_after.code, markup=False, highlight=False)
    return 0


def unpad_savings_table(report, seq_lengths):
    """A rich Table: for each unpad region, the GEMM FLOPs one training step skips at this batch's lengths
    (6 x MACs per token x padding tokens: forward, and the backward's two GEMMs per forward GEMM)."""
    from rich.table import Table

    rewrites = [r for r in report.rewrites if r.pass_name == "unpad" and r.metrics]
    if not rewrites:
        return None
    table = Table(title="unpad: GEMM FLOPs skipped per training step at this batch", title_justify="left")
    for col in ("region (lengths)", "B x N", "valid tokens T", "MACs/token", "FLOPs saved/step", "of region's"):
        table.add_column(col, justify="left" if col.startswith("region") else "right")
    for r in rewrites:
        m = r.metrics
        path = m.get("lengths_input") or ()  # ("seq_lengths", k) when the lengths are an input of the model
        k = path[1] if len(path) == 2 and path[0] == "seq_lengths" and isinstance(path[1], int) else None
        if k is None or k >= len(seq_lengths):
            table.add_row(m["lengths"], f"{m['batch']} x {m['seq']}", "?", str(m["macs_per_token"]), "?", "?")
            continue
        padded = m["batch"] * m["seq"]
        valid = int(seq_lengths[k].clamp(0, m["seq"]).sum())
        saved = 6 * m["macs_per_token"] * (padded - valid)
        table.add_row(m["lengths"], f"{m['batch']} x {m['seq']}", f"{valid} ({valid / padded:.0%})",
                      f"{m['macs_per_token']:,}", f"{saved / 1e9:,.3f} GFLOP", f"{(padded - valid) / padded:.0%}")
    return table


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    e2e = sub.add_parser("e2e", help="GEM-ref training step: eager, torch.compile, gem_compile with each pass "
                                     "group on and off")
    e2e.add_argument("--size", default="small", choices=["tiny", "small", "medium", "large"], help="GEM-ref size")
    e2e.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the size's)")
    e2e.add_argument("--fill", type=float, default=0.5, help="mean sequence length / max length")
    e2e.add_argument("--steps", type=int, default=50, help="measured steps (lengths vary per batch)")
    e2e.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    e2e.add_argument("--seed", type=int, default=0,
                     help="model initialization and data seed, the same for every method (another seed: the "
                          "run-to-run noise that NE differences are read against)")
    e2e.add_argument("--methods", default="eager,inductor,gem",
                     help="comma-separated: eager, inductor, gem, gem-no-<pass>, gem+mxfp8, or 'all'; a "
                     "compiled method may end in @reduce-overhead (CUDA graphs) or @cpp-wrapper (Inductor's C++ "
                     "launcher), e.g. inductor@reduce-overhead, gem@cpp-wrapper")
    e2e.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    e2e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    e2e.add_argument("--layers", action="store_true", help="also measure each layer's local MFU")
    e2e.add_argument("--memory-snapshot", action="store_true",
                     help="per method one more step under torch's CUDA memory history: the peak and what is "
                     "alive there, grouped by allocating frame (results: memory_snapshot; CUDA)")
    e2e.add_argument("--kernel-steps", type=int, default=3,
                     help="steps after the measured ones under torch.profiler: kernel time per step and its "
                          "classes (0 skips them, and the time their profile takes)")
    e2e.add_argument("--kernel-top", type=int, default=40,
                     help="kernels with the most device time listed per method (results: kernel_profile.top)")
    e2e.add_argument("--host-profile-steps", type=int, default=0,
                     help="steps after the measured ones under cProfile: the host's busiest functions per "
                          "method (results: host_profile)")
    e2e.add_argument("--out", default=None, help="directory of the results JSON (default: print only)")
    _debug_argument(e2e)


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from gemcompile.runtime.training.e2e_bench import E2EBenchConfig, available_methods, run_e2e_bench

    methods = available_methods() if args.methods == "all" else [m for m in args.methods.split(",") if m]
    if args.device == "cuda" and not torch.cuda.is_available():  # else every method failed on it, exit 0
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                         "use --device cpu")
    cfg = E2EBenchConfig(size=args.size, batch_size=args.batch_size, fill=args.fill, steps=args.steps,
                         warmup=args.warmup, methods=tuple(methods), device=args.device, dtype=args.dtype,
                         layers=args.layers, memory_snapshot=args.memory_snapshot, kernel_steps=args.kernel_steps,
                         kernel_top=args.kernel_top,
                         host_profile_steps=args.host_profile_steps, seed=args.seed)
    command = " ".join(shlex.quote(a) for a in ["gemcompile", *args.argv])
    path = None
    if args.out:
        import datetime

        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = Path(args.out) / f"e2e-{args.size}-fill{args.fill}-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(payload: dict) -> None:
        # the command that made the numbers travels with them (results JSON convention, benchmarks/harness.py)
        payload["command"] = command
        if path is not None:
            path.write_text(json.dumps(payload, indent=1))

    payload = run_e2e_bench(cfg, on_progress=write)
    write(payload)
    if path is not None:
        print(f"results in {path}")
    failed = [r["method"] for r in payload["results"] if "error" in r]
    if len(failed) == len(payload["results"]):  # nothing measured: not a success (each error is above)
        print(f"gemcompile bench: error: every method failed: {', '.join(failed)} (each error is above)",
              file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gemcompile.runtime.training.flags import add_train_arguments

    parser = argparse.ArgumentParser(prog="gemcompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    explain_parser = sub.add_parser("explain", help="show what gemcompile's passes do to a model")
    _explain_arguments(explain_parser)
    train_parser = sub.add_parser("train", help="train GEM-ref on synthetic data")
    add_train_arguments(train_parser)
    bench_parser = sub.add_parser("bench", help="benchmarks (e2e: the GEM-ref training step, side by side)")
    _bench_arguments(bench_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status. Every failure is one line on stderr (exit 2 for bad
    input, 1 otherwise) and no traceback, unless --debug."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the user typed, for results JSON
    from gemcompile.runtime.training.flags import REPORTED, report_error, run_train_from_args

    try:
        if args.command == "explain":
            return run_explain(args)
        if args.command == "bench":
            return run_bench(args)
        try:
            return run_train_from_args(args)
        finally:  # `torchrun ... train --parallel`: leave the process group cleanly
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    except REPORTED as e:
        # One clear line, no traceback from deep inside torch (--debug shows it).
        return report_error(args.command, e, args.debug)


if __name__ == "__main__":
    sys.exit(main())
