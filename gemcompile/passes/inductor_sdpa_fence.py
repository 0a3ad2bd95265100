"""Inductor's attention patterns kept out of gemcompile's compiles.

Inductor rewrites attention-shaped chains into ``scaled_dot_product_attention`` by patterns
(torch/_inductor/fx_passes/fuse_attention.py) that do not read the numbers in them (pytorch/pytorch#196468,
open, "correctness (silent)"): a softmax over the queries (RecBole's LightSANs, in training too), a padding
mask compared with 1 instead of 0, a query-row view of a mask taken for a key one, a fill of -1 (inference)
all became SDPA computing something else, under plain torch.compile as under gem_compile. gemcompile rewrites
the attention whose mask it proves; what it refuses must run as written.

This pass runs first in the joint slot, after Inductor registered its patterns and before it applies them
(torch/_inductor/fx_passes/joint_graph.py), and makes each of those patterns decline while a gemcompile
compile runs (the slot then holds gemcompile's PassManager). torch.compile without gemcompile, in the same
process, keeps them. ``GEMCOMPILE_INDUCTOR_SDPA_PATTERNS=1`` keeps them in gemcompile's compiles too.
"""

from __future__ import annotations

import torch.fx as fx
from torch._dynamo.utils import counters

from gemcompile.env import env_flag
from gemcompile.passes.base import GemPass, PassManager

_FENCED = "_gemcompile_fenced"
_CHECKS = ("_sfdp_extra_check", "_sfdp_params_check")  # fuse_attention.py's checks, in every pattern


def _is_sdpa_pattern(entry) -> bool:
    """Whether a pattern entry is one of fuse_attention.py's: by its name (torch 2.13) or by the check its
    extra_check closes over (older torch names no pattern)."""
    if (getattr(entry, "pattern_name", None) or "").startswith("_sfdp_pattern"):
        return True
    for cell in getattr(entry.extra_check, "__closure__", None) or ():
        try:
            name = getattr(cell.cell_contents, "__qualname__", "")
        except ValueError:  # an empty cell
            continue
        if name.startswith(_CHECKS):
            return True
    return False


def _inside_gemcompile() -> bool:
    import torch._inductor.config as inductor_config

    return isinstance(inductor_config.joint_custom_pre_pass, PassManager)


def fence_sdpa_patterns() -> int:
    """Wrap the extra_check of each of Inductor's attention patterns not wrapped yet; the number wrapped."""
    from torch._inductor.fx_passes.joint_graph import patterns

    wrapped = 0
    for entries in patterns.patterns.values():
        for entry in entries:
            if getattr(entry, _FENCED, False) or not _is_sdpa_pattern(entry):
                continue
            original = entry.extra_check

            def check(match, original=original):
                if _inside_gemcompile() and not env_flag("GEMCOMPILE_INDUCTOR_SDPA_PATTERNS", False):
                    counters["gemcompile"]["inductor_sdpa_pattern_declined"] += 1
                    return False
                return original(match)

            entry.extra_check = check
            setattr(entry, _FENCED, True)
            wrapped += 1
    return wrapped


class InductorSdpaFencePass(GemPass):
    """Inductor's attention patterns decline in gemcompile's compiles (see the module doc); no rewrite."""

    name = "inductor_sdpa_fence"
    stage = "joint"
    config_section = None

    def run(self, graph: fx.Graph) -> None:
        fence_sdpa_patterns()

    def uuid(self) -> str:  # the switch changes what Inductor emits: a cache key of its own
        return f"{super().uuid()}:{env_flag('GEMCOMPILE_INDUCTOR_SDPA_PATTERNS', False)}"
