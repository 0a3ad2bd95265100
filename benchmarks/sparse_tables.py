"""Embedding tables trained three ways, one training step of the tables alone (lookups forward, backward,
optimizer step), side by side in one process on GEM-ref's table shapes:

- ``dense``: nn.Embedding / nn.EmbeddingBag with a dense (rows x dim) gradient and torch's Adagrad (foreach
  on CUDA): what a model gets by default, and what the e2e peers run;
- ``torch-sparse``: the same modules with ``sparse=True`` (torch's sparse COO gradient) and torch's Adagrad,
  as nn.Embedding's documentation offers for large tables;
- ``sparse-rows``: gemcompile's row gradients and SparseAdagrad (runtime/tables/sparse_adagrad.py);
- ``sparse-rows-batched``: the same, with the bag tables looked up in one gemcompile::sparse_embedding_bags
  call, as passes/table_batching.py rewrites a compiled model's lookups (here called eagerly).

Per method: the median step time (triton.testing.do_bench), the optimizer step alone (CUDA events around
``step()`` over the timed steps, and the host's wall time inside ``step()``), and the tables' max difference
from ``dense`` after three identical steps (the update must be the same). The ids follow the synthetic data
of ``gemcompile bench e2e``: multi-hot bags with padding for the sparse tables, padded item sequences at the
given fill for the item table.

    python benchmarks/sparse_tables.py --size medium --batch-size 256 [--kernel-profile] [--host-profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import bench_ms, environment, kernel_times, write_json  # noqa: E402

from gemcompile.lowering.sparse_embedding.bags import sparse_embedding_bags  # noqa: E402
from gemcompile.lowering.sparse_embedding.op import MODE_SUM  # noqa: E402
from gemcompile.models.data import SyntheticData  # noqa: E402
from gemcompile.models.gem import gem_ref_config  # noqa: E402
from gemcompile.runtime.training.host_profile import profile_summary  # noqa: E402
from gemcompile.runtime.training.optimizers import build_optimizers  # noqa: E402

METHODS = ("dense", "torch-sparse", "sparse-rows", "sparse-rows-batched")


class Tables(nn.Module):
    """GEM-ref's big tables: one EmbeddingBag per sparse feature and the item table shared by the sequences."""

    def __init__(self, cfg):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(cfg.table_rows, cfg.table_dim, mode="sum", padding_idx=0)
                                  for _ in range(cfg.n_tables))
        self.item = nn.Embedding(cfg.item_vocab, cfg.d_item, padding_idx=0)

    batched = False
    """Bag lookups in one sparse_embedding_bags call (what the table_batching pass emits)."""

    def forward(self, sparse_ids, seq_items):
        if self.batched:
            ids = torch.stack([sparse_ids[:, i] for i in range(len(self.bags))])
            pooled = sparse_embedding_bags(ids, [t.weight for t in self.bags], self.bags[0].row_grad_token, MODE_SUM,
                                           0, [t.table_key for t in self.bags]).transpose(0, 1)
        else:
            pooled = torch.stack([t(sparse_ids[:, i]) for i, t in enumerate(self.bags)], 1)  # (B, T, dim)
        seqs = [self.item(items) for items in seq_items]
        return pooled.square().mean() + sum(s.square().mean() for s in seqs)


def _method_model(base: Tables, method: str) -> tuple[Tables, list[torch.optim.Optimizer]]:
    model = copy.deepcopy(base)
    if method == "torch-sparse":
        for m in model.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                m.sparse = True
    optimizers = build_optimizers(model, 1e-3, 0.01, sparse_embeddings=method.startswith("sparse-rows"))
    model.batched = method == "sparse-rows-batched"
    return model, optimizers


def _step(model, optimizers, batch, events=None, profiler=None):
    loss = model(batch.sparse_ids, batch.seq_items)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    if events is not None:
        events[0].record()
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    for opt in optimizers:
        opt.step()
    host_ms = (time.perf_counter() - start) * 1e3
    if profiler is not None:
        profiler.disable()
    if events is not None:
        events[1].record()
    return host_ms


