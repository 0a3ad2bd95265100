"""AttentionMask: what a proven attention mask is, in one model for every kernel family.

A score ``scores[b, h, i, j]`` (query i, key j of sample b) is kept iff every present condition holds:

    j < kv_lengths[b] + kv_offset        key padding
    i < q_lengths[b] + q_offset          query padding
    i // block == j // block             fixed blocks (block a constant)
    j <= i                               causal
    i - j <= window (causal) | |i - j| <= window (not causal)   a sliding window (window a constant)
    HSTU's visibility: the last num_targets[b] tokens are targets (they see the history and themselves),
    the first contextual_len tokens are contextual (fully visible)

and, with ``diagonal``, a score is also kept where i == j whatever the rest says (BST's, XLNet's content
stream: a padded query row attends to the valid keys and to itself).

Absent conditions are None (lengths, block, window, targets) or 0 (offsets, contextual_len): "no window" is
None here, whatever sentinel a kernel takes. masks/classify.py proves which model a mask's formula is; a
new mask source (a mask read from data rather than lengths) is one more field and one more case there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class KeyVector:
    """A per-key condition over (b, j) only, with data and lengths in it (masks/key_vector.py builds the
    tensor): x[b, j] > 0, attention_mask[b, j] == 1, j >= L - lengths[b] (left padding), ...; or, as an
    AttentionMask's query_vector, the same over (b, i) (``position`` says which)."""

    formula: Any = field(compare=False)
    """The sympy formula over the evaluator's propositions."""
    evaluator: Any = field(compare=False)
    """The MaskEvaluator the formula's propositions belong to."""
    text: str = ""
    """The formula spelled over b and j (or i), for explain."""
    position: int = 0
    """The index symbol the formula reads besides b: 0 (j, keys) or 1 (i, queries)."""


@dataclass(frozen=True)
class AttentionMask:
    """scores[b, h, i, j] are kept iff every present condition holds (see the module docstring)."""

    kv_lengths: fx.Node | None = None
    kv_offset: int = 0
    q_lengths: fx.Node | None = None
    q_offset: int = 0
    block: int | None = None
    causal: bool = False
    window: int | None = None
    num_targets: fx.Node | None = None
    contextual_len: int = 0
    rows_dropped_after: bool = False
    """The model's mask equals this one only on rows i < kv_lengths[b] (HSTU's target mask without a padding
    term): the family rewrites only when the model provably drops the other rows after the attention."""
    diagonal: bool = False
    """Scores i == j are kept too (``(the rest) or i == j``): self-attention whose padded rows see themselves
    besides the valid keys; the jagged family merges that one key into each such row."""
    key_vector: KeyVector | None = None
    """Key padding read from data: key j of sample b is kept iff this (b, j) formula holds (and-ed with the
    rest); the families pass it to the kernels as a (B, Lk) bool kv_mask."""
    query_vector: KeyVector | None = None
    """Query padding read from data: query i of sample b is kept iff this (b, i) formula holds (its clauses
    read i and data: ``valid[b, i]`` of a pairwise ``valid[:, :, None] & valid[:, None, :]``). A row it drops
    sees no key; the jagged family computes it and zeroes it (``serves_query_vector``)."""
    fill: float | None = field(default=None, compare=False)
    """The one finite value a softmax mask drops scores with (-1e9, finfo.min...); None: -inf or a bool
    mask. attention/finite_fill.py keeps a finite fill exact (rows that see no valid key, large scores)."""
    fill_replaces: bool = field(default=False, compare=False)
    """Whether that fill is written over the scores (masked_fill, where: no gradient reaches a filled score)
    rather than added to them."""
    fill_stacked: bool = field(default=False, compare=False)
    """Whether the fill is added by several terms one after another (s + (1 - m1) * F + (1 - m2) * F): a
    score two terms drop gets 2F (-inf where that overflows), so a row with no valid key attends, in eager,
    only to the keys fewest terms drop."""
    fill_dtype: torch.dtype = field(default=torch.float32, compare=False)
    """The dtype eager adds an added fill to the scores in (a hand-written softmax's s + F; SDPA adds in fp32):
    its spacing at F decides whether a row with no valid key is softmax(s) or uniform (finite_fill.py)."""
    checks: tuple = field(default=(), compare=False)
    """Device-side checks the rewrite emits with the op (callables of an Emitter): what the proof assumed of
    data (an integer mask read as 0/1, a registered buffer still holding its triangle)."""
    formula: str = field(default="", compare=False)
    """The kept-score formula as proven, for refusals that say what the mask is instead."""

    @property
    def structured(self) -> bool:
        """Whether query and key positions are related beyond causality (blocks, a window, HSTU)."""
        return self.block is not None or self.window is not None or self.hstu

    @property
    def hstu(self) -> bool:
        return self.num_targets is not None or self.contextual_len != 0

    def describe(self) -> str:
        parts = []
        if self.kv_lengths is not None:
            parts.append(f"keys j < {self.kv_lengths.name}[b]" + (f" + {self.kv_offset}" if self.kv_offset else ""))
        if self.key_vector is not None:
            parts.append(f"keys where {self.key_vector.text}")
        if self.q_lengths is not None:
            parts.append(f"queries i < {self.q_lengths.name}[b]" + (f" + {self.q_offset}" if self.q_offset else ""))
        if self.query_vector is not None:
            parts.append(f"queries where {self.query_vector.text}")
        if self.block is not None:
            parts.append(f"blocks i // {self.block} == j // {self.block}")
        if self.causal:
            parts.append("causal j <= i")
        if self.window is not None:
            parts.append(f"window {'i - j' if self.causal else '|i - j|'} <= {self.window}")
        if self.num_targets is not None:
            parts.append(f"the last {self.num_targets.name}[b] tokens are targets (they see the history and "
                         "themselves)")
        if self.contextual_len:
            parts.append(f"the first {self.contextual_len} tokens are contextual (fully visible)")
        text = " and ".join(parts) if parts else "no mask"
        return f"({text}) or i == j" if self.diagonal else text
