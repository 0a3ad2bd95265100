"""GEM-ref: a representative GEM-style ranking model written the way a modeler writes it.

Plain PyTorch on padded tensors with boolean masks; nothing here knows about
gemcompile. The compiler pattern-matches the attention idioms below, so they are written plainly:

- sequence mask:        valid = torch.arange(N)[None, :] < lengths[:, None]             (B, N) bool,
                         built from the lengths in each layer (a layer compiled alone sees where it comes from)
- PMA (short Q, long KV): F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
- GDPA (long Q, short KV): a = F.gelu(q @ k.transpose(-2, -1)) / N; o = a @ v; o * valid[..., None]
- block self-attention:  SDPA with mask (i // b)[:, None] == (j // b)[None, :] & valid[:, None, None, :],
                         QK-norm and RoPE.

Shapes: B batch, N / N_k padded length of sequence k, d model dim, H heads, Dh head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GemRefConfig",
    "gem_ref_config",
    "length_mask",
    "sequence_arch",
    "GemRef",
    "NonSeqEmbedding",
    "SeqEmbedding",
    "GemLayer",
    "NonSeqSummary",
    "PMA",
    "SeqSummary",
    "WukongExpert",
    "Interaction",
    "GDPACrossAttention",
    "BlockSelfAttention",
    "TokenFFN",
    "Heads",
    "masked_bce_loss",
]

EMBEDDING_INIT_STD = 0.02
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class GemRefConfig:
    """Every size knob of GEM-ref (see gem_ref_config for the presets)."""

    d: int = 32
    """Model dim of every token (non-sequence tokens, sequence tokens, summaries)."""

    n_heads: int = 2
    """Attention heads of PMA, GDPA and block self-attention."""

    head_dim: int = 16
    """Per-head dim; n_heads * head_dim must equal d."""

    n_layers: int = 2
    """Number of GemLayers."""

    n_tables: int = 4
    """Sparse (non-sequence) multi-hot features, one EmbeddingBag table each."""

    table_rows: int = 1000
    """Rows per sparse table (row 0 is the padding row)."""

    table_dim: int = 16
    """Embedding dim of the sparse tables."""

    group_size: int = 2
    """Table embeddings concatenated per non-sequence token (Wukong grouping); must divide n_tables."""

    max_hot: int = 4
    """Padded width of each multi-hot id list."""

    n_dense: int = 8
    """Dense float features."""

    dense_tokens: int = 2
    """Tokens the dense MLP produces."""

    dense_mlp: tuple[int, ...] = (32,)
    """Hidden widths of the dense MLP (n_dense -> ... -> dense_tokens * d)."""

    item_vocab: int = 1000
    """Rows of the item table shared by all sequence types (row 0 = padding)."""

    d_item: int = 16
    """Embedding dim of items, actions and time buckets (projected to d)."""

    n_actions: int = 3
    """Action types of sequence events (impression, click, conversion)."""

    n_time_buckets: int = 16
    """Time buckets: floor(log1p(age seconds)) clamped to n_time_buckets - 1."""

    seq_max_lens: tuple[int, ...] = (48, 32)
    """Padded length N_k of each sequence type. (tiny avoids N % 128 == 64: on torch 2.11 + H100/H200 the
    cuDNN SDPA backward returns NaN there when a row is fully masked, pytorch/pytorch#196678.)"""

    n_sum: int = 4
    """Non-sequence summary tokens (X_sum, the keys/values of GDPA)."""

    n_pma: int = 4
    """Learned PMA queries per sequence type."""

    n_recent: int = 2
    """Most recent valid tokens kept per sequence type in the sequence summary."""

    n_experts: int = 2
    """Dense Wukong experts in the interaction arch (each runs on the whole batch)."""

    wukong_nf: int = 4
    """Tokens out of each expert's factorization-machine block (FMB)."""

    wukong_nl: int = 4
    """Tokens out of each expert's linear compression block (LCB)."""

    wukong_k: int = 8
    """Rank k of the optimized FM X (X^T Y), Y of shape (n_in, k)."""

    expert_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the FMB MLP (n_in * k -> ... -> wukong_nf * d)."""

    block_size: int = 16
    """Block of the block-diagonal self-attention (queries attend only to keys of their own block)."""

    ffn_mult: int = 2
    """Token FFN hidden width = ffn_mult * d."""

    comp_skip: bool = False
    """CompSkip: even layers run GDPA + fresh pooling + FFN, odd layers block SA + FFN and reuse the
    previous layer's sequence summary."""

    top_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the shared top MLP (ReLU)."""

    n_domains: int = 2
    """Domains, one tower each."""

    n_tasks: int = 2
    """Logits per tower (CTR, CVR)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "comp_skip":
                if not isinstance(value, bool):
                    raise ValueError(f"GemRefConfig.comp_skip must be a bool, got {value!r}")
            elif f.name in ("dense_mlp", "expert_mlp", "top_mlp", "seq_max_lens"):
                if isinstance(value, list):
                    value = tuple(value)
                    object.__setattr__(self, f.name, value)
                if not isinstance(value, tuple) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value
                ):
                    raise ValueError(f"GemRefConfig.{f.name} must be a tuple of ints >= 1, got {value!r}")
            else:
                minimum = {"table_rows": 2, "item_vocab": 2, "n_recent": 0}.get(f.name, 1)
                if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                    raise ValueError(f"GemRefConfig.{f.name} must be an int >= {minimum}, got {value!r}")
        if not self.seq_max_lens:
            raise ValueError("GemRefConfig.seq_max_lens must name at least one sequence type, got ()")
        if self.n_heads * self.head_dim != self.d:
            raise ValueError(
                f"GemRefConfig.n_heads * head_dim must equal d, "
                f"got {self.n_heads} * {self.head_dim} != {self.d}"
            )
        if self.head_dim % 2:
            raise ValueError(f"GemRefConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.n_tables % self.group_size:
            raise ValueError(
                f"GemRefConfig.group_size must divide n_tables={self.n_tables}, got {self.group_size}"
            )

    # Derived sizes -----------------------------------------------------------------------------------

    @property
    def n_seq(self) -> int:
        """Number of sequence types."""
        return len(self.seq_max_lens)

    @property
    def n_nonseq_tokens(self) -> int:
        """Tokens of X0: table groups + dense tokens."""
        return self.n_tables // self.group_size + self.dense_tokens

    @property
    def n_seq_summary_tokens(self) -> int:
        """Tokens of S_sum: (n_pma + n_recent) per sequence type."""
        return self.n_seq * (self.n_pma + self.n_recent)

    @property
    def n_interaction_tokens(self) -> int:
        """Tokens out of each interaction (pyramid: the next layer's non-sequence token count)."""
        return self.wukong_nf + self.wukong_nl

    def layer_runs_gdpa(self, index: int) -> bool:
        """Whether layer `index` runs GDPA cross-attention and fresh sequence pooling."""
        return not self.comp_skip or index % 2 == 0

    def layer_runs_self_attention(self, index: int) -> bool:
        """Whether layer `index` runs block self-attention."""
        return not self.comp_skip or index % 2 == 1

    def data_config(
        self,
        batch_size: int,
        fill: float = 0.5,
        length_dist: str = "uniform",
        seed: int = 0,
        batch_shuffle: bool = False,
        **overrides,
    ):
        """The DataConfig of synthetic data that matches this model; `overrides` sets other DataConfig
        fields (ctr_target, cvr_target)."""
        from .data import DataConfig  # sibling module, plain PyTorch as well

        return DataConfig(
            batch_size=batch_size,
            seq_max_lens=self.seq_max_lens,
            fill=fill,
            length_dist=length_dist,
            item_vocab=self.item_vocab,
            n_actions=self.n_actions,
            n_sparse_tables=self.n_tables,
            table_rows=self.table_rows,
            max_hot=self.max_hot,
            n_dense=self.n_dense,
            n_domains=self.n_domains,
            n_tasks=self.n_tasks,
            seed=seed,
            batch_shuffle=batch_shuffle,
            **overrides,
        )


GEM_REF_SIZES = ("tiny", "small", "medium", "large")


def gem_ref_config(size: str) -> GemRefConfig:
    """Preset sizes: "tiny" (CPU tests), "small" (1 GPU), "medium" (fills 1 GPU), "large" (8 GPUs)."""
    if size == "tiny":
        return GemRefConfig()
    if size == "small":
        return GemRefConfig(
            d=256, n_heads=4, head_dim=64, n_layers=4,
            n_tables=32, table_rows=1 << 16, table_dim=256, group_size=4, max_hot=8,
            n_dense=64, dense_tokens=4, dense_mlp=(256,),
            item_vocab=1 << 20, d_item=256, n_actions=3, n_time_buckets=32, seq_max_lens=(1024, 256),
            n_sum=8, n_pma=8, n_recent=8,
            n_experts=2, wukong_nf=16, wukong_nl=16, wukong_k=24, expert_mlp=(1024, 1024),
            block_size=64, ffn_mult=2, comp_skip=False,
            top_mlp=(1024, 512), n_domains=2, n_tasks=2,
        )  # fmt: skip
    if size == "medium":
        # large's layer widths (d 512, head dim 128, 2048-wide expert and top MLPs) on one GPU: 1.2B
        # embedding and 1.05B dense parameters, 19.6 train TFLOP a step at batch 256, fill 0.5 (small: 3.5)
        return GemRefConfig(
            d=512, n_heads=4, head_dim=128, n_layers=4,
            n_tables=64, table_rows=1 << 17, table_dim=128, group_size=4, max_hot=16,
            n_dense=256, dense_tokens=8, dense_mlp=(1024,),
            item_vocab=1 << 20, d_item=128, n_actions=3, n_time_buckets=32, seq_max_lens=(2048, 512),
            n_sum=16, n_pma=32, n_recent=16,
            n_experts=2, wukong_nf=64, wukong_nl=64, wukong_k=64, expert_mlp=(2048, 2048),
            block_size=64, ffn_mult=2, comp_skip=True,
            top_mlp=(2048, 1024), n_domains=2, n_tasks=2,
        )  # fmt: skip
    if size == "large":
        return GemRefConfig(
            d=512, n_heads=4, head_dim=128, n_layers=6,
            n_tables=128, table_rows=1 << 20, table_dim=128, group_size=4, max_hot=16,
            n_dense=256, dense_tokens=8, dense_mlp=(1024,),
            item_vocab=1 << 22, d_item=128, n_actions=3, n_time_buckets=32,
            seq_max_lens=(4096, 1024, 512, 256),
            n_sum=16, n_pma=32, n_recent=16,
            n_experts=4, wukong_nf=64, wukong_nl=64, wukong_k=64, expert_mlp=(4096, 4096),
            block_size=64, ffn_mult=2, comp_skip=True,
            top_mlp=(4096, 2048, 1024), n_domains=3, n_tasks=2,
        )  # fmt: skip
    raise ValueError(f"size must be one of {GEM_REF_SIZES}, got {size!r}")


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


def mlp(widths: list[int], final_activation: bool = False) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(widths) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def gate(x: Tensor, proj: nn.Linear) -> Tensor:
    """x * sigmoid(proj(x)) (InterFormer's gating)."""
    return x * torch.sigmoid(proj(x))


def length_mask(lengths: Tensor, n: int) -> Tensor:
    """valid[b, t] = t < lengths[b]: the (B, n) bool mask of a padded sequence batch."""
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, N, H * Dh) -> (B, H, N, Dh)."""
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, Dh) -> (B, N, H * Dh)."""
    return x.transpose(1, 2).flatten(2)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def init_embedding_(weight: Tensor, padding_idx: int | None) -> None:
    with torch.no_grad():
        nn.init.normal_(weight, std=EMBEDDING_INIT_STD)
        if padding_idx is not None:
            weight[padding_idx].zero_()


