"""DIN's attention pooling as CTR libraries write it: the per-token score MLP on the valid history alone.

    python benchmarks/din_pooling.py --out $OUT                      # one GPU, the defaults below
    python benchmarks/din_pooling.py --batch 4 --length 16 --steps 2 --warmup 1 --out /tmp/din   # CPU smoke run

The model (DIN, Zhou et al. 2018): a target item and a padded history of item ids (0 = padding), one item
embedding table, the local activation unit (an MLP over ``[q, k, q - k, q * k]`` of the target q and each
history item k, ``--att-hidden`` wide, one score per item), the scores masked to the valid history and used to
sum the history, then ``[pooled, q]`` through a ``--top-hidden`` MLP to one logit and BCE. Two spellings of the
pooling, ``--forms``:
- ``flat``: FuxiCTR's DIN_Attention: the MLP on ``attention_input.view(-1, 4 * E)``, the scores viewed back as
  (B, N), multiplied by the mask (passes/unpad_flat_rows.py);
- ``transposed``: DeepCTR-Torch's AttentionSequencePoolingLayer: the scores transposed to (B, 1, N), filled
  with zeros outside the (B, 1, N) mask by ``torch.where``, then ``torch.matmul`` with the history
  (unpad_masks.RowFill over rows (0, 2)).

Batches: history lengths uniform, scaled to a mean fill of ``--fill``, one full and one empty history. One
train step = forward under bf16 autocast, backward, grads set to None. Methods, in this process on the same
batches: ``inductor`` (torch.compile, default options) and ``gem`` (gem_compile, default GemConfig);
``-cudagraphs`` after a name runs it under mode="reduce-overhead" (gem packs into token buckets there), its
ratio against ``inductor-cudagraphs``. Timing: CUDA events around each step, median over ``--steps`` after
``--warmup``; ``<method>_kernel_ms``: the GPU's own time per step (three more steps under torch.profiler);
the first loss of each method; peak memory; explain's rewrite counts per form.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

from harness import format_table  # noqa: E402
from train_step_methods import (add_step_arguments, autocast_step, measure_methods, prepare,  # noqa: E402
                                record_explain)

from gemcompile import gem_compile  # noqa: E402


def _mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Din(nn.Module):
    def __init__(self, items: int, dim: int, att_hidden: list[int], top_hidden: list[int], form: str):
        super().__init__()
        self.dim, self.form = dim, form
        self.items = nn.Embedding(items, dim, padding_idx=0)
        self.attention = _mlp([4 * dim, *att_hidden, 1])
        self.top = _mlp([2 * dim, *top_hidden, 1])

    def forward(self, target, history, labels):
        q, keys = self.items(target), self.items(history)  # (B, E), (B, N, E)
        n = keys.size(1)
        mask = history > 0
        qe = q.unsqueeze(1).expand(-1, n, -1)
        att_in = torch.cat([qe, keys, qe - keys, qe * keys], dim=-1)
        if self.form == "flat":  # FuxiCTR
            w = self.attention(att_in.view(-1, 4 * self.dim)).view(-1, n) * mask.float()
            pooled = (w.unsqueeze(-1) * keys).sum(dim=1)
        else:  # DeepCTR-Torch
            w = torch.transpose(self.attention(att_in), 1, 2)
            w = torch.where(mask.unsqueeze(1), w, torch.zeros_like(w))
            pooled = torch.matmul(w, keys).squeeze(1)
        logit = self.top(torch.cat([pooled, q], dim=-1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit.float(), labels)


def _batch(args, g: torch.Generator, device):
    raw = torch.rand(args.batch, generator=g) * 2 * args.fill * args.length
    lengths = raw.round().long().clamp(0, args.length)
    lengths[0], lengths[1] = args.length, 0
    valid = torch.arange(args.length)[None, :] < lengths[:, None]
    history = torch.randint(1, args.items, (args.batch, args.length), generator=g) * valid
    target = torch.randint(1, args.items, (args.batch,), generator=g)
    labels = (torch.rand(args.batch, generator=g) < 0.3).float()
    return target.to(device), history.to(device), labels.to(device), int(valid.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--items", type=int, default=100000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--att-hidden", default="80,40", help="the local activation unit's widths (DeepCTR's default)")
    p.add_argument("--top-hidden", default="200,80")
    p.add_argument("--fill", type=float, default=0.3)
    p.add_argument("--forms", default="flat,transposed")
    add_step_arguments(p, methods="inductor,gem,inductor-cudagraphs,gem-cudagraphs")
    args, device, path, batches, payload = prepare(p, "din_pooling", _batch)
    widths = lambda text: [int(w) for w in text.split(",")]  # noqa: E731
    for form in args.forms.split(","):
        row = {"form": form, "tokens": args.batch * args.length,
               "valid_tokens": statistics.mean(b[3] for b in batches)}
        payload["rows"].append(row)
        torch.manual_seed(0)
        model = Din(args.items, args.dim, widths(args.att_hidden), widths(args.top_hidden), form).to(device)
        record_explain(row, model, *batches[0][:3])
        measure_methods(row, args.methods.split(","), lambda m, method, mode: gem_compile(m, mode=mode), model,
                        lambda fn, batch: autocast_step(fn, model, batch[:3], device), batches, args, device, path,
                        payload)
    methods = args.methods.split(",")
    columns = [("form", "form", "s"), ("valid_tokens", "valid of B x N", ".0f")] + [
        (f"{m}_ms", f"{m} ms", ".2f") for m in methods] + [
        (f"speedup_{m}_vs_inductor", f"{m} x", ".2f") for m in methods if not m.startswith("inductor")]
    print(format_table(payload["rows"], columns))
    print("wrote", path)


if __name__ == "__main__":
    main()
