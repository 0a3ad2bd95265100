"""GemConfig: what gemcompile's passes do, one frozen section per pass.

Every field has a docstring under it (torchtitan style) and is validated in ``__post_init__``: a bad
value raises an error that names the field and the valid values, before anything is compiled. The
sections are folded into each pass's ``uuid()``, so a changed knob never reuses a stale cache entry.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


MAX_COLLECTIVE_TIMEOUT_S = 2_000_000
"""The longest collective timeout: gloo takes it as milliseconds in a C int (2**31 - 1 ms, ~24.8 days)."""


class ConfigError(ValueError):
    """A GemConfig field has a value outside its valid range."""

    same_on_every_rank = True
    """Settings come from the command every rank runs: under torchrun the error is said once."""


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is tuple:
        (item, *_rest) = typing.get_args(annotation)
        return f"a tuple of {_describe(item)}"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _matches(value: Any, annotation: Any) -> bool:
    """True if value has the type the annotation names (the small subset configs use)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return isinstance(value, tuple) and all(_matches(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, annotation)
    return isinstance(value, annotation)


def _check_types(obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            raise ConfigError(
                f"{type(obj).__name__}.{f.name} = {value!r} is invalid: expected {_describe(hints[f.name])}"
            )


def _reject_unknown_fields(cls):
    """Replace a dataclass's TypeError for an unknown keyword by one that lists the valid fields."""
    generated_init = cls.__init__

    @functools.wraps(generated_init)
    def __init__(self, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"{cls.__name__} has no field {', '.join(hints)}; valid fields: {', '.join(names)}"
            )
        generated_init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def config_section(cls):
    """Decorator for config dataclasses: frozen, keyword-only, typed fields checked, unknown fields named."""
    cls = dataclass(frozen=True, kw_only=True)(cls)
    return _reject_unknown_fields(cls)


@config_section
class JaggedAttentionConfig:
    """Padded softmax attention whose mask comes from per-sample lengths -> gemcompile::jagged_attention."""

    enabled: bool = True
    """Rewrite provable padded softmax attention into the jagged kernel."""

    min_kv_len: int = 1
    """Leave attention over fewer padded keys than this alone (tiny attentions gain nothing)."""

    def __post_init__(self):
        _check_types(self)
        if self.min_kv_len < 1:
            raise ConfigError(f"JaggedAttentionConfig.min_kv_len = {self.min_kv_len} is invalid: expected >= 1")


@config_section
class GdpaConfig:
    """Padded pointwise-activation attention (HSTU, GDPA cross-attention, PMA) -> gemcompile::gdpa."""

    enabled: bool = True
    """Rewrite provable act(q k^T) @ v attention (silu, gelu, relu, relu squared, sigmoid) into the kernel."""

    read_relative_table: bool = True
    """When the bias is a relative_bias gather (HSTU's rab), let the kernels read its table in place
    (passes/gdpa_relative_table.py) instead of a dense (Lq, Lk) bias."""

    def __post_init__(self):
        _check_types(self)


@config_section
class RelativeBiasConfig:
    """Relative-position bias gathers ``table[j - i + c]`` -> gemcompile::relative_bias (pre-grad)."""

    enabled: bool = True
    """Rewrite gathers whose index is proven to be j - i + constant: same values, and a backward that sums
    the gradient's diagonals instead of scattering L*L values into the table with atomic adds."""

    def __post_init__(self):
        _check_types(self)


@config_section
class BlockAttentionConfig:
    """Block-diagonal or sliding-window masked attention (+ RoPE just before) -> gemcompile::block_attention."""

    enabled: bool = True
    """Rewrite provable block-diagonal / windowed padded attention into the block-attention kernel."""

    fuse_rotary: bool = True
    """Fold a rotary embedding applied to q and k just before the attention into the kernel."""

    def __post_init__(self):
        _check_types(self)


@config_section
class TableBatchingConfig:
    """Sparsely trained embedding-bag tables looked up one by one -> one lookup op for many (pre-grad)."""

    enabled: bool = True
    """Pool the bags of tables that share a mode, dim, dtype, padding id and ids shape in one call: one
    forward launch and one backward op for all of them, instead of a few launches and Python calls each."""

    min_tables: int = 2
    """Leave groups of fewer tables than this as they are."""

    def __post_init__(self):
        _check_types(self)
        if self.min_tables < 2:
            raise ConfigError(f"TableBatchingConfig.min_tables = {self.min_tables} is invalid: expected >= 2")


@config_section
class TokenGemmConfig:
    """GEMMs over a data-dependent token count -> GEMMs of bucketed sizes (post-grad, passes/token_gemm.py)."""

    enabled: bool = True
    """Cover each mm / addmm's token dim with GEMMs of a few sizes per octave, so that cuBLAS chooses a
    kernel for each size once instead of at every step's new token count (0.2 to 4 ms of host time per
    GEMM on an H200, while the GPU waits). Costs fewer than max(1/per_octave of the tokens, min_rows)
    tokens computed twice."""

    per_octave: int = 16
    """Sizes per octave of the token count: more wastes fewer repeated tokens and meets more new shapes."""

    min_rows: int = 256
    """Smallest window; token dims under twice this run as one GEMM."""

    def __post_init__(self):
        _check_types(self)
        if self.per_octave < 1 or self.min_rows < 1:
            raise ConfigError(f"TokenGemmConfig: per_octave = {self.per_octave} and min_rows = {self.min_rows} "
                              f"must be >= 1")


@config_section
class TokenColumnSumsConfig:
    """Sums over packed tokens of tensors in memory anyway (bias gradients) -> torch's own reduction
    (post-grad, passes/token_column_sums.py)."""

    enabled: bool = False
    """Run such sums as gemcompile::token_column_sum (torch.sum, sized at each call) instead of Inductor's
    reduction over an unbacked row count. CUDA only. Off by default: torch's sum beat Inductor's unbacked
    one alone (lowering/token_column_sum.py), but in GEM-ref medium on torch 2.11 the sums run padded to a
    static size (passes/unpad_reductions.py), and with the pass on the step did not change: the sums' time
    moved from Inductor's kernels to torch's (benchmarks/results/e2e-medium-fill0.5-20261204-162825.json,
    ``gemcompile bench e2e --methods gem+token_column_sums@reduce-overhead``)."""
    min_columns: int = 16
    """Sums over fewer columns are left to Inductor."""

    def __post_init__(self):
        _check_types(self)
        if self.min_columns < 1:
            raise ConfigError(f"TokenColumnSumsConfig.min_columns = {self.min_columns} must be >= 1")


@config_section
class Fp32GemmOutConfig:
    """bf16 / fp16 GEMMs whose result is only cast to float32 write float32 (post-grad,
    passes/fp32_gemm_out.py)."""

    enabled: bool = True
    """Ask cuBLAS for the float32 result (``mm.dtype``) instead of a bf16 result and a cast kernel: the
    weight gradients of float32 parameters under autocast. CUDA only; a no-op where torch lacks it."""

    def __post_init__(self):
        _check_types(self)


@config_section
class UnpadConfig:
    """Token-wise regions of padded sequences (projections, norms, FFN) run on packed tokens (pre-grad)."""

    enabled: bool = True
    """Pack each provable token-wise region between a length mask's entry and exit points. It pays on
    sparse batches and costs on full ones (near full, the gathers, scatters and padded sums outweigh the
    skipped rows); the measured times by fill are in benchmarks/README.md, section "Unpad"."""

    min_gemms: int = 1
    """Leave a region with fewer linear layers than this padded: its gathers and scatters would cost
    more than the padding rows it skips."""

    expected_fill: float = 0.5
    """The share of valid tokens Inductor tunes packed kernels for (its size hint for T = B * N * this);
    any fill runs correctly and nothing recompiles, only kernel choices depend on it."""

    token_buckets: int | None = None
    """0: the packed length is exactly the batch's token count T. k > 0: T rounded up to a multiple of
    ceil(B * N / k) (at most k + 1 sizes; at most B * N / k rows of slack, computed on copies of a real token
    and dropped at the exit). For CUDA graphs (mode="reduce-overhead"): CUDA-graph trees record one graph
    per distinct size, so an exact T records anew for nearly every batch; with buckets each capacity
    records once. Costs the slack rows (packed attention ops give them zero outputs and gradients). None
    (the default): DEFAULT_CUDA_GRAPH_TOKEN_BUCKETS when the compile captures CUDA graphs (Inductor's
    triton.cudagraphs, as set by mode="reduce-overhead"), else 0."""

    packed_attention: bool = True
    """Attention ops with a packed layout (block_attention) read and write the region's packed rows, so the
    region goes on through them (passes/unpad_attention.py) instead of scattering q, k, v to padded rows and
    gathering the output back. False keeps every attention op a region boundary."""

    packed_row_reads: bool = True
    """A reader that picks a few rows of a region's output (``x.gather(1, idx)``, ``x[:, c]``,
    ``x[torch.arange(B), idx]``: the last or the k most recent tokens, a pooler's first token) reads them
    from the packed rows, so no B x N scatter is written for it (passes/unpad_row_reads.py). False keeps the
    scatter."""

    packed_losses: bool = True
    """A per-token loss that ignores rows by their labels (``F.cross_entropy(logits.view(-1, V),
    labels.view(-1), ignore_index=k)``, nll_loss) runs with what computes its logits on the rows whose label
    is not k (passes/unpad_losses.py). False leaves such losses on every row."""

    pad_reductions: bool | None = None
    """Sum over packed tokens as over zero-padded B * N rows (post-grad), so that Inductor splits the sum
    (bias and norm-weight gradients); see passes/unpad_reductions.py. None (the default): only where
    Inductor cannot size a reduction over T from its hint (torch < 2.13); its effect on the H200 is
    measured in benchmarks/README.md, section "Unpad"."""

    def __post_init__(self):
        _check_types(self)
        if not 0.0 < self.expected_fill <= 1.0:
            raise ConfigError(f"UnpadConfig.expected_fill = {self.expected_fill} is invalid: expected (0, 1]")
        if self.min_gemms < 0:
            raise ConfigError(f"UnpadConfig.min_gemms = {self.min_gemms} is invalid: expected >= 0")
        if self.token_buckets is not None and self.token_buckets < 0:
            raise ConfigError(f"UnpadConfig.token_buckets = {self.token_buckets} is invalid: expected 0 (exact "
                              "token counts) or the number of capacities k >= 1")


DEFAULT_CUDA_GRAPH_TOKEN_BUCKETS = 16
"""UnpadConfig.token_buckets under CUDA graphs when not set: at fill 0.5 about 3% slack rows on average
(half a bucket of B * N / 16 over T = B * N / 2), and at most 17 sizes per token index."""


def resolve_token_buckets(config: GemConfig, cudagraphs: bool) -> GemConfig:
    """``config`` with UnpadConfig.token_buckets decided (None: by whether the compile captures CUDA
    graphs)."""
    if config.unpad.token_buckets is not None:
        return config
    buckets = DEFAULT_CUDA_GRAPH_TOKEN_BUCKETS if cudagraphs else 0
    return dataclasses.replace(config, unpad=dataclasses.replace(config.unpad, token_buckets=buckets))


MXFP8_RECIPES = ("blockwise", "mxfp8", "mxfp8_emulated")
MXFP8_SCALE_RULES = ("floor", "rceil")
MXFP8_DEFAULT_EXCLUDE = ("*embed*", "*norm*", "*softmax*", "*router*", "*loss*", "*tower*", "*head",
                         "*logit*", "*classifier*")
"""Module-name patterns kept in high precision by default (research/mxfp8.md section 5): embedding tables
and the projections that build tokens from them (GEM-ref ``nonseq_embedding.*``, ``seq_embedding.*``),
norms, softmax/routing gates, the loss, and the final logit heads (GEM-ref ``heads.towers.*``; the shared
top MLP ``heads.top.*`` is an ordinary MLP and qualifies). Attention scores and ``p @ v`` are kept by
structure, not by name: a GEMM of two activations, or one next to a softmax, is never quantized."""


@config_section
class Mxfp8Config:
    """Block-scaled FP8 casts around qualifying GEMMs of the forward and backward graphs (post-grad).

    Each ``mm`` / ``addmm`` / ``bmm`` of a Linear-like layer (one operand a parameter) becomes
    ``gemcompile::fp8_mm`` with both operands quantized along the GEMM's reduction dim: forward X and W
    along K, dgrad dY and W along N, wgrad dY and X along the tokens. Shapes are judged as the Linear's
    (tokens M, in_features K, out_features N), so the three GEMMs of one layer get one decision.
    """

    enabled: bool = False
    """Insert FP8 quantization and scaled GEMMs (off by default: it changes numerics)."""

    recipe: Literal["blockwise", "mxfp8", "mxfp8_emulated"] = "blockwise"
    """"blockwise": E4M3, power-of-two scales, 1x128 blocks for activations and gradients and 128x128 for
    weights, cuBLAS blockwise GEMMs on Hopper (the fast recipe on H200). "mxfp8": OCP MX (1x32 blocks,
    E8M0 scales), native on Blackwell, emulated elsewhere with a warning. "mxfp8_emulated": the same MX
    numerics always emulated (quantize-dequantize, then a high-precision GEMM), bit-exact to
    ``mx_numerics.fake_quantize``; for numerics studies and tests."""

    scale_rule: Literal["floor", "rceil"] = "rceil"
    """How a block's power-of-two scale is chosen: "rceil" (NVIDIA / torchao default: amax / 448 rounded
    up, never clips) or "floor" (the OCP spec's rule; may clip the block maximum by up to ~12%)."""

    include: tuple[str, ...] = ("*",)
    """Module-name patterns that may be quantized (default: all). A GEMM's module is the innermost module
    of its forward call (``layers.0.ffn.1.up``); a pattern matches that module, any module enclosing it,
    or a module's class name (``Linear``). Patterns are fnmatch globs, case-insensitive, or regular
    expressions prefixed with ``re:`` (``re:layers\\.[0-3]\\..*``, searched, case-insensitive)."""

    exclude: tuple[str, ...] = MXFP8_DEFAULT_EXCLUDE
    """Module-name patterns kept in high precision even when included (same syntax as ``include``); the
    default keeps embeddings, norms, softmax/routing gates, the loss and the final logit heads."""

    min_m: int = 16384
    """Smallest token count M (rows of the Linear's input) that is quantized. FP8 loses to bf16 on small
    GEMMs: quantization is memory-bound and its share of the FP8 time grows as the GEMM shrinks (measured
    on the H200 in benchmarks/README.md, section "MXFP8: one Linear")."""

    min_k: int = 2048
    """Smallest in_features K of a Linear that is quantized (K, N <= 1024 run 0.5-0.9x of bf16 on H200)."""

    min_n: int = 2048
    """Smallest out_features N of a Linear that is quantized (N = 1..a few: logit heads never gain)."""

    bf16_weight_grad: tuple[str, ...] = ()
    """Module-name patterns (syntax as ``include``) whose weight-gradient GEMM (wgrad) stays in high
    precision while their forward and dgrad are quantized (torchao's ``wgrad_with_hp``): wgrad is the
    GEMM most sensitive to FP8 and the slowest blockwise one."""

    def __post_init__(self):
        for name in ("include", "exclude", "bf16_weight_grad"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif isinstance(value, str):
                raise ConfigError(f"Mxfp8Config.{name} = {value!r} is invalid: expected a tuple of patterns, "
                                  f"e.g. ({value!r},)")
        _check_types(self)
        for name in ("min_m", "min_k", "min_n"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Mxfp8Config.{name} = {getattr(self, name)} is invalid: expected >= 1")
        for name in ("include", "exclude", "bf16_weight_grad"):
            check_module_patterns(f"Mxfp8Config.{name}", getattr(self, name), "'*ffn*'")


def check_module_patterns(owner: str, patterns: tuple[str, ...], example: str) -> None:
    """Module-name patterns (fnmatch globs or ``re:`` regular expressions, passes/mxfp8.match_pattern): none
    empty, every regular expression compiles; ConfigError naming ``owner`` otherwise."""
    for pattern in patterns:
        if not pattern.strip():
            raise ConfigError(f"{owner} holds an empty pattern: expected module-name patterns such as "
                              f"{example} or 're:layers\\.\\d+\\.ffn'")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise ConfigError(f"{owner}: the regular expression {pattern!r} does not compile: {e}") from None


@config_section
class MemoryConfig:
    """What each compiled graph's forward saves for its backward (passes/activation_memory.py).

    Inductor's min-cut partitioner splits every joint graph into a forward and a backward and decides
    which forward values the backward reads (saved, held from the forward to the backward) and which it
    recomputes. gemcompile runs that partitioner under this section, per compiled graph (per unit under
    the parallel plan); ``explain`` prints what each graph saves, with shapes, dtypes and bytes.
    """

    budget: float | None = None
    """Activation memory budget, a fraction in (0, 1], handed to Inductor's partitioner as
    ``torch._functorch.config.activation_memory_budget`` for gemcompile's compiles only (the global
    setting is never changed). 1.0 saves what the partitioner saves by default (the runtime-optimal
    choice); lower values save less and recompute more in the backward, choosing by a knapsack the
    recomputes that cost the fewest FLOPs (pointwise ops, norms, gathers, RoPE before any GEMM). torch's
    scale runs from 0 = save only the graph's inputs (parameters included) to 1 = the default, so the
    fraction applies to what is saved beyond the inputs; a graph whose inputs outweigh what it saves by
    default is left as it is (torch's rule). None (the default): the partitioner's own setting,
    untouched. ``explain`` shows the saved bytes against the default's."""

    recompute_attention: bool = False
    """Let the partitioner recompute the forward of gemcompile's attention kernels (jagged_attention,
    gdpa, block_attention) and the per-step batch order / key bounds they share, in the backward, when
    a budget makes it worth it. False (the default): their outputs are always saved (tagged
    ``CheckpointPolicy.MUST_SAVE`` in the joint graph): recomputing an attention costs a whole kernel
    to save an output the size of q. Data-dependent sizes (unpad's token index) are never recomputed
    either way (a second host sync); a region the user wrapped in torch.utils.checkpoint keeps the
    user's choice."""

    fp8_saved: bool | tuple[str, ...] = False
    """Save the input x of qualifying Linear-like GEMMs for their weight gradient (dW = dy^T x) in FP8
    instead of its own dtype (passes/fp8_saved.py): E4M3 with a power-of-two scale per 1x128 block along
    the last dim (one per row when that dim is not a multiple of 128), quantized in the forward and
    dequantized just before dW in the backward. Only dW reads the FP8 copy: the output and every other
    gradient stay exact. False (the default): off. True: every qualifying GEMM. A tuple of module-name
    patterns (syntax as ``Mxfp8Config.include``: fnmatch globs on the GEMM's module path, an enclosing
    module or a class name, or ``re:`` regular expressions): the GEMMs of those modules only. A GEMM
    qualifies when one operand is a parameter and the other, x, is a floating activation of at least
    ``fp8_saved.MIN_ELEMENTS`` (65536) elements computed in the graph: never a graph input or parameter,
    never an output of gemcompile's attention ops or plans (nor a copy or gather of one). Where the backward
    needs x, or what x is recomputed from, at full precision anyway (a GELU's or a norm's input), an FP8 copy
    would save nothing and x stays exact. ``explain`` shows each tensor saved in FP8 with its dtype and bytes
    before and after, and why each other candidate was left alone."""

    def __post_init__(self):
        if isinstance(self.fp8_saved, list):
            object.__setattr__(self, "fp8_saved", tuple(self.fp8_saved))
        elif isinstance(self.fp8_saved, str):
            raise ConfigError(f"MemoryConfig.fp8_saved = {self.fp8_saved!r} is invalid: expected True, False "
                              f"or a tuple of module-name patterns, e.g. ({self.fp8_saved!r},)")
        _check_types(self)
        if isinstance(self.fp8_saved, tuple):
            check_module_patterns("MemoryConfig.fp8_saved", self.fp8_saved, "'mlp.*'")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:  # also refuses NaN
            raise ConfigError(f"MemoryConfig.budget = {self.budget} is invalid: expected a fraction in "
                              "(0, 1] (1.0 = what the partitioner saves by default; lower saves less and "
                              "recomputes more) or None (off)")
        if self.budget is not None:
            object.__setattr__(self, "budget", float(self.budget))


PARALLEL_AXES = ("dp_replicate", "dp_shard", "ep", "emb_outer", "emb_inner")
"""The five mesh axes of the plan, in the order ParallelConfig lists them."""


@config_section
class ParallelConfig:
    """The 5D parallel plan: sizes of the mesh axes for dense weights, experts and embedding tables.

    All axes are views of the same world (ranks node-major, as torchrun numbers them): dense weights
    use the mesh (dp_replicate, dp_shard) = HSDP; experts use (dp_replicate, dp_shard / ep, ep) with
    ep inside a node; embedding tables use (emb_outer, emb_inner). An axis left None is derived from
    the world size and gpus_per_node when the plan is built (runtime/distributed/plan.py).
    """

    enabled: bool = False
    """Annotate parameters with their DTensor placements and run the plan (off: single process)."""

    dp_replicate: int | None = None
    """Replicas of the dense weights, across nodes (gradients all-reduced once per step). None:
    world_size / dp_shard."""

    dp_shard: int | None = None
    """Ranks a dense weight is sharded over (FSDP), inside a node. None: gpus_per_node (the whole world
    when dp_replicate is given: world_size / dp_replicate). dp_replicate * dp_shard = world_size."""

    ep: int | None = None
    """Expert-parallel ranks (must divide dp_shard and the expert count): each holds expert_count / ep
    experts; activations are all-gathered and outputs reduce-scattered over this axis. None: the
    largest size dividing both (gcd)."""

    emb_outer: int | None = None
    """Column groups of each embedding table ("grid"), or replicas of the row-sharded tables
    ("replicated_groups"); across nodes. None: world_size / emb_inner."""

    emb_inner: int | None = None
    """Row ranges of each embedding table, inside a node. None: gpus_per_node (world_size / emb_outer
    when emb_outer is given). emb_outer * emb_inner = world_size."""

    gpus_per_node: int | None = None
    """Ranks per node, for the defaults above. None: $LOCAL_WORLD_SIZE (set by torchrun), else the
    whole world on one node."""

    embedding_sharding: Literal["grid", "replicated_groups"] = "grid"
    """"grid": each table fully sharded, columns over emb_outer and rows over emb_inner (placements
    (Shard(1), Shard(0))); lookups move ids and pooled outputs by all-to-all. "replicated_groups":
    rows sharded over emb_inner and the table replicated over emb_outer ((Replicate(), Shard(0)), the
    TorchRec 2D / DMPCollection layout); gradients all-reduced over emb_outer."""

    dense_table_max_rows: int = 64
    """Embedding tables with at most this many rows (action types, time buckets) are trained as dense
    weights (HSDP) instead of being sharded."""

    collective_timeout_s: float | None = None
    """Seconds a collective waits for the other ranks before this rank stops with an error (a rank that
    hangs or was suspended would otherwise hold every other rank), 1 to 2,000,000 (23 days). None: torch's
    default (30 minutes for gloo, 10 for NCCL)."""

    expert_modules: tuple[str, ...] = ("WukongExpert",)
    """Modules whose parameters are experts: class names or fnmatch patterns of module paths
    (``layers.*.interaction.experts.*``); each must sit in a ModuleList of sibling experts."""

    def __post_init__(self):
        if isinstance(self.expert_modules, list):
            object.__setattr__(self, "expert_modules", tuple(self.expert_modules))
        elif isinstance(self.expert_modules, str):
            raise ConfigError(f"ParallelConfig.expert_modules = {self.expert_modules!r} is invalid: expected a "
                              f"tuple of names or patterns, e.g. ({self.expert_modules!r},)")
        _check_types(self)
        for name in (*PARALLEL_AXES, "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"ParallelConfig.{name} = {value} is invalid: expected an int >= 1 or None")
        if self.collective_timeout_s is not None and not 1 <= self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:
            raise ConfigError(f"ParallelConfig.collective_timeout_s = {self.collective_timeout_s} is "
                              f"invalid: expected seconds in [1, {MAX_COLLECTIVE_TIMEOUT_S}] (gloo and NCCL "
                              "take milliseconds in a 32-bit range), or None for torch's default")
        if self.dense_table_max_rows < 0:
            raise ConfigError(f"ParallelConfig.dense_table_max_rows = {self.dense_table_max_rows} is invalid: "
                              "expected >= 0")
        if self.dp_shard is not None and self.ep is not None and self.dp_shard % self.ep:
            raise ConfigError(f"ParallelConfig.ep = {self.ep} is invalid: it must divide dp_shard = "
                              f"{self.dp_shard} (experts live inside the dense shard group)")
        if not all(p.strip() for p in self.expert_modules):
            raise ConfigError("ParallelConfig.expert_modules holds an empty pattern")


@config_section
class GemConfig:
    """Everything gemcompile's passes do. Sections may be given as dicts: GemConfig(jagged_attention={...})."""

    jagged_attention: JaggedAttentionConfig = field(default_factory=JaggedAttentionConfig)
    """Padded softmax attention -> jagged flash attention (pre-grad, and joint graph)."""

    gdpa: GdpaConfig = field(default_factory=GdpaConfig)
    """Padded pointwise-activation attention -> the GDPA kernel (pre-grad)."""

    block_attention: BlockAttentionConfig = field(default_factory=BlockAttentionConfig)
    """Block-diagonal / sliding-window attention (with fused RoPE) -> the block-attention kernel (pre-grad)."""

    relative_bias: RelativeBiasConfig = field(default_factory=RelativeBiasConfig)
    """Relative-position bias gathers -> a gather with a diagonal-sum backward (pre-grad)."""

    unpad: UnpadConfig = field(default_factory=UnpadConfig)
    """Token-wise regions of padded sequences -> packed tokens, so GEMMs skip padding (pre-grad)."""

    table_batching: TableBatchingConfig = field(default_factory=TableBatchingConfig)
    """Sparse embedding-bag lookups of many tables -> one lookup op (pre-grad)."""

    token_gemm: TokenGemmConfig = field(default_factory=TokenGemmConfig)
    """GEMMs over a data-dependent token count -> GEMMs of bucketed sizes (post-grad)."""

    mxfp8: Mxfp8Config = field(default_factory=Mxfp8Config)
    """FP8 block-scaled GEMMs in the forward and backward graphs (post-grad)."""

    fp32_gemm_out: Fp32GemmOutConfig = field(default_factory=Fp32GemmOutConfig)
    """bf16 GEMMs cast to float32 (weight gradients under autocast) -> GEMMs writing float32 (post-grad)."""

    token_column_sums: TokenColumnSumsConfig = field(default_factory=TokenColumnSumsConfig)
    """Sums over packed tokens of tensors in memory anyway (bias gradients) -> torch.sum (post-grad)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The 5D parallel plan (sharding annotations pre-grad; the runtime applies them)."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """What the forward saves for the backward: an activation memory budget for the partitioner,
    gemcompile's attention kernels kept out of recomputation, and FP8 copies of the inputs saved for
    weight gradients (joint graph, at partitioning)."""

    chain_existing_passes: bool = True
    """Run a pass the user installed in an Inductor slot gemcompile also uses (before gemcompile's own).
    False drops it, with a warning."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            section_type = hints[f.name]
            if dataclasses.is_dataclass(section_type) and isinstance(value, dict):
                try:
                    object.__setattr__(self, f.name, section_type(**value))
                except TypeError as e:
                    raise TypeError(f"GemConfig.{f.name}: {e}") from None
        _check_types(self)

    def section(self, name: str) -> Any:
        """The config section a pass reads, by field name."""
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, section: str | None = None) -> str:
        """Stable text of the whole config or one section, for pass uuids."""
        data = self.to_dict() if section is None else dataclasses.asdict(self.section(section))
        return json.dumps(data, sort_keys=True, default=repr)
