"""The pass pipeline: every gemcompile pass, in the order it runs within its stage.

One file per pass (the attention rewrite: a folder, attention/, with a module per kernel family); add a
pass by importing it here and adding it to PIPELINE. Stages run in the order pre_grad (Dynamo graph, in GemBackend), joint (AOTAutograd joint graph), post_grad (forward and
backward graphs); see passes/base.py for why each rewrite sits where it does.
"""

from gemcompile.passes.attention.joint import JaggedAttentionJointPass
from gemcompile.passes.attention.relative_bias import RelativeBiasPass
from gemcompile.passes.attention.rewrite import AttentionRewritePass
from gemcompile.passes.base import STAGES, GemPass, PassManager, Stage
from gemcompile.passes.fp32_gemm_out import Fp32GemmOutPass
from gemcompile.passes.gdpa_relative_table import GdpaRelativeTablePass
from gemcompile.passes.inductor_sdpa_fence import InductorSdpaFencePass
from gemcompile.passes.mxfp8 import Mxfp8Pass
from gemcompile.passes.sharding import ShardingPass
from gemcompile.passes.table_batching import TableBatchingPass
from gemcompile.passes.token_column_sums import TokenColumnSumPass
from gemcompile.passes.token_gemm import TokenGemmPass
from gemcompile.passes.unpad import UnpadPass
from gemcompile.passes.unpad_reductions import UnpadReductionsPass

PIPELINE: tuple[type[GemPass], ...] = (
    ShardingPass,  # pre_grad: each parameter's mesh and DTensor placements -> node.meta["custom"] (no rewrite)
    RelativeBiasPass,  # pre_grad: table[j - i + c] gathers -> gemcompile::relative_bias (diagonal-sum backward)
    AttentionRewritePass,  # pre_grad: padded attention -> block_attention / jagged_attention / gdpa, by its mask
    GdpaRelativeTablePass,  # pre_grad: gdpa over a relative_bias gather -> gdpa reading the table in place
    UnpadPass,  # pre_grad: token-wise regions of padded sequences -> packed (T, ...) tokens
    TableBatchingPass,  # pre_grad: sparse embedding-bag lookups of many tables -> one sparse_embedding_bags
    InductorSdpaFencePass,  # joint: Inductor's attention patterns decline in gemcompile's compiles (no rewrite)
    JaggedAttentionJointPass,  # joint: hand-written padded attention that reached the joint graph
    TokenColumnSumPass,  # post_grad: sums over packed tokens of tensors in memory (bias grads) -> torch.sum
    UnpadReductionsPass,  # post_grad: sums over packed tokens padded to a static size (Inductor < 2.13)
    Mxfp8Pass,  # post_grad: FP8 casts around the fwd / dgrad / wgrad GEMMs of qualifying layers
    TokenGemmPass,  # post_grad: GEMMs over a data-dependent token count -> GEMMs of bucketed sizes
    Fp32GemmOutPass,  # post_grad: bf16 GEMMs only cast to float32 (weight gradients) -> GEMMs writing float32
)
"""The default passes, in order."""

__all__ = ["PIPELINE", "STAGES", "GemPass", "PassManager", "Stage", "UnpadPass", "UnpadReductionsPass"]
