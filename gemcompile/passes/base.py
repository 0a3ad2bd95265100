"""GemPass and PassManager: how every gemcompile pass plugs into torch.compile.

A pass is a ``CustomGraphPass`` (Inductor's interface for cache-safe custom passes) that rewrites an
``fx.Graph`` in place at one stage:

- ``pre_grad``: the Dynamo graph (torch-level ops, ``meta["example_value"]``), run by GemBackend
  before AOTAutograd, so a custom op inserted there gets its own autograd formula;
- ``joint``: AOTAutograd's joint forward+backward graph (``joint_custom_pre_pass``);
- ``post_grad``: each of the forward and backward graphs (``post_grad_custom_pre_pass``).

Its ``uuid()`` covers its source files, its config section and the versions of gemcompile, torch and
triton, so Inductor's FX graph cache stays correct (any change misses) and warm (no change hits).
Inductor holds one object per slot: a ``PassManager`` per stage runs gemcompile's passes in order,
after the pass the user had installed in that slot, if any.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from gemcompile.config import GemConfig
from gemcompile.passes.checkpointed_regions import run_in_checkpointed_regions
from gemcompile.passes.graph import drop_dead_tensors, mark_buffer_values, positional_arguments
from gemcompile.passes.records import Refusal, Rewrite, active_log, describe_nodes, source_location
from gemcompile.version import versions

log = logging.getLogger(__name__)

Stage = Literal["pre_grad", "joint", "post_grad"]
STAGES: tuple[Stage, ...] = ("pre_grad", "joint", "post_grad")


@functools.cache
@functools.lru_cache(maxsize=None)
def lowering_fingerprint() -> str:
    """sha256 of gemcompile's ops as compiled code calls them: every source file of gemcompile/lowering (fake
    impls, kernels) and the registered ``gemcompile::`` schemas. In every pass's and the partitioner's uuid,
    so Inductor's FX graph cache never hands back code compiled against another version of the ops (seen:
    'gdpa_bwd expected at most 21 arguments but received 23' after the schema gained two)."""
    import gemcompile.lowering as lowering

    h = hashlib.sha256()
    root = Path(lowering.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("gemcompile::"))
    for name in names:
        for schema in torch._C._jit_get_schemas_for_operator(name):
            h.update(str(schema).encode())
    return h.hexdigest()


def _source_hash(cls: type) -> str:
    """sha256 of the files that define a pass: its own module, every gemcompile base class's, and the
    modules it names in ``source_modules``."""
    files = sorted(
        {
            inspect.getsourcefile(k)
            for k in cls.__mro__
            if k.__module__.startswith("gemcompile") and inspect.getsourcefile(k)
        }
        | {inspect.getsourcefile(importlib.import_module(m)) for m in cls.source_modules}
        | {__file__}
    )
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()


class GemPass(CustomGraphPass):
    """Base class of gemcompile's passes. Subclasses set the class variables and implement ``run``."""

    name: ClassVar[str]
    """Short name, used in counters, explain and the pipeline table."""
    stage: ClassVar[Stage]
    """Where the pass runs (see the module docstring)."""
    config_section: ClassVar[str | None] = None
    """The GemConfig field holding this pass's knobs; its ``enabled`` flag turns the pass on and off."""
    source_modules: ClassVar[tuple[str, ...]] = ()
    """Modules besides the class hierarchy's whose source decides what the pass does (its uuid covers them)."""

    def __init__(self, config: GemConfig):
        self.config = config

    @property
    def options(self) -> Any:
        return None if self.config_section is None else self.config.section(self.config_section)

    @property
    def enabled(self) -> bool:
        return getattr(self.options, "enabled", True)

    @property
    def parts(self) -> tuple[GemPass, ...]:
        """The passes explain lists for this one (a row, a count each): itself, or the parts it dispatches to."""
        return (self,)

    @abstractmethod
    def run(self, graph: fx.Graph) -> None:
        """Rewrite ``graph`` in place, reporting each rewrite and refusal."""

    def __call__(self, graph: fx.Graph) -> None:
        if self.enabled:
            self.run(graph)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for part in (
            type(self).__qualname__,
            _source_hash(type(self)),
            "" if self.config_section is None else self.config.fingerprint(self.config_section),
            repr(sorted(versions().items())),
            lowering_fingerprint(),
        ):
            h.update(part.encode())
        return h.hexdigest()

    # -- reporting -----------------------------------------------------------------------------
    def rewrote(self, anchor: fx.Node, before: Iterable[fx.Node] | str, after: Iterable[fx.Node] | str,
                detail: str = "", metrics: dict | None = None) -> None:
        """Report one rewrite. Call with the matched nodes *before* erasing them (or their text)."""
        counters["gemcompile"][self.name] += 1
        target = active_log()
        if target is not None:
            target.rewrites.append(
                Rewrite(
                    pass_name=self.name,
                    stage=self.stage,
                    location=source_location(anchor),
                    before=before if isinstance(before, str) else describe_nodes(before),
                    after=after if isinstance(after, str) else describe_nodes(after),
                    detail=detail,
                    metrics=dict(metrics or {}),
                )
            )
        log.debug("%s rewrote %s", self.name, anchor)

    def refused(self, anchor: fx.Node, reason: str, metrics: dict | None = None) -> None:
        """Report a candidate the pass left alone, with the reason a user can act on."""
        counters["gemcompile"][f"{self.name}_refused"] += 1
        target = active_log()
        if target is not None:
            target.refusals.append(
                Refusal(self.name, self.stage, source_location(anchor), reason, describe_nodes([anchor]),
                        metrics=dict(metrics or {}))
            )
        log.debug("%s refused %s: %s", self.name, anchor, reason)


