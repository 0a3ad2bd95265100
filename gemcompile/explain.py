"""explain: what gemcompile's passes would do to a model, without compiling kernels or training.

Dynamo captures the model on the example inputs; the pre-grad passes run on each captured graph; then
AOTAutograd (with Inductor's decompositions) builds the joint graph, where the joint passes run, and
the forward/backward graphs, where the post-grad passes run. No Inductor code generation: the graphs
execute as plain ATen, so explain is fast and runs anywhere. One forward runs; no backward, no update.
The joint graphs are partitioned by gemcompile's partitioner (passes/activation_memory.py) under
GemConfig.memory, and what each forward saves for its backward is reported (``report.memory``).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.markup import escape
from rich.text import Text

from gemcompile.backend import GemBackend
from gemcompile.config import GemConfig
from gemcompile.passes import PassManager
from gemcompile.passes.activation_memory import ActivationMemoryPartitioner, memory_tables
from gemcompile.passes.base import run_pre_grad
from gemcompile.passes.records import GraphMemory, PassLog, Refusal, Rewrite, recording


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A snapshot of gm's graph (nodes copied, meta shared shallowly), safe from later rewrites."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


@dataclass
class ExplainReport:
    """What the passes matched, rewrote or refused, and the graphs before and after."""

    counts: dict[str, int]
    """Pass name -> number of rewrites (every pass of the pipeline is listed, 0 when it matched nothing)."""
    rewrites: list[Rewrite]
    """Each rewrite: pass, source location, the nodes before and after."""
    refusals: list[Refusal]
    """Each candidate a pass left alone, with the reason."""
    graph_before: fx.GraphModule | None
    """The (first) Dynamo graph as captured."""
    graph_after: fx.GraphModule | None
    """The same graph after the pre-grad passes."""
    graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = field(default_factory=list)
    """(before, after) for every Dynamo graph (more than one means graph breaks)."""
    aot_graphs: list[tuple[str, fx.GraphModule]] = field(default_factory=list)
    """("forward" | "backward" | "inference", graph) after the joint and post-grad passes."""
    passes: list[tuple[str, str, bool]] = field(default_factory=list)
    """(name, stage, enabled) for each pass of the pipeline."""
    memory: list[GraphMemory] = field(default_factory=list)
    """What each joint graph's forward saves for its backward under GemConfig.memory (shape, dtype, bytes,
    producer; with a budget, also what the budget recomputes and the bytes saved with no budget), and the
    peak live bytes of each partitioned forward and backward graph (GraphMemory.backward_peak)."""
    graph_breaks: list[tuple[str, int]] = field(default_factory=list)
    """(the first line of Dynamo's reason, how many times) for each graph break of the capture: code after a
    break runs in another graph, or eagerly when Dynamo skips the frame, and no pass sees across it."""

    stopped: str | None = None
    """The message of a device-side check of the rewritten graph that stopped the example run (a compiled run
    would stop there too: e.g. an empty sequence under a fill eager rounds differently); the capture ends there."""

    def __rich_console__(self, console, options):
        n_graphs = len(self.graphs)
        yield Text(
            f"gemcompile explain: {n_graphs} graph{'s' if n_graphs != 1 else ''} captured"
            + (f" ({n_graphs - 1} graph break{'s' if n_graphs > 2 else ''})" if n_graphs > 1 else "")
            + f", {len(self.rewrites)} rewrite{'s' if len(self.rewrites) != 1 else ''}, "
            f"{len(self.refusals)} refusal{'s' if len(self.refusals) != 1 else ''}",
            style="bold",
        )
        summary = Table(title="passes", title_justify="left")
        for col, justify in (("pass", "left"), ("stage", "left"), ("enabled", "center"),
                             ("rewrites", "right"), ("refused", "right")):
            summary.add_column(col, justify=justify)
        for name, stage, enabled in self.passes:
            refused = sum(1 for r in self.refusals if r.pass_name == name)
            summary.add_row(escape(name), stage, "yes" if enabled else "no", str(self.counts.get(name, 0)), str(refused))
        if not self.passes:
            summary.add_row("(no passes in the pipeline)", "", "", "", "")
        yield summary
        if self.stopped:
            yield Text(f"the example run stopped at a check of the rewritten graph: {self.stopped}", style="bold red")
        if self.graph_breaks:
            breaks = Table(title="graph breaks (TORCH_LOGS=graph_breaks shows where)", title_justify="left")
            breaks.add_column("Dynamo's reason")
            breaks.add_column("times", justify="right")
            for reason, n in self.graph_breaks:
                breaks.add_row(escape(reason), str(n))
            yield breaks
        if not self.graphs:
            yield Text("Dynamo captured no graph, so no pass ran: the call ran no tensor operation Dynamo traces "
                       "(or Dynamo skipped it; TORCH_LOGS=graph_breaks,recompiles says why)")
        plan = self.parallel_plan  # the sharding pass's plan: a table, not one panel per parameter
        if plan is not None:
            from gemcompile.passes.sharding import plan_tables

            yield from plan_tables(plan)
        # the same source line rewritten the same way (a layer repeated L times) renders once, counted
        groups: dict[tuple, list[Rewrite]] = {}
        for r in self.rewrites:
            if r.pass_name == "sharding" and plan is not None:
                continue
            groups.setdefault((r.pass_name, r.stage, r.location, r.detail.split(":")[0]), []).append(r)
        for i, rewrites in enumerate(groups.values(), 1):
            r = rewrites[0]
            where = str(r.location) if r.location else "unknown location"
            times = f" (x{len(rewrites)})" if len(rewrites) > 1 else ""
            parts: list[Any] = []
            if r.location and r.location.code:
                parts.append(Text(f"source: {r.location.code}", style="dim"))
            for detail in dict.fromkeys(x.detail for x in rewrites if x.detail):
                parts.append(Text(detail))
            parts += [Text("before", style="bold red"), Syntax(r.before or "(nothing)", "python", word_wrap=True),
                      Text("after", style="bold green"), Syntax(r.after or "(nothing)", "python", word_wrap=True)]
            yield Panel(Group(*parts), title=escape(f"{r.pass_name} #{i}{times} [{r.stage}] at {where}"),
                        title_align="left")
        if self.refusals:
            table = Table(title="left alone", title_justify="left")
            table.add_column("pass")
            table.add_column("location")
            table.add_column("reason")
            seen: dict[tuple, int] = {}
            for r in self.refusals:
                key = (r.pass_name, str(r.location) if r.location else "?", r.reason)
                seen[key] = seen.get(key, 0) + 1
            for (name, where, reason), n in seen.items():
                table.add_row(escape(name), escape(where + (f" (x{n})" if n > 1 else "")), escape(reason))
            yield table
        yield from memory_tables(self.memory)

    @property
    def parallel_plan(self) -> Any:
        """The ParallelPlan the sharding pass computed (GemConfig.parallel.enabled), else None."""
        from gemcompile.passes.sharding import plan_of

        return next((p for _, after in self.graphs if (p := plan_of(after)) is not None), None)

    def render(self, width: int = 120, color: bool = False) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, force_terminal=color, color_system="standard" if color else None)
        console.print(self)
        return buffer.getvalue()

    def __str__(self) -> str:
        return self.render()


class _ExplainBackend:
    """Captures each Dynamo graph, runs every stage's passes, executes without Inductor codegen."""

    def __init__(self, config: GemConfig, pass_types=None):
        self.gem = GemBackend(config, passes=pass_types)
        self.partitioner = ActivationMemoryPartitioner(config, measure_default=True)
        self.graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []
        self.aot_graphs: list[tuple[str, fx.GraphModule]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        passes = self.gem.make_passes()
        before = _copy_graph_module(gm)
        run_pre_grad(gm, passes, example_inputs)
        self.graphs.append((before, gm))
        joint = PassManager("joint", passes)
        post = PassManager("post_grad", passes)

        def partition(joint_gm, joint_inputs, **kwargs):
            joint(joint_gm.graph)
            joint_gm.recompile()
            return self.partitioner(joint_gm, joint_inputs, **kwargs)

        def compiler(kind):
            def compile_graph(graph_gm, inputs):
                if kind == "inference":  # no partitioner runs for inference graphs; Inductor runs joint passes here
                    joint(graph_gm.graph)
                post(graph_gm.graph)
                graph_gm.recompile()
                self.aot_graphs.append((kind, graph_gm))
                return make_boxed_func(graph_gm)

            return compile_graph

        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )(gm, example_inputs)


def _eager_backward_compile():
    """AOTAutograd compiles the backward graph lazily, at the first backward; explain runs none, so ask
    for it up front (the flag exists in recent torch; without it explain shows forward graphs only)."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def _first_capture():
    """explain reports what a first compile of the model does. Dynamo keeps its cache and its record of seen
    values per code object, across torch.compile calls: the ninth explain of one class hit the recompile
    limit and fell back to eager (an empty report), and an attribute whose value differed from an earlier
    call's became a graph input (automatic dynamic) that no first compile would have. So explain captures
    with static recompiles and room past the limit."""
    import torch._dynamo.config as dynamo_config

    settings = {"automatic_dynamic_shapes": False}
    for name in ("recompile_limit", "cache_size_limit"):  # the limit's name in torch >= 2.6, and before
        if hasattr(dynamo_config, name):
            settings[name] = max(getattr(dynamo_config, name), 1 << 16)
            break
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            settings[name] = max(getattr(dynamo_config, name), 1 << 16)
            break
    return dynamo_config.patch(**settings)


def explain(model_or_fn: Any, *example_inputs: Any, config: GemConfig | None = None, **example_kwargs: Any
            ) -> ExplainReport:
    """Capture ``model_or_fn`` on the example inputs and report what gemcompile's passes do to it."""
    return explain_with_passes(None, model_or_fn, *example_inputs, config=config, **example_kwargs)


def explain_with_passes(pass_types: Sequence[type] | None, model_or_fn: Any, *example_inputs: Any,
                        config: GemConfig | None = None, **example_kwargs: Any) -> ExplainReport:
    """explain with a pass list other than the default pipeline (tests and experiments)."""
    if not callable(model_or_fn):
        raise TypeError(f"explain expects an nn.Module or a callable, got {type(model_or_fn).__name__}")
    if config is not None and not isinstance(config, GemConfig):
        raise TypeError(f"explain: config must be a gemcompile.GemConfig, got {type(config).__name__}")
    backend = _ExplainBackend(config if config is not None else GemConfig(), pass_types)
    log = PassLog()
    compiled = torch.compile(model_or_fn, backend=backend)
    # Dynamo counts each break under its message; a frame it gave up on ("Skipping the function and falling
    # back to eager") goes to "unimplemented" instead
    kinds = ("graph_break", "unimplemented")
    before = {kind: dict(counters[kind]) for kind in kinds}
    stopped = None
    with recording(log), _eager_backward_compile(), _first_capture():
        try:
            compiled(*example_inputs, **example_kwargs)
        except RuntimeError as error:  # a device-side check our rewrite emitted: reported, not raised
            lines = [line for line in str(error).splitlines() if "gemcompile: " in line]
            if not lines:
                raise
            stopped = lines[0][lines[0].index("gemcompile: ") + len("gemcompile: "):]
    graph_breaks: dict[str, int] = {}
    for kind in kinds:  # (a break both count is counted once)
        seen: dict[str, int] = {}
        for reason, n in counters[kind].items():
            if n > before[kind].get(reason, 0):
                first_line = str(reason).strip().splitlines()[0] if str(reason).strip() else "(no reason given)"
                seen[first_line] = seen.get(first_line, 0) + n - before[kind].get(reason, 0)
        graph_breaks.update({line: max(n, graph_breaks.get(line, 0)) for line, n in seen.items()})
    passes = [part for p in backend.gem.make_passes() for part in p.parts]
    counts = {p.name: 0 for p in passes}
    counts.update(log.counts())
    first = backend.graphs[0] if backend.graphs else (None, None)
    return ExplainReport(
        counts=counts,
        rewrites=log.rewrites,
        refusals=log.refusals,
        graph_before=first[0],
        graph_after=first[1],
        graphs=backend.graphs,
        aot_graphs=backend.aot_graphs,
        passes=[(p.name, p.stage, p.enabled) for p in passes],
        memory=log.memory,
        graph_breaks=list(graph_breaks.items()),
        stopped=stopped,
    )
