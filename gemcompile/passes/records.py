"""What passes report: each rewrite and each refusal, with where it came from in the user's source, and
what the partitioner saved for each backward (passes/activation_memory.py).

A pass calls ``GemPass.rewrote`` / ``GemPass.refused``; they land in the ``PassLog`` active for the
compile (a context variable, so nested or concurrent compiles keep separate logs) and in
``torch._dynamo.utils.counters["gemcompile"]``. ``explain`` renders a PassLog.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch.fx as fx


@dataclass(frozen=True)
class SourceLocation:
    """The user's line a graph node came from (the innermost frame of its stack trace outside gemcompile's
    own ops and runtime: a sparse table's lookup is the model's call of the table, not the op's wrapper)."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        short = self.file.rsplit("/", 1)[-1]
        return f"{short}:{self.line} in {self.function}"


_LIBRARY_FRAMES = re.compile(r"gemcompile/(lowering|runtime)/")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>[^\n]*)')


def source_location(node: fx.Node) -> SourceLocation | None:
    """Where the model's source made ``node``; a node a pass inserted has no trace of its own: the nearest
    node it is computed from that has one (a view the attention rewrite added reads the model's linear)."""
    trace = node.meta.get("stack_trace")
    frontier, seen = list(node.all_input_nodes), set()
    while not trace and frontier and len(seen) < 64:
        nearest = frontier.pop(0)
        if nearest not in seen:
            seen.add(nearest)
            trace = nearest.meta.get("stack_trace")
            frontier.extend(nearest.all_input_nodes)
    if not trace:
        return None
    frames = list(_FRAME.finditer(trace))
    if not frames:
        return None
    users = [f for f in frames if not _LIBRARY_FRAMES.search(f["file"])]
    last = (users or frames)[-1]
    return SourceLocation(last["file"], int(last["line"]), last["function"], last["code"].strip())


def input_path(node: fx.Node) -> tuple | None:
    """Where a graph input came from in the call, as keys: ``("seq_lengths", 0)`` for the placeholder Dynamo
    made of ``seq_lengths[0]``; None for anything else (read from the placeholder's Dynamo source, not its name)."""
    arg = node.meta.get("grapharg") if node.op == "placeholder" else None
    source = getattr(arg, "source", None)
    path: list = []
    while source is not None:
        if hasattr(source, "index") and hasattr(source, "base"):  # GetItemSource: x[i]
            path.insert(0, source.index)
            source = source.base
        elif hasattr(source, "local_name"):  # LocalSource: an argument of the compiled call
            return (source.local_name, *path)
        else:
            return None
    return None


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"self.{node.target}"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch._ops") or str(target).startswith(("aten.", "prims.", "gemcompile.")):
        return str(target)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch"):
        return f"torch.{name}" if not module.startswith("torch.nn.functional") else f"F.{name}"
    return name