PASS_SECONDS: Counter[str] = Counter()
"""Wall seconds each pass ran in this process, by pass name (compile time: the e2e benchmark reports the
passes' share of it; the joint pattern pass's first run includes tracing its patterns)."""


class PassManager(CustomGraphPass):
    """Runs one stage's passes in pipeline order, after ``chained`` (the pass already in the slot)."""

    def __init__(self, stage: Stage, passes: Sequence[GemPass], chained: Any = None):
        self.stage = stage
        self.passes = [p for p in passes if p.stage == stage]
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        for p in self.passes:
            start = time.perf_counter()
            p(graph)
            if self.stage != "pre_grad":  # functional graphs: dead code is safe to drop (see graph.erase_dead)
                graph.eliminate_dead_code()
            PASS_SECONDS[p.name] += time.perf_counter() - start
        graph.lint()

    def uuid(self) -> str | None:
        chained_uuid = None
        if self.chained is not None:
            # A chained pass with no uuid makes the whole slot uncacheable: correct, if slower.
            chained_uuid = self.chained.uuid() if isinstance(self.chained, CustomGraphPass) else None
            if chained_uuid is None:
                return None
        h = hashlib.sha256(self.stage.encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        h.update(repr(chained_uuid).encode())
        return h.hexdigest()

    def __bool__(self) -> bool:
        return bool(self.passes) or self.chained is not None


def instantiate(pass_types: Iterable[type[GemPass]], config: GemConfig) -> list[GemPass]:
    return [t(config) for t in pass_types]


def run_pre_grad(gm: torch.fx.GraphModule, passes: Sequence[GemPass], example_inputs: Sequence = ()) -> None:
    """Run the pre-grad passes on a Dynamo GraphModule and regenerate its code. ``example_inputs`` (the
    backend's) lets the mask prover read registered buffers' values (graph.mark_buffer_values)."""
    manager = PassManager("pre_grad", passes)
    if manager:
        mark_buffer_values(gm.graph, example_inputs)
        positional_arguments(gm.graph)
        # Dynamo leaves values nobody reads (BertModel's pooler under a mean-pooling caller): they would
        # count as readers of padded rows; AOTAutograd drops them later anyway
        drop_dead_tensors(gm.graph)
        from gemcompile.passes.attention.in_place import functionalize_fresh_updates

        functionalize_fresh_updates(gm.graph)  # h.relu_(), s /= c: what every pass reads as the value it is
        manager(gm.graph)
        gm.recompile()
        in_regions = PassManager("pre_grad", [p for p in passes if p.name in _REGION_PASSES])
        if in_regions:
            run_in_checkpointed_regions(gm, in_regions)


_REGION_PASSES = ("attention", "relative_bias")
"""The pre-grad passes that also run inside activation-checkpointed regions (passes/checkpointed_regions.py):
they rewrite ops in place (the others change a graph's inputs or its whole-model layout)."""
