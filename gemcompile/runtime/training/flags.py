"""`gemcompile train`: its flags (TrainConfig's fields, and the parallel plan's sizes under --parallel) and
how a parsed command line runs (cli.py wires the subcommand to add_train_arguments and run_train_from_args).
"""

from __future__ import annotations

import argparse
import os
import sys

from gemcompile.config import ParallelConfig
from gemcompile.runtime.training.checkpoint import FAILURES, failure_cause
from gemcompile.runtime.training.config import (
    COMPILE_MODES,
    DEFAULT_BATCH_SIZE,
    DEVICES,
    DTYPES,
    LENGTH_DISTS,
    MXFP8_RECIPES,
    SIZES,
    TrainConfig,
)
from gemcompile.runtime.training.train import train

__all__ = ["add_debug_argument", "add_parallel_arguments", "add_train_arguments", "config_from_args",
           "parallel_config_from_args", "report_error", "run_train_from_args"]


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `gemcompile train` flags to `parser` (defaults are TrainConfig's)."""
    defaults = TrainConfig()
    parser.add_argument("--size", choices=SIZES, default=defaults.size, help="model and data preset")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per step (default per size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH_SIZE.items())
        + ")",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (dense parameters)")
    parser.add_argument(
        "--embedding-lr",
        type=float,
        default=defaults.embedding_lr,
        help="Adagrad learning rate (embedding tables)",
    )
    parser.add_argument(
        "--compile", choices=COMPILE_MODES, default=defaults.compile, help="how the model runs"
    )
    parser.add_argument("--device", choices=DEVICES, default=defaults.device)
    parser.add_argument(
        "--dtype", choices=DTYPES, default=defaults.dtype, help="bfloat16 = forward under torch.autocast"
    )
    parser.add_argument(
        "--fill", type=float, default=defaults.fill, help="mean length / padded length, in (0, 1]"
    )
    parser.add_argument("--length-dist", choices=LENGTH_DISTS, default=defaults.length_dist)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--log-every", type=int, default=defaults.log_every, help="steps per metrics window")
    parser.add_argument("--checkpoint-dir", default=None, help="directory of DCP checkpoints")
    parser.add_argument("--save-every", type=int, default=None, help="save a checkpoint every N steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint that verifies")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms (bit-exact resume under torch.compile)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print what gemcompile's passes rewrite before training (--compile gem)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    add_debug_argument(parser)
    parser.add_argument("--mxfp8", choices=MXFP8_RECIPES, default=None, metavar="RECIPE",
                        help="block-scaled FP8 GEMMs with this recipe (" + ", ".join(MXFP8_RECIPES)
                        + "; --compile gem)")
    parser.add_argument("--mxfp8-min-dim", type=int, default=None, metavar="N",
                        help="with --mxfp8: quantize layers whose tokens, in and out features are all >= N "
                        "(default: the pass's 16384 tokens / 2048 features)")
    parser.add_argument("--memory-budget", type=float, default=None, metavar="FRACTION",
                        help="activation memory budget in (0, 1] for gem_compile's partitioner: save less, "
                        "recompute more (--compile gem)")
    parser.add_argument("--fp8-saved", action="store_true",
                        help="save the inputs of the Linear layers' weight gradients in FP8 (--compile gem)")
    parser.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                        help="clip the global gradient norm (all meshes when --parallel)")
    parser.add_argument("--dense-tables", action="store_true",
                        help="train the embedding tables with dense gradients and torch's Adagrad (default: "
                        "sparse row updates, the same update, on the local shards with --parallel; dense "
                        "anyway with --grad-clip)")
    add_parallel_arguments(parser)
    return parser


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback instead of one line")


REPORTED = (*FAILURES, KeyboardInterrupt)
"""What a command reports as one line (checkpoint failures are BaseExceptions: checkpoint.FAILURES)."""


def report_error(command: str, error: BaseException, debug: bool) -> int:
    """What a command does with an exception: with --debug, re-raise it (the traceback); else one line
    on stderr and the exit status: 2 for a bad argument, path, input or checkpoint (ValueError,
    TypeError, OSError), 1 for anything else, 130 for Ctrl-C. A checkpoint failure is reported by its
    cause (a full disk is an OSError)."""
    original, error = error, failure_cause(error)
    if isinstance(error, KeyboardInterrupt):
        print(f"gemcompile {command}: interrupted", file=sys.stderr)
        return 130
    if debug:
        raise original
    expected = isinstance(error, (ValueError, TypeError, OSError))
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if not expected or not line:
        line = f"{type(error).__name__}: {line}".rstrip(": ") + " (run with --debug for the traceback)"
    if not (getattr(error, "same_on_every_rank", False) and _another_rank_says_it()):  # once under torchrun
        print(f"gemcompile {command}: error: {line}", file=sys.stderr, flush=True)
    return 2 if expected else 1