class NonSeqEmbedding(nn.Module):
    """Sparse tables (EmbeddingBag, sum) grouped Wukong-style into tokens, plus dense MLP tokens -> X0."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.group_size = cfg.group_size
        self.dense_tokens = cfg.dense_tokens
        self.d = cfg.d
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(cfg.table_rows, cfg.table_dim, mode="sum", padding_idx=0)
            for _ in range(cfg.n_tables)
        )
        for table in self.tables:
            init_embedding_(table.weight, padding_idx=0)
        n_groups = cfg.n_tables // cfg.group_size
        self.group_proj = nn.ModuleList(
            nn.Linear(cfg.group_size * cfg.table_dim, cfg.d) for _ in range(n_groups)
        )
        self.dense_mlp = mlp([cfg.n_dense, *cfg.dense_mlp, cfg.dense_tokens * cfg.d])

    def forward(self, sparse_ids: Tensor, dense: Tensor) -> Tensor:
        # sparse_ids (B, n_tables, max_hot), dense (B, n_dense)
        pooled = [table(sparse_ids[:, t]) for t, table in enumerate(self.tables)]  # each (B, table_dim)
        groups = [
            proj(torch.cat(pooled[g * self.group_size : (g + 1) * self.group_size], dim=-1))  # (B, d)
            for g, proj in enumerate(self.group_proj)
        ]
        x_sparse = torch.stack(groups, dim=1)  # (B, n_groups, d)
        x_dense = self.dense_mlp(dense).unflatten(-1, (self.dense_tokens, self.d))  # (B, dense_tokens, d)
        return torch.cat([x_sparse, x_dense], dim=1)  # (B, N_ns, d)


class SeqEmbedding(nn.Module):
    """Per sequence type: item (shared table) + action + time-bucket embeddings -> Linear to d, masked."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_time_buckets = cfg.n_time_buckets
        self.item = nn.Embedding(cfg.item_vocab, cfg.d_item, padding_idx=0)
        init_embedding_(self.item.weight, padding_idx=0)
        self.action = nn.ModuleList(nn.Embedding(cfg.n_actions, cfg.d_item) for _ in range(cfg.n_seq))
        self.time = nn.ModuleList(nn.Embedding(cfg.n_time_buckets, cfg.d_item) for _ in range(cfg.n_seq))
        for emb in [*self.action, *self.time]:
            init_embedding_(emb.weight, padding_idx=None)
        self.proj = nn.ModuleList(nn.Linear(cfg.d_item, cfg.d) for _ in range(cfg.n_seq))

    def forward(
        self,
        seq_items: list[Tensor],
        seq_actions: list[Tensor],
        seq_times: list[Tensor],
        valids: list[Tensor],
    ) -> list[Tensor]:
        seqs = []
        for k, (items, actions, times, valid) in enumerate(zip(seq_items, seq_actions, seq_times, valids)):
            # Time bucket: floor(log1p(age in seconds)), clamped to the table.
            bucket = torch.floor(torch.log1p(times.clamp(min=0))).long().clamp(0, self.n_time_buckets - 1)
            e = self.item(items) + self.action[k](actions) + self.time[k](bucket)  # (B, N, d_item)
            seqs.append(self.proj[k](e) * valid[..., None])  # (B, N, d)
        return seqs