def _arg_text(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg_text(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, slice):
        return f"{_arg_text(arg.start) if arg.start is not None else ''}:" + (
            f"{_arg_text(arg.stop)}" if arg.stop is not None else ""
        )
    return repr(arg)


def describe_node(node: fx.Node) -> str:
    """One node as a line of Python-like code: `name = target(args, key=value)`."""
    if node.op == "placeholder":
        return f"{node.name} = <input>"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    args = [_arg_text(a) for a in node.args] + [f"{k}={_arg_text(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_method" and args:
        return f"{node.name} = {args[0]}{_target_name(node)}({', '.join(args[1:])})"
    return f"{node.name} = {_target_name(node)}({', '.join(args)})"


def describe_nodes(nodes: Iterable[fx.Node]) -> str:
    """The nodes in graph order, one line each."""
    nodes = list(nodes)
    if not nodes:
        return ""
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return "\n".join(describe_node(n) for n in sorted(nodes, key=lambda n: order.get(n, 0)))


@dataclass(frozen=True)
class Rewrite:
    """One place a pass changed the graph."""

    pass_name: str
    stage: str
    location: SourceLocation | None
    before: str
    after: str
    detail: str = ""
    metrics: dict = field(default_factory=dict, compare=False, hash=False)
    """Numbers a pass reports with the rewrite (e.g. unpad's MACs per padding token), for tools."""


@dataclass(frozen=True)
class Refusal:
    """One place a pass looked at and left alone, and why."""

    pass_name: str
    stage: str
    location: SourceLocation | None
    reason: str
    code: str = ""
    metrics: dict = field(default_factory=dict, compare=False, hash=False)
    """Facts a pass reports with the refusal (e.g. mxfp8's GEMM role and sizes), for tools."""


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a forward graph hands to its backward (or handed by default, and recomputes now)."""

    name: str
    """The value's node name (the same in the joint, forward and backward graphs)."""
    op: str
    """What produced it: an op (``aten.mm``, ``gemcompile.jagged_attention_fwd[0]`` for an output of a
    tuple), or ``input`` / ``parameter`` for a graph input."""
    shape: str
    """Its shape as text; a symbolic size prints as its expression (``s0``, ``u0``)."""
    dtype: str
    nbytes: int
    """Bytes it keeps alive: its storage's size (a symbolic size at its hint, as the partitioner sizes it),
    counted once: a view of a storage an earlier row already holds adds 0 (``alias_of`` names that row)."""
    kind: str
    """"activation" (computed in the forward), "input" (a graph input other than a parameter, or a view of
    one: under the parallel plan, the previous unit's output) or "parameter" (parameters and buffers, or
    views of them: alive anyway, so never counted against the budget)."""
    status: str
    """"saved" (saved by default and under the budget), "recomputed" (saved by default, recomputed in
    the backward under the budget) or "saved instead" (saved only under the budget, in place of what
    is recomputed from it)."""
    where: str = ""
    """Where in the model it was produced: the user's source line when the node kept its stack trace, else
    the innermost module (``blocks.0.ffn.0 (Linear)``)."""
    alias_of: str = ""
    """The earlier saved tensor whose storage this one views (its bytes are counted there)."""
    fp8_of: str = ""
    """For a value saved in FP8 (GemConfig.memory.fp8_saved) and for its scales: the name of the value they
    encode; empty for every other tensor."""
    dtype_before: str = ""
    """The FP8 data's row: the dtype the value had before it was quantized (empty on other rows)."""
    nbytes_before: int = 0
    """The FP8 data's row: the bytes the value would keep in ``dtype_before`` (0 on other rows)."""


@dataclass(frozen=True)
class LiveValue:
    """One value alive at a graph's peak (passes/graph_liveness.py)."""

    name: str
    """The node that holds the buffer: a view's base; ``op[i]`` for an output of a tuple no getitem reads."""
    op: str
    """What produced it: an op, or for an input of the graph what it is (``saved``, ``tangent``)."""
    shape: str
    dtype: str
    nbytes: int
    """Its storage's bytes (a symbolic size at its hint, as in SavedTensor.nbytes)."""
    kind: str
    """"saved" (a graph input the forward left for the backward), "tangent" (an incoming gradient) or
    "produced" (computed in this graph)."""


@dataclass(frozen=True)
class PeakMemory:
    """The peak of a graph's own live bytes, walking its nodes in order: each value allocated by the node
    that produces it (views charged to their base), freed after its last use, the graph's outputs kept to
    the end. An estimate: Inductor may reuse or hold buffers differently, and what the graph does not own
    (parameters, their gradients, optimizer state) is not in it."""

    nbytes: int
    """Bytes alive at the peak: the inputs counted (see ``saved_bytes``, ``tangent_bytes``) and the values
    produced so far and not yet freed."""
    node: str
    """The node at which the peak is reached (its outputs allocated, its inputs not yet freed)."""
    op: str
    """That node's op."""
    saved_bytes: int = 0
    """Of ``nbytes``: the graph's inputs other than tangents (in a backward graph, the saved values; a
    forward graph's inputs, parameters and batch, are alive anyway and not counted)."""
    tangent_bytes: int = 0
    """Of ``nbytes``: incoming gradients (``tangents_*`` inputs)."""
    produced_bytes: int = 0
    """Of ``nbytes``: values computed in this graph."""
    top: tuple[LiveValue, ...] = ()
    """The largest values alive at the peak, the largest first."""


@dataclass(frozen=True)
class GraphMemory:
    """What one joint graph's partition saves for the backward."""

    graph: int
    """The joint graph's number, in the order the partitioner saw them (one per compiled graph)."""
    budget: float | None
    """The activation memory budget it ran under: GemConfig.memory.budget, or one set in torch's own config
    (None: no budget, i.e. 1.0)."""
    tensors: tuple[SavedTensor, ...]
    """Every tensor saved under the budget, and (when the default was measured) each saved by default
    and now recomputed."""
    default_bytes: int | None
    """Bytes the partitioner saves with no budget (activations and inputs, parameters excluded), when
    measured (explain measures it when a budget is set); None when not measured."""
    recomputed_ops: tuple[str, ...] = ()
    """Forward ops the backward graph recomputes (one entry per op, repeated for each recompute)."""
    kept: int = 0
    """Attention / plan nodes kept out of recomputation (MUST_SAVE) in this graph."""
    forward_peak: PeakMemory | None = None
    """The peak of the partitioned forward graph's own live bytes (its inputs not counted; what it saves
    kept to its end); None when not measured (measured by explain, not by a real compile)."""
    backward_peak: PeakMemory | None = None
    """The peak of the partitioned backward graph's live bytes, the saved values (parameters excluded) and
    tangents counted from its start; None when not measured."""
    default_forward_peak: PeakMemory | None = None
    """``forward_peak`` of the partition with no budget, when the default was measured (``default_bytes``)."""
    default_backward_peak: PeakMemory | None = None
    """``backward_peak`` of the partition with no budget, when the default was measured."""

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for the backward under the budget (activations and inputs, parameters excluded)."""
        return sum(t.nbytes for t in self.tensors if t.kind != "parameter" and t.status != "recomputed")

    @property
    def fp8_bytes(self) -> int:
        """Bytes of the values saved in FP8 and of their scales."""
        return sum(t.nbytes for t in self.tensors if t.fp8_of and t.status != "recomputed")

    @property
    def fp8_bytes_before(self) -> int:
        """Bytes the values saved in FP8 would keep in their own dtype."""
        return sum(t.nbytes_before for t in self.tensors if t.fp8_of and t.status != "recomputed")

    @property
    def parameter_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.kind == "parameter" and t.status != "recomputed")


@dataclass
class PassLog:
    """Everything the passes of one compile reported, in order."""

    rewrites: list[Rewrite] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    memory: list[GraphMemory] = field(default_factory=list)
    """What each joint graph's partition saved for the backward, in partition order."""

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rewrites:
            out[r.pass_name] = out.get(r.pass_name, 0) + 1
        return out


_ACTIVE_LOG: contextvars.ContextVar[PassLog | None] = contextvars.ContextVar("gemcompile_pass_log", default=None)


def active_log() -> PassLog | None:
    return _ACTIVE_LOG.get()


@contextlib.contextmanager
def recording(log: PassLog) -> Iterator[PassLog]:
    """Route the reports of passes run inside this block into ``log``."""
    token = _ACTIVE_LOG.set(log)
    try:
        yield log
    finally:
        _ACTIVE_LOG.reset(token)
