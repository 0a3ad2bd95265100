"""What explain says about token-wise GEMMs that the unpad pass leaves on the padded rows with no refusal of
its own: a component no row mask anchored, and activation-checkpointed regions. Each is (node, reason)."""

from __future__ import annotations

from torch import fx

from gemcompile.passes.checkpointed_regions import is_checkpoint_call
from gemcompile.passes.graph import target_name

_ACROSS_TOKENS = frozenset({"fft_rfft", "fft_irfft", "fft_fft", "fft_ifft", "fft_rfftn", "fft_fftn", "cumsum",
                            "cumprod", "logcumsumexp"})
"""Ops that mix the tokens (BSARec's and FMLP-Rec's FFT filters over the sequence): zeroing the padded rows
before them would change the valid rows' results, so explain names them instead of advising it."""


def unanchored_reasons(unanchored: dict, claimed: set[fx.Node]) -> list[tuple[fx.Node, str]]:
    """One line per token-wise component with GEMMs that no row mask anchored (nothing zeroes its padded
    rows or reads it only where the mask holds): it runs padded, and explain says so instead of nothing."""
    reasons = []
    for first, (component, mask, every_key) in unanchored.items():
        gemms = [n for n in component if target_name(n) == "linear" and n not in claimed]
        if not gemms:
            continue
        names = ", ".join(n.name for n in gemms[:4]) + (", ..." if len(gemms) > 4 else "")
        padded = f"{len(gemms)} GEMM(s) ({names}) run on the padded rows too"
        mixer = next((u for n in component for u in n.users if target_name(u) in _ACROSS_TOKENS), None)
        if every_key is not None:  # the attention reads them as keys only where its sample has a valid key
            reasons.append((first, f"{padded}: {every_key.name} reads them as keys only where its sample has a "
                                    "valid key; a sample with none reads every key, padded ones included (its "
                                    "mask's fill is finite, as -1e9 or finfo.min: the softmax over all equal scores "
                                    "is uniform), and that output is used. Fill with -inf, or zero such samples' "
                                    "output, to let them skip the padding"))
        elif mixer is not None:
            reasons.append((first, f"{padded}: {mixer.name} (`{target_name(mixer)}`) mixes every token into every "
                                    "other, padded ones included, so the valid rows' results depend on the padded "
                                    "rows' values"))
        else:
            reasons.append((first, f"{padded}: nothing shows those rows unused (no product with the row mask of "
                                    f"{mask.describe()} or fill by it, no attention that reads them only as keys by "
                                    "it); zero the padded rows where the model ignores them (h * valid[..., None]) "
                                    "to let them skip the padding"))
    return reasons


def checkpointed_reasons(graph: fx.Graph) -> list[tuple[fx.Node, str]]:
    """One line for the activation-checkpointed regions (torch.utils.checkpoint, HF's gradient_checkpointing):
    unpad does not run inside them, so explain says so instead of nothing."""
    calls = [n for n in graph.nodes if is_checkpoint_call(n)]
    if not calls:
        return []
    return [(calls[0], f"{len(calls)} activation-checkpointed region(s) (torch.utils.checkpoint, "
                       "gradient_checkpointing): unpad does not run inside them, so their token-wise ops run on the "
                       "padded rows (the attention passes do run there); without checkpointing, or with "
                       "GemConfig.memory's budget instead, they can be packed")]
