"""GemBackend: the Dynamo backend behind gem_compile.

It runs gemcompile's pre-grad passes on the Dynamo graph, then hands the rewritten graph to Inductor's
``compile_fx`` with ``config_patches`` that put gemcompile's joint and post-grad pass managers in
Inductor's ``joint_custom_pre_pass`` and ``post_grad_custom_pre_pass`` slots for this compile only
(no global config is touched). A pass the user had installed in one of those slots keeps running,
chained before ours. The same patches put gemcompile's partitioner (passes/activation_memory.py: Inductor's
min-cut partitioner under GemConfig.memory) in ``custom_partitioner_fn``, and the memory budget is patched
into functorch's config around the compile only. On a torch whose Inductor cannot read unpad's token-count
hints, Inductor's scheduler heuristics (fusion scores, peak-memory reordering) are taught them once per
process (passes/packed_size_hints.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from gemcompile.config import GemConfig, resolve_token_buckets
from gemcompile.passes import PIPELINE, GemPass, PassManager, packed_reduction_blocks, packed_size_hints
from gemcompile.passes.activation_memory import (ActivationMemoryPartitioner, budget_patch,
                                                  has_partitioner_slot)
from gemcompile.passes.base import instantiate, run_pre_grad
from gemcompile.passes.records import PassLog, active_log, recording

log = logging.getLogger(__name__)

# Inductor slot -> the stage gemcompile runs there.
SLOTS: dict[str, str] = {"joint_custom_pre_pass": "joint", "post_grad_custom_pre_pass": "post_grad"}


def allow_warnings_in_graphs() -> None:
    """Let Dynamo replay ``warnings.warn`` after a graph instead of breaking it. torch's own modules warn
    while they run (TransformerEncoderLayer: "mismatched src_key_padding_mask and src_mask"); a graph break
    there splits the attention from its masks, and nothing is rewritten. Also lets Dynamo trace torch's
    causal-mask detection (``_trace_causal_mask_detection``). Idempotent."""
    torch._dynamo.config.reorderable_logging_functions.add(warnings.warn)
    _trace_causal_mask_detection()


_MASK_DETECTION_SUBSTITUTED = False


def _trace_causal_mask_detection() -> None:
    """nn.TransformerEncoder / nn.TransformerDecoder given a mask and no is_causal hint (the way most models
    call them: ``encoder(x, mask=causal, src_key_padding_mask=pad)``) ask
    ``torch.nn.modules.transformer._detect_is_causal_mask`` whether the mask is causal, which reads the
    mask's values (``bool((mask == causal).all())``): a graph break inside torch.nn, after which Dynamo
    runs the whole encoder eagerly, so no pass sees its attention. Traced by Dynamo (never in eager), the
    detection answers with the hint as given, False for None. That is exact: the answer only chooses
    between applying the mask as given and SDPA's is_causal when the mask is the causal one (torch's own
    docstring: a False hint for a causal mask "may lead to reduced performance"), and gemcompile's pass
    proves a causal mask causal from how it was built. Registered once per process, where Dynamo has
    ``substitute_in_graph`` and torch has the function."""
    global _MASK_DETECTION_SUBSTITUTED
    if _MASK_DETECTION_SUBSTITUTED:
        return
    _MASK_DETECTION_SUBSTITUTED = True
    import torch.nn.modules.transformer as transformer

    original = getattr(transformer, "_detect_is_causal_mask", None)
    substitute = getattr(torch._dynamo, "substitute_in_graph", None)
    if original is None or substitute is None:
        return

    def _detect_is_causal_mask(mask, is_causal=None, size=None):
        return is_causal is True

    try:
        substitute(original, skip_signature_check=True)(_detect_is_causal_mask)
    except (TypeError, ValueError) as error:  # registered by someone else first, or a torch that refuses it
        log.debug("gemcompile: torch's causal-mask detection stays as it is: %s", error)


def check_mode_and_options(mode: Any, options: Any) -> None:
    """Raise at once, as torch.compile does for Inductor, when `mode` or `options` cannot be used: a
    RuntimeError that leads with what is wrong and lists the valid names."""
    import difflib
    import typing

    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    if mode is not None and options is not None:
        raise RuntimeError("gem_compile: give either mode or options, not both (as torch.compile)")
    if mode is not None:
        modes = list(list_mode_options())
        if not isinstance(mode, str) or mode not in modes:
            raise RuntimeError(f"gem_compile: unknown mode {mode!r}; valid modes: {', '.join(modes)}")
    if options is None:
        return
    if not isinstance(options, dict):
        raise RuntimeError(f"gem_compile: options must be a dict of Inductor config names to values, got "
                           f"{type(options).__name__}")
    known = inductor_config.get_config_copy()
    for key, value in options.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            public = sorted(k for k in known if not k.startswith("_") and k != "TYPE_CHECKING")
            raise RuntimeError(f"gem_compile: unknown option {key!r}{hint}; valid options are Inductor's "
                               f"config names (torch._inductor.list_options()): {', '.join(public)}")
        expected = inductor_config.get_type(name)
        plain_type = typing.get_origin(expected) is None and isinstance(expected, type)
        if plain_type and not isinstance(value, expected):
            raise RuntimeError(f"gem_compile: option {key!r} = {value!r} is of type {type(value).__name__}, "
                               f"expected {expected.__name__}")


def _inductor_patches(mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> dict[str, Any]:
    """What torch.compile(mode=..., options=...) would have patched into Inductor's config."""
    check_mode_and_options(mode, options)
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode, dynamic))
    if options:
        patches.update({k.replace("-", "_"): v for k, v in options.items()})
    return patches


