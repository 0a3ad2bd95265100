"""FLOPs accounting and MFU.

Two numbers per training step, both "training = 3 x forward" (backward = 2 x forward, recompute not
counted), 2 FLOPs per multiply-accumulate, matmuls only (embedding lookups, norms, activations,
softmax and gating are not counted):

- padded FLOPs: what the padded model as written executes, measured with
  torch.utils.flop_counter.FlopCounterMode on one forward, once per input shape (PaddedFlopCounter).
  Every op with a registered flop formula is counted, including gemcompile's own ops when they
  register theirs. torch has no formula for the CPU flash-attention op SDPA uses on the CPU, so this
  module supplies one (the same count torch uses for its CUDA SDPA ops) through FlopCounterMode's
  custom_mapping, without touching torch's global registry.
- useful FLOPs: the section-8 formula on the actual sequence lengths (GemFlopFormula): per-step
  matmuls, per-sample matmuls x B, per-token matmuls of sequence k x sum_b n_bk, and the attention /
  FM terms from the valid (i, j) pairs only (PMA n_pma x n, GDPA n x n_sum, block self-attention the
  sum over blocks of b_j^2, the last partial block counted by its valid length).

The formula's parameter groups are derived from the module tree, not typed in: one shape-only probe
forward (FakeTensorMode: no memory, no compute) with the batch size and every padded length set to
distinct large primes records, for every nn.Linear call, how many rows it was applied to; rows
divisible by B x N_k are per-token rows of sequence k, rows divisible by B alone per-sample rows,
the rest per-step rows. The attention and FM modules (PMA, GDPACrossAttention, BlockSelfAttention,
WukongExpert) are found by type and their sequence type read off the probe shapes the same way.

The same formula in padded mode (every n_bk = N_k and block attention counted as the dense N_k x N_k
masked SDPA the padded model runs) reproduces FlopCounterMode's measurement exactly
(tests/unit/test_runtime_flops.py). With every length full, useful and padded FLOPs differ by the block
attention term only: sum over blocks of b_j^2 = N_k x block (useful) vs N_k^2 (executed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "PEAK_BF16_DENSE_TFLOPS",
    "TRAIN_FLOPS_PER_FORWARD",
    "AttentionTerm",
    "FmTerm",
    "GemFlopFormula",
    "MatmulTerm",
    "PaddedFlopCounter",
    "block_attention_pairs",
    "count_forward_flops",
    "mfu",
    "peak_flops",
]

TRAIN_FLOPS_PER_FORWARD = 3
"""Training FLOPs = 3 x forward FLOPs (backward = 2 x forward; activation recompute not counted)."""

PEAK_BF16_DENSE_TFLOPS: dict[str, float] = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense (no sparsity) BF16 peak per GPU in TFLOP/s (SXM parts), matched against the device name."""


# ---------------------------------------------------------------------------------------------------
# Peak table and MFU
# ---------------------------------------------------------------------------------------------------


def _device_name(device: str | torch.device | None) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.device) or (
        isinstance(device, str) and device.split(":")[0] in ("cpu", "cuda")
    ):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(device)
    return str(device)  # already a device name, e.g. "NVIDIA H200"


def peak_flops(device: str | torch.device | None) -> float | None:
    """Peak dense BF16 FLOP/s of one device, or None for the CPU and unknown GPUs.

    `device` is a torch device ("cuda", "cuda:1", "cpu") or a GPU name ("NVIDIA H100 80GB HBM3").
    """
    name = _device_name(device)
    if name is None:
        return None
    upper = name.upper()
    for key, tflops in PEAK_BF16_DENSE_TFLOPS.items():
        if key in upper:
            return tflops * 1e12
    return None


def mfu(useful_flops_per_s: float, device: str | torch.device | None) -> float | None:
    """Model FLOPs utilization in [0, 1]: useful training FLOP/s over the device's BF16 dense peak.

    None when the device has no entry in PEAK_BF16_DENSE_TFLOPS (the CPU, unknown GPUs). The BF16 peak
    is used whatever the training dtype, so runs stay comparable (float32 runs read low).
    """
    peak = peak_flops(device)
    if peak is None:
        return None
    return float(useful_flops_per_s) / peak