class NonSeqSummary(nn.Module):
    """X_sum = Z * sigmoid(Linear(Z)), Z = token-axis linear N_in -> n_sum (InterFormer Cross Arch)."""

    def __init__(self, n_in: int, n_sum: int, d: int) -> None:
        super().__init__()
        self.compress = nn.Linear(n_in, n_sum, bias=False)  # on the token axis
        self.gate = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        # x (B, N_in, d)
        z = self.compress(x.transpose(1, 2)).transpose(1, 2)  # (B, n_sum, d)
        return gate(z, self.gate)


class PMA(nn.Module):
    """Pooling by multi-head attention: n_pma learned queries over the padded sequence (key padding mask)."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.queries = nn.Parameter(torch.randn(cfg.n_pma, cfg.d))
        self.norm = nn.LayerNorm(cfg.d)
        self.q_proj = nn.Linear(cfg.d, cfg.d)
        self.k_proj = nn.Linear(cfg.d, cfg.d)
        self.v_proj = nn.Linear(cfg.d, cfg.d)
        self.out_proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, s: Tensor, valid: Tensor) -> Tensor:
        # s (B, N, d), valid (B, N)
        b = s.shape[0]
        q = split_heads(self.q_proj(self.queries)[None], self.n_heads)  # (1, H, n_pma, Dh)
        q = q.expand(b, -1, -1, -1)  # (B, H, n_pma, Dh)
        x = self.norm(s)
        k = split_heads(self.k_proj(x), self.n_heads)  # (B, H, N, Dh)
        v = split_heads(self.v_proj(x), self.n_heads)  # (B, H, N, Dh)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])  # (B, H, n_pma, Dh)
        return self.out_proj(merge_heads(o))  # (B, n_pma, d)


class SeqSummary(nn.Module):
    """S_sum = concat over k of gate(concat([PMA_k(S_k), recent_k(S_k)])), recent = last n_recent valid."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_recent = cfg.n_recent
        self.pma = nn.ModuleList(PMA(cfg) for _ in range(cfg.n_seq))
        self.gate = nn.ModuleList(nn.Linear(cfg.d, cfg.d) for _ in range(cfg.n_seq))

    def forward(self, seqs: list[Tensor], seq_lengths: list[Tensor]) -> Tensor:
        summaries = []
        for k, (s, lengths) in enumerate(zip(seqs, seq_lengths)):
            valid = length_mask(lengths, s.shape[1])
            pooled = self.pma[k](s, valid)  # (B, n_pma, d)
            # The n_recent most recent valid tokens (most recent first); zero where the sequence is shorter.
            arange = torch.arange(self.n_recent, device=s.device)
            index = lengths[:, None] - 1 - arange[None, :]  # (B, n_recent)
            recent = torch.gather(s, 1, index.clamp(min=0)[..., None].expand(-1, -1, s.shape[-1]))
            recent = recent * (index >= 0)[..., None]  # (B, n_recent, d)
            tokens = torch.cat([pooled, recent], dim=1)  # (B, n_pma + n_recent, d)
            summaries.append(gate(tokens, self.gate[k]))
        return torch.cat(summaries, dim=1)  # (B, n_seq * (n_pma + n_recent), d)