class GemBackend:
    """A torch.compile backend: ``torch.compile(model, backend=GemBackend(config))``.

    ``passes`` overrides the default pipeline (tests and experiments); ``last_log`` holds what the
    passes reported during the most recent graph compiled by this backend.
    """

    def __init__(self, config: GemConfig | None = None, *, passes: Sequence[type[GemPass]] | None = None):
        if config is None:
            config = GemConfig()
        if not isinstance(config, GemConfig):
            raise TypeError(f"config must be a gemcompile.GemConfig, got {type(config).__name__}")
        self.config = config
        # Dynamo names the backend by __name__ in its errors (BackendCompilerFailed): a short name, so
        # that the reason comes first, not this backend's repr (the whole GemConfig).
        self.__name__ = "gemcompile"
        self.pass_types = tuple(PIPELINE if passes is None else passes)
        self.last_log = PassLog()

    def make_passes(self, config: GemConfig | None = None) -> list[GemPass]:
        """The passes, configured by ``config`` (this backend's when None)."""
        return instantiate(self.pass_types, self.config if config is None else config)

    def slot_managers(self, passes: Sequence[GemPass], patches: dict[str, Any]) -> dict[str, PassManager]:
        """One PassManager per Inductor slot gemcompile uses, chaining what is installed there."""
        import torch._inductor.config as inductor_config

        managers = {}
        for slot, stage in SLOTS.items():
            existing = patches.get(slot, getattr(inductor_config, slot))
            if existing is not None and not self.config.chain_existing_passes:
                warnings.warn(f"gemcompile replaces the pass installed in torch._inductor.config.{slot} "
                              "(GemConfig.chain_existing_passes=False)", stacklevel=3)
                existing = None
            manager = PassManager(stage, passes, chained=existing)
            if manager:
                managers[slot] = manager
        return managers

    def partitioner(self, patches: dict[str, Any]) -> dict[str, Any]:
        """``{"custom_partitioner_fn": ...}``: gemcompile's partitioner, chaining one already installed, when
        GemConfig.memory asks for something (a budget, recompute_attention, fp8_saved); empty otherwise, and
        on a torch without the slot (the budget still applies; the attention tags, FP8 copies and the record
        do not)."""
        import torch._inductor.config as inductor_config

        memory = self.config.memory
        if memory.budget is None and not memory.recompute_attention and not memory.fp8_saved:
            # the default compile keeps Inductor's own partitioner untouched (the path measured on the GPU);
            # explain still records the saved tensors through its own backend
            return {}
        if not has_partitioner_slot():
            if self.config.memory.budget is not None and not self.config.memory.recompute_attention:
                warnings.warn("this torch's Inductor has no custom_partitioner_fn: GemConfig.memory.budget "
                              "applies, but gemcompile's attention kernels may be recomputed", stacklevel=3)
            if memory.fp8_saved:
                warnings.warn("this torch's Inductor has no custom_partitioner_fn: GemConfig.memory."
                              "fp8_saved is ignored (activations are saved in their own dtype)", stacklevel=3)
            return {}
        existing = patches.get("custom_partitioner_fn", inductor_config.custom_partitioner_fn)
        if existing is not None and not self.config.chain_existing_passes:
            warnings.warn("gemcompile replaces the partitioner installed in torch._inductor.config."
                          "custom_partitioner_fn (GemConfig.chain_existing_passes=False)", stacklevel=3)
            existing = None
        return {"custom_partitioner_fn": ActivationMemoryPartitioner(self.config, chained=existing)}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Any:
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        _warn_if_split_by_ddp()
        patches = _inductor_patches(mode, options, dynamic=None)
        cudagraphs = bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
        # (unpad's token counts bucketed when CUDA-graph trees would otherwise record a graph per batch)
        config = resolve_token_buckets(self.config, cudagraphs)
        packed_size_hints.install()  # the backward compiles later, at its first call: a lasting wrapper
        packed_reduction_blocks.install()  # likewise (acts only on graphs with unpad's token counts)
        passes = self.make_passes(config)
        # Report into an outer log (explain) when there is one, else into this backend's own.
        target = active_log() or PassLog()
        self.last_log = target
        with recording(target):
            run_pre_grad(gm, passes, example_inputs)
            patches.update(self.slot_managers(passes, patches))
            patches.update(self.partitioner(patches))
            # around the whole compile, so that AOTAutograd's cache key (it hashes functorch's config) sees it
            with budget_patch(self.config.memory.budget):
                return compile_fx(gm, example_inputs, config_patches=patches)

    def __repr__(self) -> str:
        return f"GemBackend({self.config!r})"


