"""Stand-ins for two fbgemm_gpu jagged ops, with fbgemm's names, schemas and meaning, so that HSTU code written
as generative-recommenders writes it (q, k, v padded by ``torch.ops.fbgemm.jagged_to_padded_dense``, the
output packed back by ``torch.ops.fbgemm.dense_to_jagged``) runs where fbgemm_gpu is not installed (CI).
Defined only when torch.ops.fbgemm lacks them; plain torch ops (CompositeImplicitAutograd), so autograd, fake
tensors and Dynamo need nothing more. Written here from the ops' documented behaviour."""

import torch

_LIB = None


def _has(name: str) -> bool:
    try:
        getattr(torch.ops.fbgemm, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    (off,), (n,) = offsets, max_lengths
    lengths = off[1:] - off[:-1]
    pos = torch.arange(n, device=values.device)
    # sizes stay symbolic (no int() or max() of a size: that would specialize a compile on the token count);
    # at least one token (values[0] exists)
    index = (off[:-1, None] + pos[None, :]).clamp(0, values.shape[0] - 1)
    valid = (pos[None, :] < lengths[:, None]).unsqueeze(-1)
    return torch.where(valid, values[index], padding_value)


def _dense_to_jagged(dense, x_offsets, total_L=None):
    (off,) = x_offsets
    total = total_L if total_L is not None else dense.shape[0] * dense.shape[1]
    token = torch.arange(total, device=dense.device)
    b = torch.searchsorted(off[1:], token, right=True).clamp(max=dense.shape[0] - 1)
    n = (token - off[b]).clamp(0, dense.shape[1] - 1)
    return dense[b, n], [off]


def ensure() -> None:
    """Define fbgemm::jagged_to_padded_dense and fbgemm::dense_to_jagged unless fbgemm_gpu provides them."""
    global _LIB
    if _LIB is not None or (_has("jagged_to_padded_dense") and _has("dense_to_jagged")):
        return
    _LIB = torch.library.Library("fbgemm", "FRAGMENT")
    _LIB.define("jagged_to_padded_dense(Tensor values, Tensor[] offsets, SymInt[] max_lengths, "
                "float padding_value=0) -> Tensor")
    _LIB.define("dense_to_jagged(Tensor dense, Tensor[] x_offsets, SymInt? total_L=None) -> (Tensor, Tensor[])")
    _LIB.impl("jagged_to_padded_dense", _jagged_to_padded_dense, "CompositeImplicitAutograd")
    _LIB.impl("dense_to_jagged", _dense_to_jagged, "CompositeImplicitAutograd")
