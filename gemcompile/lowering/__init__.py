"""The custom ops the passes lower to: gemcompile's ``torch.ops.gemcompile.*`` (schema, fake, autograd,
dispatch), each with its Triton kernels, a plain-PyTorch reference and a FLOP formula. (Inductor's own
"lowering", torch/_inductor/lowering.py, means aten -> Inductor IR; this package is not that: the passes
rewrite graphs into calls of these ops, which stay opaque to Inductor.)

Importing this package registers every op. One folder per op, one file per concept::

    common/               the op kit every op shares
      opkit.py            the torch.library handle, dispatch rules, eager fast path, autograd plumbing
      checks.py           argument checks, the kernels' head-dim limits, what each kernel serves
      reference.py        plain-PyTorch helpers of the references
      flops.py            the attention FLOP conventions
      tuned_launch.py     TRITON_INTERPRET and the launcher that asks the autotuner once per key
      attention_triton.py the Triton toolkit of the attention kernels (loads, stores, order, prune)
      length_order.py     what the attention ops derive from lengths / a key mask (order, key bounds), counted
      length_order_triton.py  batch order longest first (a counting argsort in one launch)
      jagged.py           jagged <-> padded conversions, the length bucket
    jagged_attention/     gemcompile::jagged_attention   op.py reference.py triton.py flops.py
    block_attention/      gemcompile::block_attention    op.py reference.py triton.py flops.py
    gdpa/                 gemcompile::gdpa               op.py spec.py reference.py triton.py pairs_triton.py
                          bias_grad_triton.py relative_table.py diagonal_sums_triton.py flops.py
    relative_bias/        gemcompile::relative_bias      op.py
    sparse_embedding/     gemcompile::sparse_embedding   op.py pending.py adagrad.py reference.py adagrad_triton.py
    fp8/                  gemcompile::fp8_mm             scaled_mm.py quantize_triton.py numerics.py
    valid_tokens.py       gemcompile::valid_token_index, gemcompile::valid_mask_index
    token_gemm.py         gemcompile::token_mm (a GEMM over packed tokens as GEMMs of bucketed sizes)
    token_column_sum.py   gemcompile::token_column_sum (a sum over packed tokens by torch.sum: bias gradients)
    length_order.py       gemcompile::length_order, gemcompile::key_bounds (derived once per step, shared)

A new op is one folder like the others: ``op.py`` (schema, fake, autograd, dispatch, built from
common/opkit.py), ``reference.py``, ``triton.py``, ``flops.py``, and one import line below. lowering/
imports nothing outside lowering/.
"""

from . import length_order  # noqa: F401  registers gemcompile::length_order, gemcompile::key_bounds
from . import packed_row_gather  # noqa: F401  registers gemcompile::packed_row_gather(_backward)
from . import token_column_sum  # noqa: F401  registers gemcompile::token_column_sum
from . import token_gemm  # noqa: F401  registers gemcompile::token_mm
from . import valid_tokens  # noqa: F401  registers gemcompile::valid_token_index, gemcompile::valid_mask_index
from .block_attention import op as block_attention_op  # noqa: F401  registers gemcompile::block_attention*
from .common.checks import strict_length_checks
from .fp8 import scaled_mm  # noqa: F401  registers gemcompile::fp8_mm (its kernels load lazily)
from .gdpa import op as gdpa_op  # noqa: F401  registers gemcompile::gdpa*
from .jagged_attention import op as jagged_attention_op  # noqa: F401  registers gemcompile::jagged_attention*
from .relative_bias import op as relative_bias_op  # noqa: F401  registers gemcompile::relative_bias
from .sparse_embedding import op as sparse_embedding_op  # noqa: F401  registers gemcompile::sparse_embedding

__all__ = ["strict_length_checks"]