def _warn_if_split_by_ddp() -> None:
    """torch.compile(ddp_model, backend="gemcompile") keeps Dynamo's DDP optimizer, which hands this backend one
    gradient bucket's piece at a time (gem_compile turns it off): masks built in another piece are unprovable."""
    from torch.nn.parallel import DistributedDataParallel

    split = torch._dynamo.config.optimize_ddp in (True, "ddp_optimizer")
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
    if split and active is not None:
        warnings.warn("gemcompile: Dynamo splits this DistributedDataParallel model at its gradient buckets, so a "
                      "mask built in one piece reaches the attention in another as an unprovable input; compile "
                      "with gem_compile(model) or set torch._dynamo.config.optimize_ddp = False", stacklevel=2)


def _registered_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    """``torch.compile(model, backend="gemcompile")``: GemBackend with the default config."""
    return GemBackend()(gm, example_inputs, **kwargs)


def _register_by_name() -> None:
    """The name "gemcompile" for torch.compile. An installed package also declares it as a
    ``torch_dynamo_backends`` entry point, which torch loads by name in a process that never imported
    gemcompile; torch then registers the function itself (a second registration would be a duplicate)."""
    from torch._dynamo.backends import registry

    if getattr(registry, "_BACKENDS", {}).get("gemcompile") is not None:
        return  # this import is torch loading the entry point
    try:
        torch._dynamo.register_backend(_registered_backend, name="gemcompile")
    except Exception as e:  # already registered (module reloaded) or a torch without the registry
        log.debug("backend 'gemcompile' not registered: %s", e)


_register_by_name()
# torch.compile(model, backend="gemcompile") traces before any gemcompile code runs: what gem_compile and
# explain set up for Dynamo (both exact, see allow_warnings_in_graphs) is set up once the backend exists
allow_warnings_in_graphs()
