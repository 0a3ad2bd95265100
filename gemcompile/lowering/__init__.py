"""The ops the passes emit: torch.library definitions (schema, fake, autograd, dispatch), their Triton
kernels and a plain-PyTorch reference for each.

Importing this package registers the ops, e.g. ``torch.ops.gemcompile.jagged_attention``.
"""

from . import checks
from . import jagged_attention as jagged_attention_ops  # noqa: F401  registers gemcompile::jagged_attention*
from . import gdpa as gdpa_ops  # noqa: F401  registers gemcompile::gdpa*
from . import block_attention as block_attention_ops  # noqa: F401  registers gemcompile::block_attention*
from . import valid_tokens as valid_tokens_ops  # noqa: F401  registers gemcompile::valid_token_index
from . import scaled_mm as scaled_mm_ops  # noqa: F401  registers gemcompile::fp8_mm (kernels: mx_quantize_triton, lazily)
from . import relative_bias as relative_bias_ops  # noqa: F401  registers gemcompile::relative_bias
from .checks import strict_length_checks

__all__ = ["checks", "strict_length_checks"]