class WukongExpert(nn.Module):
    """One Wukong layer: LN(concat(FMB(X), LCB(X)) + token-axis linear residual of X)."""

    def __init__(self, n_in: int, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_f, self.d = cfg.wukong_nf, cfg.d
        self.fm_y = nn.Parameter(torch.randn(n_in, cfg.wukong_k) / math.sqrt(n_in))
        self.fm_norm = nn.LayerNorm(n_in * cfg.wukong_k)
        self.fm_mlp = mlp([n_in * cfg.wukong_k, *cfg.expert_mlp, cfg.wukong_nf * cfg.d])
        self.lcb = nn.Linear(n_in, cfg.wukong_nl, bias=False)  # on the token axis
        self.residual = nn.Linear(n_in, cfg.wukong_nf + cfg.wukong_nl, bias=False)  # on the token axis
        self.norm = nn.LayerNorm(cfg.d)

    def forward(self, x: Tensor) -> Tensor:
        # x (B, n_in, d)
        xt = x.transpose(1, 2)  # (B, d, n_in)
        fm = x @ (xt @ self.fm_y)  # optimized FM X (X^T Y): (B, n_in, k)
        fmb = self.fm_mlp(self.fm_norm(fm.flatten(1))).unflatten(-1, (self.n_f, self.d))  # (B, n_F, d)
        lcb = self.lcb(xt).transpose(1, 2)  # (B, n_L, d)
        res = self.residual(xt).transpose(1, 2)  # (B, n_F + n_L, d)
        return self.norm(torch.cat([fmb, lcb], dim=1) + res)  # (B, n_F + n_L, d)


class Interaction(nn.Module):
    """Dense ensemble of Wukong experts (each on the whole batch) mixed by a per-sample softmax gate."""

    def __init__(self, n_in: int, cfg: GemRefConfig) -> None:
        super().__init__()
        self.experts = nn.ModuleList(WukongExpert(n_in, cfg) for _ in range(cfg.n_experts))
        self.gate = nn.Linear(cfg.d, cfg.n_experts)

    def forward(self, x: Tensor) -> Tensor:
        # x (B, n_in, d)
        weights = torch.softmax(self.gate(x.mean(dim=1)), dim=-1)  # (B, E)
        outs = torch.stack([expert(x) for expert in self.experts], dim=1)  # (B, E, n_F + n_L, d)
        return (weights[:, :, None, None] * outs).sum(dim=1)  # (B, n_F + n_L, d)


class GDPACrossAttention(nn.Module):
    """PFFN as cross-attention: long queries (sequence), short keys/values (X_sum), GELU scores / N."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.norm = nn.LayerNorm(cfg.d)
        self.q_proj = nn.Linear(cfg.d, cfg.d)
        self.k_proj = nn.Linear(cfg.d, cfg.d)
        self.v_proj = nn.Linear(cfg.d, cfg.d)
        self.out_proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, s: Tensor, x_sum: Tensor, valid: Tensor) -> Tensor:
        # s (B, N, d), x_sum (B, n_sum, d), valid (B, N)
        n = s.shape[1]  # padded max length, the GDPA temperature
        q = split_heads(self.q_proj(self.norm(s)), self.n_heads)  # (B, H, N, Dh)
        k = split_heads(self.k_proj(x_sum), self.n_heads)  # (B, H, n_sum, Dh)
        v = split_heads(self.v_proj(x_sum), self.n_heads)  # (B, H, n_sum, Dh)
        a = F.gelu(q @ k.transpose(-2, -1)) / n  # (B, H, N, n_sum)
        o = a @ v  # (B, H, N, Dh)
        o = self.out_proj(merge_heads(o))  # (B, N, d)
        return s + o * valid[..., None]


class BlockSelfAttention(nn.Module):
    """Softmax self-attention within fixed blocks, QK-norm and RoPE, written as a full masked attention."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.block_size = cfg.n_heads, cfg.head_dim, cfg.block_size
        self.norm = nn.LayerNorm(cfg.d)
        self.q_proj = nn.Linear(cfg.d, cfg.d)
        self.k_proj = nn.Linear(cfg.d, cfg.d)
        self.v_proj = nn.Linear(cfg.d, cfg.d)
        self.q_norm = nn.RMSNorm(cfg.head_dim)
        self.k_norm = nn.RMSNorm(cfg.head_dim)
        self.out_proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, s: Tensor, valid: Tensor) -> Tensor:
        # s (B, N, d), valid (B, N)
        n = s.shape[1]
        x = self.norm(s)
        q = split_heads(self.q_proj(x), self.n_heads)  # (B, H, N, Dh)
        k = split_heads(self.k_proj(x), self.n_heads)  # (B, H, N, Dh)
        v = split_heads(self.v_proj(x), self.n_heads)  # (B, H, N, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        # RoPE, rotate-half convention, positions 0..N-1.
        pos = torch.arange(n, device=s.device, dtype=torch.float32)
        dims = torch.arange(0, self.head_dim, 2, device=s.device, dtype=torch.float32)
        inv_freq = 1.0 / ROPE_BASE ** (dims / self.head_dim)  # (Dh/2,)
        angles = pos[:, None] * inv_freq[None, :]  # (N, Dh/2)
        angles = torch.cat([angles, angles], dim=-1)  # (N, Dh)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Block-diagonal mask AND key padding.
        i = torch.arange(n, device=s.device)
        block = (i // self.block_size)[:, None] == (i // self.block_size)[None, :]  # (N, N)
        mask = block[None, None, :, :] & valid[:, None, None, :]  # (B, 1, N, N)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, Dh)
        o = self.out_proj(merge_heads(o))  # (B, N, d)
        return s + o * valid[..., None]


class TokenFFN(nn.Module):
    """Per-token MLP: LN -> Linear(d, m d) -> GELU -> Linear(m d, d), masked, residual."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d)
        self.up = nn.Linear(cfg.d, cfg.ffn_mult * cfg.d)
        self.down = nn.Linear(cfg.ffn_mult * cfg.d, cfg.d)

    def forward(self, s: Tensor, valid: Tensor) -> Tensor:
        # s (B, N, d), valid (B, N)
        return s + self.down(F.gelu(self.up(self.norm(s)))) * valid[..., None]


def sequence_arch(layer: nn.Module, seqs: list[Tensor], valids: list[Tensor], x_sum: Tensor | None) -> list[Tensor]:
    """A layer's per-sequence path: GDPA cross-attention to X_sum, block self-attention, token FFN (the
    first two where the layer has them), with ``layer``'s ``gdpa`` / ``self_attention`` / ``ffn`` lists."""
    seqs_next = []
    for k, (s, valid) in enumerate(zip(seqs, valids)):
        if layer.gdpa is not None:
            s = layer.gdpa[k](s, x_sum, valid)
        if layer.self_attention is not None:
            s = layer.self_attention[k](s, valid)
        seqs_next.append(layer.ffn[k](s, valid))
    return seqs_next