def _another_rank_says_it() -> bool:
    """Whether this process is one of several ranks and not rank 0 (the process group's, or torchrun's
    RANK and WORLD_SIZE before it exists): a stray RANK=1 in a one-process run must not hide its errors."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1 and dist.get_rank() != 0
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0"
    except ValueError:  # WORLD_SIZE=abc: said by every process (the flags' own check names it)
        return False


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed `gemcompile train` flags (ValueError on a bad value)."""
    return TrainConfig(
        size=args.size,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        embedding_lr=args.embedding_lr,
        compile=args.compile,
        device=args.device,
        dtype=args.dtype,
        fill=args.fill,
        length_dist=args.length_dist,
        seed=args.seed,
        log_every=args.log_every,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        resume=args.resume,
        deterministic=args.deterministic,
        explain=args.explain,
        quiet=args.quiet,
        mxfp8=args.mxfp8,
        mxfp8_min_dim=args.mxfp8_min_dim,
        memory_budget=getattr(args, "memory_budget", None),
        fp8_saved=getattr(args, "fp8_saved", False),
        grad_clip=getattr(args, "grad_clip", None),
        sparse_tables=False if getattr(args, "dense_tables", False) else None,
        parallel=parallel_config_from_args(args),
    )


def run_train_from_args(args: argparse.Namespace) -> int:
    """Run `gemcompile train`; returns the exit status. Every failure is one error line on stderr (exit 2
    for a bad flag value, path, input or checkpoint, 1 otherwise), never a traceback unless --debug."""
    try:
        train(config_from_args(args))
    except REPORTED as e:
        return report_error("train", e, getattr(args, "debug", False))
    return 0


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The --parallel flags of `gemcompile train` (sizes left out are derived from the world size)."""
    group = parser.add_argument_group("parallel (run under torchrun)")
    group.add_argument("--parallel", action="store_true",
                       help="train with the 5D plan: one process per rank, started by torchrun")
    for axis, what in (("dp-replicate", "replicas of the dense weights (across nodes)"),
                       ("dp-shard", "FSDP shards of the dense weights (inside a node)"),
                       ("ep", "expert-parallel ranks (divides dp-shard and the expert count)"),
                       ("emb-outer", "embedding column groups / replica groups (across nodes)"),
                       ("emb-inner", "embedding row shards (inside a node)"),
                       ("gpus-per-node", "ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")):
        group.add_argument(f"--{axis}", type=int, default=None, metavar="N", help=what)
    group.add_argument("--embedding-sharding", choices=("grid", "replicated_groups"), default="grid",
                       help="grid: tables fully sharded (columns x rows); replicated_groups: rows sharded, "
                       "replicated over emb-outer")
    group.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                       help="how long a collective waits for the other ranks before the run stops with an "
                       "error (a hung or suspended rank); default: torch's (30 min gloo, 10 min NCCL)")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig | None:
    """ParallelConfig from the flags (None without --parallel); a flag given without --parallel is an
    error."""
    names = ("dp_replicate", "dp_shard", "ep", "emb_outer", "emb_inner", "gpus_per_node")
    sizes = {n: getattr(args, n, None) for n in names}
    sharding = getattr(args, "embedding_sharding", "grid")
    timeout = getattr(args, "collective_timeout", None)
    if not getattr(args, "parallel", False):
        given = [n for n, v in sizes.items() if v is not None] + (["embedding_sharding"] if sharding != "grid"
                                                                   else [])
        given += ["collective_timeout"] if timeout is not None else []
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --parallel")
        _check_one_process()
        return None
    return ParallelConfig(enabled=True, embedding_sharding=sharding, collective_timeout_s=timeout, **sizes)


def _check_one_process() -> None:
    """Without --parallel, one process trains: under torchrun each rank trained the whole model alone, and
    with a checkpoint directory all but one stopped on its lock ("another run is writing checkpoints")."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        error = ValueError(f"WORLD_SIZE={world}: {world} processes were started (torchrun) but --parallel "
                           "is not given, so each would train the whole model alone; pass --parallel, or run "
                           "one process")
        error.same_on_every_rank = True  # every rank finds it: said once
        raise error