# ---------------------------------------------------------------------------------------------------
# Padded FLOPs: FlopCounterMode on the executed forward
# ---------------------------------------------------------------------------------------------------


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _missing_formulas() -> dict[Any, Any]:
    """Formulas for ops that torch's registry lacks (only those: never override torch's own)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    extra = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
    ):
        packet = getattr(aten, name, None)
        if packet is not None and packet not in flop_registry and packet.default not in flop_registry:
            extra[packet] = formula
    return extra


def count_forward_flops(model: Any, inputs: Mapping[str, Any]) -> int:
    """FLOPs of one forward of `model(**inputs)` under FlopCounterMode (no grad, nothing kept)."""
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_missing_formulas()) as counter:
        model(**inputs)
    return int(counter.get_total_flops())


def _shape_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_shape_key(v) for v in value)
    return repr(value)


class PaddedFlopCounter:
    """Padded forward FLOPs of a model, measured with FlopCounterMode once per input shape and cached.

    Measure the module the padded computation belongs to: the training loop passes the original
    (uncompiled) module, so its number is what the padded model as written executes.
    """

    def __init__(self, model: Any):
        self.model = model
        self._cache: dict[Any, int] = {}

    def forward_flops(self, inputs: Mapping[str, Any]) -> int:
        key = tuple(sorted((name, _shape_key(v)) for name, v in inputs.items()))
        if key not in self._cache:
            self._cache[key] = count_forward_flops(self.model, inputs)
        return self._cache[key]

    def train_flops(self, inputs: Mapping[str, Any]) -> int:
        return TRAIN_FLOPS_PER_FORWARD * self.forward_flops(inputs)


# ---------------------------------------------------------------------------------------------------
# Useful FLOPs: the section-8 formula, with parameter groups derived from the module tree
# ---------------------------------------------------------------------------------------------------

Scope = Literal["step", "sample", "token"]


@dataclass(frozen=True)
class MatmulTerm:
    """One call of a parameter matmul (an nn.Linear): 2 x params FLOPs per row it is applied to."""

    name: str
    """Module path, e.g. "layers.0.ffn.1.up"."""
    params: int
    """Weight elements (in_features x out_features; biases are adds, not counted)."""
    scope: Scope
    """"step": rows do not scale with the batch (e.g. PMA's learned queries); "sample": rows per sample;
    "token": rows per valid token of sequence `seq`."""
    rows: int
    """Rows per step / per sample / per token."""
    seq: int | None = None
    """Sequence type for scope "token"."""


@dataclass(frozen=True)
class AttentionTerm:
    """Score + value matmuls of one attention call: 2 x H x (d_qk + d_v) FLOPs per (query, key) pair."""

    name: str
    kind: Literal["pma", "gdpa", "block"]
    """"pma": n_fixed learned queries x n keys; "gdpa": n queries x n_fixed keys; "block": self-attention
    within blocks of `block_size` (useful pairs: sum over blocks of b_j^2)."""
    seq: int
    n_heads: int
    d_qk: int
    d_v: int
    n_fixed: int = 0
    """PMA queries (kind "pma") or X_sum keys (kind "gdpa")."""
    block_size: int = 0

    @property
    def flops_per_pair(self) -> int:
        return 2 * self.n_heads * (self.d_qk + self.d_v)


@dataclass(frozen=True)
class FmTerm:
    """Wukong's optimized FM X (X^T Y) per sample: 2 n_in k d for X^T Y plus 2 n_in d k for X (.)."""

    name: str
    n_in: int
    k: int
    d: int

    @property
    def flops_per_sample(self) -> int:
        return 4 * self.n_in * self.k * self.d


def block_attention_pairs(length: torch.Tensor | int, block_size: int) -> torch.Tensor | int:
    """Valid (query, key) pairs of block-diagonal attention over `length` tokens: sum_j b_j^2.

    Full blocks contribute block_size^2 each; the last partial block its valid length squared.
    Works elementwise on an int64 tensor of lengths.
    """
    full, rest = length // block_size, length % block_size
    return full * block_size * block_size + rest * rest


def _sum_lengths(lengths: torch.Tensor | Sequence[int]) -> int:
    if isinstance(lengths, torch.Tensor):
        return int(lengths.sum())
    return int(sum(lengths))


def _as_length_tensor(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths.detach().to("cpu", torch.int64)
    return torch.tensor(list(lengths), dtype=torch.int64)


def _distinct_primes(count: int, start: int) -> list[int]:
    primes, n = [], start
    while len(primes) < count:
        n += 1
        if n > 1 and all(n % p for p in range(2, math.isqrt(n) + 1)):
            primes.append(n)
    return primes


def _probe_inputs(cfg: Any, batch: int, lens: Sequence[int], device: torch.device) -> dict[str, Any]:
    long = {"dtype": torch.int64, "device": device}
    return {
        "sparse_ids": torch.zeros(batch, cfg.n_tables, cfg.max_hot, **long),
        "dense": torch.zeros(batch, cfg.n_dense, device=device),
        "seq_items": [torch.zeros(batch, n, **long) for n in lens],
        "seq_actions": [torch.zeros(batch, n, **long) for n in lens],
        "seq_times": [torch.zeros(batch, n, device=device) for n in lens],
        "seq_lengths": [torch.full((batch,), n, **long) for n in lens],
        "domain": torch.zeros(batch, **long),
    }


@dataclass
class GemFlopFormula:
    """The section-8 FLOP formula of one GEM-ref model (build with GemFlopFormula.from_model)."""

    matmuls: list[MatmulTerm]
    attentions: list[AttentionTerm]
    fms: list[FmTerm]
    n_seq: int
    padded_lens: tuple[int, ...]
    """The model's padded length N_k per sequence type (the default for padded mode)."""

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: nn.Module) -> GemFlopFormula:
        """Derive the terms from a GemRef (compiled wrappers are unwrapped) with one shape-only probe."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from gemcompile.models.gem import PMA, BlockSelfAttention, GDPACrossAttention, WukongExpert
        from gemcompile.runtime.training.checkpoint import unwrap_model

        module = unwrap_model(model)
        cfg = getattr(module, "cfg", None)
        if cfg is None or not hasattr(cfg, "seq_max_lens"):
            raise TypeError(
                f"GemFlopFormula.from_model needs a GemRef (with .cfg), got {type(module).__name__}"
            )
        n_seq = len(cfg.seq_max_lens)
        # Batch size and padded lengths are distinct primes larger than any per-sample row count, so
        # the row count of every matmul factors uniquely into (B, N_k, multiplicity).
        probe_batch, *probe_lens = _distinct_primes(n_seq + 1, 10_000)
        seq_of_len = {n: k for k, n in enumerate(probe_lens)}
        names = {m: name for name, m in module.named_modules()}

        def seq_from(length: int, who: str) -> int:
            if length not in seq_of_len:
                raise RuntimeError(f"flop probe: {who} ran on length {length}, not a padded sequence length")
            return seq_of_len[length]

        matmuls: list[MatmulTerm] = []
        attentions: list[AttentionTerm] = []
        fms: list[FmTerm] = []

        def on_linear(mod: nn.Linear, args: tuple) -> None:
            rows = args[0].numel() // args[0].shape[-1]
            params = mod.weight.numel()
            name = names[mod]
            if rows % probe_batch:
                matmuls.append(MatmulTerm(name, params, "step", rows))
                return
            per_sample = rows // probe_batch
            for n, k in seq_of_len.items():
                if per_sample % n == 0:
                    matmuls.append(MatmulTerm(name, params, "token", per_sample // n, seq=k))
                    return
            if per_sample >= min(probe_lens):
                raise RuntimeError(
                    f"flop probe: {name} runs on {per_sample} rows per sample, too many to tell "
                    f"per-sample from per-token rows"
                )
            matmuls.append(MatmulTerm(name, params, "sample", per_sample))

        def on_attention(mod: nn.Module, args: tuple) -> None:
            s = args[0]  # (B, N_k, d) for every attention module of GEM-ref
            name, seq = names[mod], seq_from(s.shape[1], names[mod])
            common = {
                "name": name,
                "seq": seq,
                "n_heads": mod.n_heads,
                "d_qk": mod.head_dim,
                "d_v": mod.head_dim,
            }
            if isinstance(mod, PMA):
                attentions.append(AttentionTerm(kind="pma", n_fixed=mod.queries.shape[0], **common))
            elif isinstance(mod, GDPACrossAttention):
                attentions.append(AttentionTerm(kind="gdpa", n_fixed=args[1].shape[1], **common))
            else:
                attentions.append(AttentionTerm(kind="block", block_size=mod.block_size, **common))

        def on_fm(mod: WukongExpert, args: tuple) -> None:
            n_in, k = mod.fm_y.shape
            fms.append(FmTerm(names[mod], n_in=n_in, k=k, d=args[0].shape[-1]))

        handles = []
        for mod in module.modules():
            if isinstance(mod, nn.Linear):
                handles.append(mod.register_forward_pre_hook(on_linear))
            elif isinstance(mod, (PMA, GDPACrossAttention, BlockSelfAttention)):
                handles.append(mod.register_forward_pre_hook(on_attention))
            elif isinstance(mod, WukongExpert):
                handles.append(mod.register_forward_pre_hook(on_fm))
        try:
            device = next(module.parameters()).device
            with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
                module(**_probe_inputs(cfg, probe_batch, probe_lens, device))
        finally:
            for handle in handles:
                handle.remove()
        return cls(
            matmuls=matmuls, attentions=attentions, fms=fms, n_seq=n_seq, padded_lens=tuple(cfg.seq_max_lens)
        )

    # -- parameter groups (for reports) -----------------------------------------------------------

    def params_per_sample(self) -> int:
        """N_samp: matmul parameters applied once per sample (weighted by rows per sample)."""
        return sum(t.params * t.rows for t in self.matmuls if t.scope == "sample")

    def params_per_token(self) -> tuple[int, ...]:
        """N_tok per sequence type: matmul parameters applied once per valid token of that type."""
        return tuple(
            sum(t.params * t.rows for t in self.matmuls if t.scope == "token" and t.seq == k)
            for k in range(self.n_seq)
        )

    # -- the formula ------------------------------------------------------------------------------

    def breakdown(
        self,
        seq_lengths: Sequence[torch.Tensor | Sequence[int]] | None,
        batch_size: int,
        padded: bool = False,
        padded_lens: Sequence[int] | None = None,
        prefix: str | None = None,
    ) -> dict[str, int]:
        """Forward FLOPs per term: "linear.step", "linear.sample", "linear.token.{k}", "attention.pma",
        "attention.gdpa", "attention.block", "fm". With ``prefix``, only the modules whose name starts
        with it (e.g. "layers.2." for one layer: its local FLOPs).

        Useful mode (padded=False): seq_lengths[k] holds the B valid lengths of sequence k.
        Padded mode (padded=True): every length is the padded length N_k (padded_lens, default the
        model's) and block attention is the dense N_k x N_k masked attention the padded model runs;
        seq_lengths is ignored.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        lens = tuple(padded_lens) if padded_lens is not None else self.padded_lens
        if len(lens) != self.n_seq:
            raise ValueError(f"padded_lens must have {self.n_seq} entries, got {lens!r}")
        if padded:
            tokens = [batch_size * n for n in lens]
        else:
            if seq_lengths is None or len(seq_lengths) != self.n_seq:
                raise ValueError(f"seq_lengths must hold {self.n_seq} length vectors in useful mode")
            length_tensors = [_as_length_tensor(length) for length in seq_lengths]
            for k, length in enumerate(length_tensors):
                if length.numel() != batch_size:
                    raise ValueError(
                        f"seq_lengths[{k}] has {length.numel()} entries, expected batch_size = {batch_size}"
                    )
            tokens = [_sum_lengths(length) for length in length_tensors]
        out: dict[str, int] = {"linear.step": 0, "linear.sample": 0}
        out.update({f"linear.token.{k}": 0 for k in range(self.n_seq)})
        out.update({"attention.pma": 0, "attention.gdpa": 0, "attention.block": 0, "fm": 0})
        def keep(term) -> bool:
            return prefix is None or term.name.startswith(prefix)

        for t in filter(keep, self.matmuls):
            flops = 2 * t.params * t.rows
            if t.scope == "step":
                out["linear.step"] += flops
            elif t.scope == "sample":
                out["linear.sample"] += flops * batch_size
            else:
                out[f"linear.token.{t.seq}"] += flops * tokens[t.seq]
        block_pairs: dict[tuple[int, int], int] = {}
        for t in filter(keep, self.attentions):
            if t.kind == "block" and padded:
                pairs = batch_size * lens[t.seq] * lens[t.seq]  # the dense masked N x N attention
            elif t.kind == "block":
                key = (t.seq, t.block_size)
                if key not in block_pairs:
                    block_pairs[key] = int(block_attention_pairs(length_tensors[t.seq], t.block_size).sum())
                pairs = block_pairs[key]
            else:
                pairs = t.n_fixed * tokens[t.seq]  # PMA: n_pma x n; GDPA: n x n_sum
            out[f"attention.{t.kind}"] += t.flops_per_pair * pairs
        for t in filter(keep, self.fms):
            out["fm"] += t.flops_per_sample * batch_size
        return out

    def forward_flops(
        self, seq_lengths, batch_size: int, padded: bool = False, padded_lens: Sequence[int] | None = None
    ) -> int:
        """Forward FLOPs of one step (sum of breakdown())."""
        return sum(self.breakdown(seq_lengths, batch_size, padded=padded, padded_lens=padded_lens).values())

    def train_flops(
        self, seq_lengths, batch_size: int, padded: bool = False, padded_lens: Sequence[int] | None = None
    ) -> int:
        """Training FLOPs of one step: 3 x forward."""
        return TRAIN_FLOPS_PER_FORWARD * self.forward_flops(seq_lengths, batch_size, padded, padded_lens)
