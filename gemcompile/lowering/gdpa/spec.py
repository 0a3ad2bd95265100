"""GdpaSpec: the flags of one GDPA call (everything but its tensors) as one frozen value.

The op schema (``gemcompile::gdpa``, ``gdpa_fwd``, ``gdpa_bwd``) is the only long signature: it stays
positional because torch.library needs it so and the passes emit it. op.py turns its arguments into a
spec once (:meth:`GdpaSpec.from_schema`), and the spec travels through the reference, the Triton
launchers, the FLOP formula and the eager path; :meth:`schema_args` turns it back into the schema's
arguments for the ops. Checks of its values live with the op's (op.py: ``check_gdpa_args``). The
optional tensors num_targets and kv_mask travel beside the spec (a spec holds no tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import Tensor

__all__ = ["GDPA_ACTIVATIONS", "GdpaSpec"]

GDPA_ACTIVATIONS = ("identity", "relu", "relu_squared", "silu", "sigmoid", "gelu", "gelu_tanh")
"""The pointwise activations GDPA applies to the scores (their index is the kernels' ACT code)."""


@dataclasses.dataclass(frozen=True)
class GdpaSpec:
    """What GDPA computes besides its tensors (q, k, v, q_lengths, kv_lengths, bias, num_targets, kv_mask)."""

    activation: str = "silu"
    """One of GDPA_ACTIVATIONS, applied to the scores instead of a softmax."""
    scale: float = 1.0
    """Multiplies q.k before the bias is added."""
    out_scale: float = 1.0
    """Multiplies the output."""
    divide_by_kv_length: bool = False
    """Divide each sequence's output by its (clamped) kv length."""
    causal: bool = False
    """Key j <= query i (top-left aligned)."""
    window: int = 0
    """0: no window; else i - j <= window (causal) or |i - j| <= window."""
    contextual_len: int = 0
    """HSTU's contextual prefix length (0: none; causal only)."""
    relative_offset: Optional[int] = None
    """None: the bias is dense; else the bias is a relative-position table read at j - i + offset."""

    @classmethod
    def from_schema(cls, activation, scale, out_scale, divide_by_kv_length, causal, window, num_targets=None,
                    contextual_len=0, relative_offset=None,
                    kv_mask=None) -> tuple["GdpaSpec", Optional[Tensor], Optional[Tensor]]:
        """(spec, num_targets, kv_mask) from the op schema's arguments after ``bias``, in its order."""
        spec = cls(activation, scale, out_scale, divide_by_kv_length, causal, window, contextual_len,
                   relative_offset)
        return spec, num_targets, kv_mask

    @classmethod
    def from_bwd_schema(cls, activation, scale, out_scale, divide_by_kv_length, causal, window,
                        bias_requires_grad, num_targets=None, contextual_len=0, relative_offset=None,
                        kv_mask=None) -> tuple["GdpaSpec", Optional[Tensor], bool, Optional[Tensor]]:
        """(spec, num_targets, bias_requires_grad, kv_mask) from gdpa_bwd's arguments after ``bias``, in
        its order."""
        spec = cls(activation, scale, out_scale, divide_by_kv_length, causal, window, contextual_len,
                   relative_offset)
        return spec, num_targets, bias_requires_grad, kv_mask

    def schema_args(self, num_targets: Optional[Tensor], kv_mask: Optional[Tensor] = None) -> tuple:
        """The op schema's arguments after ``bias`` (gdpa, gdpa_fwd), in its order."""
        return (self.activation, self.scale, self.out_scale, self.divide_by_kv_length, self.causal,
                self.window, num_targets, self.contextual_len, self.relative_offset, kv_mask)

    def bwd_schema_args(self, bias_requires_grad: bool, num_targets: Optional[Tensor],
                        kv_mask: Optional[Tensor] = None) -> tuple:
        """gdpa_bwd's arguments after ``bias``, in its order."""
        return (self.activation, self.scale, self.out_scale, self.divide_by_kv_length, self.causal,
                self.window, bias_requires_grad, num_targets, self.contextual_len, self.relative_offset,
                kv_mask)