def _host_profile(model, optimizers, batch, steps: int = 10) -> dict:
    """The host's busiest functions inside the optimizers' step() (cProfile over `steps` steps; the
    forward and backward are not profiled): what the step's wall time goes to."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        _step(model, optimizers, batch, profiler=profiler)
        torch.cuda.synchronize()
    return profile_summary(profiler, steps)


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fill", type=float, default=0.5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernel-profile", action="store_true",
                        help="record each method's kernels per step (forward, backward, optimizer; torch.profiler)")
    parser.add_argument("--host-profile", action="store_true",
                        help="the host's busiest functions in the optimizers' step() (cProfile)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = gem_ref_config(args.size)
    data = SyntheticData(cfg.data_config(args.batch_size, fill=args.fill, seed=0))
    batches = [data.batch(i).to(device) for i in range(4)]
    torch.manual_seed(0)
    base = Tables(cfg).to(device)
    results, finals = [], {}
    for method in args.methods.split(","):
        model, optimizers = _method_model(base, method)
        for b in batches[:3]:  # three identical steps: the tables must agree across methods
            _step(model, optimizers, b)
        finals[method] = [model.item.weight.detach().clone(), model.bags[0].weight.detach().clone()]
        if device.type == "cuda":
            step_ms = bench_ms(lambda: _step(model, optimizers, batches[3]), warmup_ms=50, rep_ms=300)
        else:  # a smoke run: wall time, median of five
            step_ms = statistics.median(_wall_ms(lambda: _step(model, optimizers, batches[3])) for _ in range(5))
        opt_ms, host_ms = [], []
        if device.type == "cuda":
            for _ in range(10):
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                host_ms.append(_step(model, optimizers, batches[3], ev))
                torch.cuda.synchronize()
                opt_ms.append(ev[0].elapsed_time(ev[1]))
        row = {"method": method, "step_ms": step_ms, "optimizer_ms": statistics.median(opt_ms) if opt_ms else None,
               "optimizer_host_ms": statistics.median(host_ms) if host_ms else None,
               "optimizers": [type(o).__name__ for o in optimizers]}
        if args.host_profile and device.type == "cuda":
            row["optimizer_host_profile"] = _host_profile(model, optimizers, batches[3])
        if args.kernel_profile and device.type == "cuda":
            row["step_kernels"] = kernel_times(lambda: _step(model, optimizers, batches[3]), top=30)
        if "dense" in finals:
            row["max_abs_diff_vs_dense"] = max((a - b).abs().max().item() for a, b in zip(finals[method], finals["dense"]))
        results.append(row)
        print(row, flush=True)
        del model, optimizers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dense = next((r for r in results if r["method"] == "dense"), None)
    for r in results:
        if dense is not None:
            r["step_speedup_vs_dense"] = dense["step_ms"] / r["step_ms"]
            if r["optimizer_ms"] and dense["optimizer_ms"]:
                r["optimizer_share_of_dense"] = r["optimizer_ms"] / dense["optimizer_ms"]
    payload = {"benchmark": "sparse_tables", "environment": environment(),
               "config": {"size": args.size, "batch_size": args.batch_size, "fill": args.fill,
                          "n_tables": cfg.n_tables, "table_rows": cfg.table_rows, "table_dim": cfg.table_dim,
                          "item_vocab": cfg.item_vocab, "d_item": cfg.d_item},
               "results": results,
               "notes": "fbgemm-gpu was not measured: its wheel (1.9.0, ~500 MB) exceeds what can be carried to "
                        "the GPU machine (no network there), and it is built against another torch release"}
    print(write_json(f"sparse_tables-{args.size}-b{args.batch_size}", payload, args.out))


if __name__ == "__main__":
    main()
