"""Hand-written padded attention in the AOTAutograd joint graph -> gemcompile::jagged_attention.

The pre-grad attention rewrite (attention/rewrite.py) rewrites attention in the Dynamo graph; this pass
catches the hand-written spellings that reach the joint graph still as matmul / mask / softmax / matmul, e.g. when
the pre-grad stage did not run on them (another pipeline, a pass list without it). In the joint graph
the forward and backward of the attention are separate nodes, so the rewrite must replace both at
once: Inductor's pattern matcher does that with patterns traced through ``joint_fwd_bwd`` (training)
and ``fwd_only`` (inference), the approach of ``torch/_inductor/fx_passes/fuse_attention.py``.

Each pattern takes the mask as an input tensor. ``extra_check`` proves, with the same mask evaluator as
the pre-grad pass, that the mask keeps exactly the keys j < len[b] (no query mask, no causal part) and
is laid out (B, 1, 1, L); then the replacement recovers the lengths exactly as the number of kept keys
(``keep.sum(-1)``, which equals clamp(len, 0, L) for a proven prefix mask).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, joint_fwd_bwd, register_replacement

from gemcompile.passes.attention.kernels import HEAD_DIMS
from gemcompile.passes.base import GemPass
from gemcompile.passes.graph import Unproven, example_value
from gemcompile.passes.masks.classify import classify_length_mask
from gemcompile.passes.masks.evaluator import MaskEvaluator, keep_predicate
from gemcompile.passes.records import describe_nodes

_NEG_INF = float("-inf")


# -- patterns: (search, replacement) pairs written as plain PyTorch; `keep` is bool (B, 1, 1, L), True keeps,
# `additive` is float (B, 1, 1, L), 0 keeps and a large negative number drops -------------------------------

def _masked_fill_div(query, key, value, keep, inv_scale):
    s = (query @ key.transpose(-2, -1)).div(inv_scale)
    return s.masked_fill(~keep, _NEG_INF).softmax(dim=-1) @ value


def _masked_fill_mul(query, key, value, keep, scale):
    s = (query @ key.transpose(-2, -1)).mul(scale)
    return s.masked_fill(~keep, _NEG_INF).softmax(dim=-1) @ value


def _where_div(query, key, value, keep, inv_scale):
    s = (query @ key.transpose(-2, -1)).div(inv_scale)
    return torch.where(keep, s, _NEG_INF).softmax(dim=-1) @ value


def _where_mul(query, key, value, keep, scale):
    s = (query @ key.transpose(-2, -1)).mul(scale)
    return torch.where(keep, s, _NEG_INF).softmax(dim=-1) @ value


def _additive_div(query, key, value, additive, inv_scale):
    s = (query @ key.transpose(-2, -1)).div(inv_scale) + additive
    return s.softmax(dim=-1) @ value


def _additive_mul(query, key, value, additive, scale):
    s = (query @ key.transpose(-2, -1)).mul(scale) + additive
    return s.softmax(dim=-1) @ value


def _lengths_from_keep(keep):
    return keep.reshape(keep.shape[0], keep.shape[-1]).sum(-1)


def _attention(query, key, value, lengths, scale):
    return torch.ops.gemcompile.jagged_attention(query, key, value, None, lengths, None, False, scale)


def _keep_div(query, key, value, keep, inv_scale):
    return _attention(query, key, value, _lengths_from_keep(keep), 1.0 / inv_scale)


def _keep_mul(query, key, value, keep, scale):
    return _attention(query, key, value, _lengths_from_keep(keep), scale)


def _additive_lengths_div(query, key, value, additive, inv_scale):
    return _attention(query, key, value, _lengths_from_keep(additive == 0), 1.0 / inv_scale)


def _additive_lengths_mul(query, key, value, additive, scale):
    return _attention(query, key, value, _lengths_from_keep(additive == 0), scale)


# name -> (search, replacement, mask kind, scalar name)
PATTERNS = {
    "masked_fill_div": (_masked_fill_div, _keep_div, "keep", "inv_scale"),
    "masked_fill_mul": (_masked_fill_mul, _keep_mul, "keep", "scale"),
    "where_div": (_where_div, _keep_div, "keep", "inv_scale"),
    "where_mul": (_where_mul, _keep_mul, "keep", "scale"),
    "additive_div": (_additive_div, _additive_lengths_div, "additive", "inv_scale"),
    "additive_mul": (_additive_mul, _additive_lengths_mul, "additive", "scale"),
}
# odd example values that let the matcher find the scale among the traced constants
_SCALAR_WORKAROUND = {"inv_scale": 0.375, "scale": 0.3125}
_PATTERN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Recorder:
    """What extra_check saw during one run of the pass: accepted matches and refused candidates."""

    def __init__(self):
        self.accepted: list[tuple[fx.Node, str]] = []
        self.refused: list[tuple[fx.Node, str]] = []


_ACTIVE: list[_Recorder] = []


def _check(mask_name: str, mask_kind: str, scalar: str, match: Match) -> bool:
    """A constant scale, and a mask proven to be a key-padding mask laid out (B, 1, 1, L)."""
    anchor = match.output_nodes()[0] if match.output_nodes() else match.nodes[-1]
    mask = match.kwargs[mask_name]
    try:
        factor = match.kwargs.get(scalar)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise Unproven("the scores are scaled by a tensor or a symbolic value, not a constant")
        if not isinstance(mask, fx.Node):
            raise Unproven("a constant mask")
        shape = example_value(mask).shape
        key_len = example_value(match.kwargs["key"]).shape[-2]
        if len(shape) != 4 or shape[1] != 1 or shape[2] != 1 or shape[3] != key_len:
            raise Unproven(f"the mask has shape {tuple(shape)}, not (B, 1, 1, L): lengths are read off the key dim")
        query, key = example_value(match.kwargs["query"]), example_value(match.kwargs["key"])
        lo, hi = HEAD_DIMS
        if query.dim() != 4 or key.dim() != 4 or not lo <= query.shape[-1] <= hi:
            raise Unproven(f"q, k must be 4-D (B, H, L, D) with a head dim in {lo}..{hi}")
        evaluator = MaskEvaluator()
        keep = keep_predicate(evaluator, evaluator.tensor(mask), "bool" if mask_kind == "keep" else "additive")
        lengths = classify_length_mask(evaluator, keep, batch_is_one=shape[0] == 1)
        if lengths.q_lengths is not None or lengths.causal:
            raise Unproven("a query or causal mask: the joint-graph rewrite serves key-padding masks only")
    except Unproven as reason:
        if _ACTIVE:
            _ACTIVE[-1].refused.append((anchor, str(reason)))
        return False
    if _ACTIVE:
        _ACTIVE[-1].accepted.append((anchor, describe_nodes(match.nodes)))
    return True


@functools.cache
def _patterns() -> PatternMatcherPass:
    """Trace and register every pattern once (tracing costs seconds: only when the pass first runs)."""
    import gemcompile.lowering  # noqa: F401  (the replacement calls torch.ops.gemcompile.jagged_attention)

    patterns = PatternMatcherPass()
    for name, (search, replace, mask_kind, scalar) in PATTERNS.items():
        mask_name = "keep" if mask_kind == "keep" else "additive"
        for dtype in _PATTERN_DTYPES:
            qkv = [torch.empty(2, 4, 8, 16, dtype=dtype, requires_grad=True) for _ in range(3)]
            mask = (torch.empty(2, 1, 1, 8, dtype=torch.bool) if mask_kind == "keep"
                    else torch.empty(2, 1, 1, 8, dtype=dtype))
            check = functools.partial(_check, mask_name, mask_kind, scalar)
            workaround = {scalar: _SCALAR_WORKAROUND[scalar]}
            for trace in (joint_fwd_bwd, fwd_only):
                inputs = [*qkv, mask] if trace is joint_fwd_bwd else [t.detach() for t in (*qkv, mask)]
                register_replacement(search, replace, inputs, trace, patterns, extra_check=check,
                                     scalar_workaround=workaround)
    return patterns


_SCORE_CHAIN_DEPTH = 8
"""How far above a softmax's amax a score matmul may sit: the patterns put at most view, scale, mask and a
dtype cast (5 nodes) between the bmm and the amax."""


def _has_candidate(graph: fx.Graph) -> bool:
    """Whether some amax reads, within _SCORE_CHAIN_DEPTH nodes, the output of a batched matmul (q @ k^T):
    the only place a pattern can match. Tracing the patterns costs seconds of compile time (36 traces), so
    graphs whose softmaxes read no matmul of two activations (GEM-ref's expert gate reads a Linear) skip
    it."""
    for amax in graph.find_nodes(op="call_function", target=torch.ops.aten.amax.default):
        frontier, seen = [amax], {amax}
        for _ in range(_SCORE_CHAIN_DEPTH):
            frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
            seen.update(frontier)
            if any(n.target is torch.ops.aten.bmm.default for n in frontier):
                return True
    return False


class JaggedAttentionJointPass(GemPass):
    """Rewrites hand-written padded softmax attention found in the joint (or inference) graph."""

    name = "jagged_attention_joint"
    stage = "joint"
    config_section = "jagged_attention"

    def run(self, graph: fx.Graph) -> None:
        if not _has_candidate(graph):
            return  # no softmax over a matmul's scores: nothing to match, and no pattern tracing
        from torch._inductor.fx_passes.joint_graph import early_patterns
        from torch._inductor.fx_passes.post_grad import remove_noop_ops

        # the patterns were traced through these normalizations (pattern_matcher.joint_fwd_bwd); Inductor
        # applies them to this graph right after this slot anyway
        remove_noop_ops(graph)
        early_patterns.apply(graph)
        recorder = _Recorder()
        _ACTIVE.append(recorder)
        try:
            matched = _patterns().apply(graph)
        finally:
            _ACTIVE.pop()
        graph.eliminate_dead_code()
        for anchor, before in recorder.accepted[:matched]:
            self.rewrote(anchor, before, "gemcompile.jagged_attention_fwd / jagged_attention_bwd",
                         detail="mask proven: keys j < lengths[b]")
        for anchor, reason in dict.fromkeys(recorder.refused):  # a candidate may be checked by several patterns
            self.refused(anchor, reason)