class GemLayer(nn.Module):
    """One GEM layer: non-seq summary, sequence pooling, Wukong interaction, sequence arch per type."""

    def __init__(self, cfg: GemRefConfig, index: int, n_x: int) -> None:
        super().__init__()
        self.index = index
        runs_gdpa = cfg.layer_runs_gdpa(index)
        runs_sa = cfg.layer_runs_self_attention(index)
        # X_sum only feeds GDPA, so a CompSkip self-attention layer has no summary (it would be dead code).
        self.summary = NonSeqSummary(n_x, cfg.n_sum, cfg.d) if runs_gdpa else None
        # CompSkip self-attention layers reuse the previous layer's sequence summary ("cached pooling").
        self.seq_summary = SeqSummary(cfg) if runs_gdpa else None
        self.interaction = Interaction(n_x + cfg.n_seq_summary_tokens, cfg)
        self.gdpa = nn.ModuleList(GDPACrossAttention(cfg) for _ in range(cfg.n_seq)) if runs_gdpa else None
        self.self_attention = (
            nn.ModuleList(BlockSelfAttention(cfg) for _ in range(cfg.n_seq)) if runs_sa else None
        )
        self.ffn = nn.ModuleList(TokenFFN(cfg) for _ in range(cfg.n_seq))

    def forward(
        self,
        x: Tensor,
        seqs: list[Tensor],
        seq_lengths: list[Tensor],
        s_sum_cache: Tensor | None,
    ) -> tuple[Tensor, list[Tensor], Tensor]:
        # x (B, N_x, d); seqs[k] (B, N_k, d). The layer builds its masks from the lengths itself, so that a
        # layer compiled alone (per-FSDP-unit compile, local MFU) shows the compiler where they come from.
        valids = [length_mask(lengths, s.shape[1]) for s, lengths in zip(seqs, seq_lengths)]
        x_sum = self.summary(x) if self.summary is not None else None  # (B, n_sum, d)
        if self.seq_summary is not None:
            s_sum = self.seq_summary(seqs, seq_lengths)  # (B, n_seq * (n_pma + n_recent), d)
        else:
            assert s_sum_cache is not None, "a CompSkip layer needs the previous layer's sequence summary"
            s_sum = s_sum_cache
        x_next = self.interaction(torch.cat([x, s_sum], dim=1))  # (B, n_F + n_L, d)
        return x_next, sequence_arch(self, seqs, valids, x_sum), s_sum


