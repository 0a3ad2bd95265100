"""A masked item model's training step (BERT4Rec): the head and its loss on the masked positions alone.

    python benchmarks/masked_item_loss.py --out $OUT                  # one GPU, the defaults below
    python benchmarks/masked_item_loss.py --batch 4 --length 16 --items 50 --steps 2 --warmup 1 \
        --out /tmp/mil                                               # CPU smoke run (no timing claims)

The model, as BERT4Rec's public PyTorch ports write it (BERT4Rec-VAE-Pytorch): item and position embeddings,
``--layers`` post-norm encoder blocks (SDPA with the key-padding mask ``ids > 0``, dropout ``--dropout`` on
the attention output and the FFN as BERT4Rec trains), ``nn.Linear(hidden, items)`` onto every item, and
``nn.CrossEntropyLoss(ignore_index=0)(logits.view(-1, items), labels.view(-1))``: labels hold the item at a
share ``--mask-prob`` of the valid positions (the masked ones) and 0 elsewhere. The B x N x items logits are
the step's largest tensor; only the masked positions' rows reach the loss.

Batches: lengths uniform, scaled to a mean fill of ``--fill``, one full-length sequence, right padding. One
train step = forward under bf16 autocast, backward, grads set to None. Methods, in this process on the same
batches: ``inductor`` (torch.compile, default options), ``gem`` (gem_compile, default GemConfig: the head
and the loss run on the masked positions, passes/unpad_losses.py) and ``gem-losses-padded``
(UnpadConfig.packed_losses=False: the loss on every row, as before); ``-cudagraphs`` after a name runs it
under mode="reduce-overhead" (a host-bound step replayed as CUDA graphs; gem packs into token buckets
there), its ratio against ``inductor-cudagraphs``. Timing: CUDA events around each step,
median over ``--steps`` after ``--warmup``; ``<method>_kernel_ms``: the GPU's own time per step (three more
steps under torch.profiler); the first loss of each method (dropout draws differ between methods: equal
within dropout's noise, not bit for bit); peak memory; explain's rewrite counts.
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

from gemcompile import GemConfig, gem_compile  # noqa: E402


class Block(nn.Module):
    """A post-norm encoder block: SDPA with the key-padding mask, a GELU FFN, dropout on both outputs."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, keys):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).reshape(b, n, e)
        x = self.norm1(x + self.dropout(self.proj(a)))
        return self.norm2(x + self.dropout(self.down(F.gelu(self.up(x)))))


class MaskedItemModel(nn.Module):
    def __init__(self, items: int, length: int, hidden: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.items = nn.Embedding(items, hidden, padding_idx=0)
        self.positions = nn.Embedding(length, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.out = nn.Linear(hidden, items)
        self.loss = nn.CrossEntropyLoss(ignore_index=0)

    def forward(self, ids, labels):
        keys = (ids > 0)[:, None, None, :]
        x = self.items(ids) + self.positions.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, keys)
        logits = self.out(x)
        return self.loss(logits.view(-1, logits.size(-1)), labels.view(-1))


def _batch(args, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids with 0 at the padding, labels, masked positions)."""
    raw = torch.rand(args.batch, generator=g) * 2 * args.fill * args.length
    lengths = raw.round().long().clamp(1, args.length)
    lengths[0] = args.length
    valid = torch.arange(args.length)[None, :] < lengths[:, None]
    ids = torch.randint(1, args.items, (args.batch, args.length), generator=g) * valid
    masked = (torch.rand(args.batch, args.length, generator=g) < args.mask_prob) & valid
    labels = torch.where(masked, ids, 0)
    ids = torch.where(masked, args.items - 1, ids)  # the [mask] item
    return ids.to(device), labels.to(device), int(masked.sum())


def _compiled(model, method: str, mode: str | None):
    config = GemConfig(unpad={"packed_losses": not method.startswith("gem-losses-padded")})
    return gem_compile(model, config=config, mode=mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--items", type=int, default=27000, help="item vocabulary (MovieLens-20M has ~27k)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fill", type=float, default=0.5)
    p.add_argument("--mask-prob", type=float, default=0.2)
    add_step_arguments(p, methods="inductor,gem,gem-losses-padded")
    args, device, path, batches, payload = prepare(p, "masked_item_loss", _batch)
    row = {"tokens": args.batch * args.length,
           "masked_positions": statistics.mean(b[2] for b in batches)}
    payload["rows"].append(row)
    torch.manual_seed(0)
    model = MaskedItemModel(args.items, args.length, args.hidden, args.heads, args.layers, args.dropout).to(device)
    record_explain(row, model, *batches[0][:2])
    measure_methods(row, args.methods.split(","), _compiled, model,
                    lambda fn, batch: autocast_step(fn, model, batch[:2], device), batches, args, device, path,
                    payload)
    columns = [("tokens", "B x N", "d"), ("masked_positions", "masked", ".0f")] + [
        (f"{m}_ms", f"{m} ms", ".2f") for m in args.methods.split(",")] + [
        (f"speedup_{m}_vs_inductor", f"{m} x", ".2f") for m in args.methods.split(",") if not m.startswith("inductor")]
    print(format_table([row], columns))
    print("wrote", path)


if __name__ == "__main__":
    main()