class Heads(nn.Module):
    """Top MLP on [flatten(X_L) || flatten(S_sum_L)], then one tower per domain; own domain gathered."""

    def __init__(self, cfg: GemRefConfig, n_x: int) -> None:
        super().__init__()
        n_in = (n_x + cfg.n_seq_summary_tokens) * cfg.d
        self.top = mlp([n_in, *cfg.top_mlp], final_activation=True)
        width = cfg.top_mlp[-1] if cfg.top_mlp else n_in
        self.towers = nn.ModuleList(nn.Linear(width, cfg.n_tasks) for _ in range(cfg.n_domains))

    def forward(self, x: Tensor, s_sum: Tensor, domain: Tensor) -> Tensor:
        h = self.top(torch.cat([x.flatten(1), s_sum.flatten(1)], dim=1))  # (B, top_mlp[-1])
        all_logits = torch.stack([tower(h) for tower in self.towers], dim=1)  # (B, n_domains, n_tasks)
        rows = torch.arange(all_logits.shape[0], device=all_logits.device)
        # Advanced indexing returns a fresh tensor: FSDP2 warns about modules that return views.
        return all_logits[rows, domain]  # (B, n_tasks)


class GemRef(nn.Module):
    """GEM-ref: embeddings -> n_layers GemLayers -> final sequence summary -> domain/task heads."""

    def __init__(self, cfg: GemRefConfig) -> None:
        super().__init__()
        if not isinstance(cfg, GemRefConfig):
            raise TypeError(f"cfg must be a GemRefConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.nonseq_embedding = NonSeqEmbedding(cfg)
        self.seq_embedding = SeqEmbedding(cfg)
        layers, n_x = [], cfg.n_nonseq_tokens
        for index in range(cfg.n_layers):
            layers.append(GemLayer(cfg, index, n_x))
            n_x = cfg.n_interaction_tokens
        self.layers = nn.ModuleList(layers)
        # Pools the last layer's sequence outputs, so the last sequence arch feeds the heads.
        self.final_summary = SeqSummary(cfg)
        self.heads = Heads(cfg, n_x)

    def forward(
        self,
        sparse_ids: Tensor,
        dense: Tensor,
        seq_items: list[Tensor],
        seq_actions: list[Tensor],
        seq_times: list[Tensor],
        seq_lengths: list[Tensor],
        domain: Tensor,
    ) -> Tensor:
        valids = [length_mask(lengths, items.shape[1]) for items, lengths in zip(seq_items, seq_lengths)]
        x = self.nonseq_embedding(sparse_ids, dense)  # (B, N_ns, d)
        seqs = self.seq_embedding(seq_items, seq_actions, seq_times, valids)  # [(B, N_k, d)]
        s_sum = None
        for layer in self.layers:
            x, seqs, s_sum = layer(x, seqs, seq_lengths, s_sum)
        s_sum = self.final_summary(seqs, seq_lengths)  # (B, n_seq * (n_pma + n_recent), d)
        return self.heads(x, s_sum, domain)  # (B, n_tasks)

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The big embedding tables (sparse tables and the item table)."""
        return [table.weight for table in self.nonseq_embedding.tables] + [self.seq_embedding.item.weight]

    def parameter_counts(self) -> dict[str, int]:
        """{"sparse": embedding-table parameters, "dense": everything else}."""
        sparse_ids = {id(p) for p in self.sparse_parameters()}
        sparse = sum(p.numel() for p in self.parameters() if id(p) in sparse_ids)
        dense = sum(p.numel() for p in self.parameters() if id(p) not in sparse_ids)
        return {"sparse": sparse, "dense": dense}


def masked_bce_loss(logits: Tensor, labels: Tensor, label_mask: Tensor) -> Tensor:
    """BCE-with-logits averaged over the entries where label_mask is True (0 when there are none)."""
    per_element = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    mask = label_mask.to(logits.dtype)
    return (per_element * mask).sum() / mask.sum().clamp(min=1.0)
