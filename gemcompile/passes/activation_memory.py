"""Activation memory: what each joint graph's forward saves for its backward (GemConfig.memory).

Inductor's min-cut partitioner (``min_cut_rematerialization_partition``, torch/_functorch/partitioners.py)
splits every joint graph into a forward and a backward graph and decides which forward values the backward
reads (saved: alive from the forward to the backward) and which it recomputes. gemcompile does not write
a partitioner of its own; it steers torch's, for its own compiles only:

* **The budget.** ``torch._functorch.config.activation_memory_budget`` (in torch since 2.4; what follows
  is read from 2.13's ``choose_saved_values_set``): at 1.0 the partitioner saves its runtime-optimal set;
  below it relaxes its bans on recomputation, then solves a 0-1 knapsack over the banned nodes, each
  weighed by its bytes and its FLOPs (``activation_memory_budget_runtime_estimator = "flops"``), so
  pointwise ops, norms, gathers and RoPE are recomputed long before a GEMM. torch measures the budget
  between "save only the graph's inputs" (0, parameters counted) and its default (1); a graph whose inputs
  outweigh its default saved set is left alone. ``budget_patch`` patches the knob (``functorch_config.
  patch``, restored on exit) around GemBackend's ``compile_fx`` call, where AOTAutograd's cache key (which
  hashes functorch's config) sees it, and again around each partition this module runs.
* **Attention kept.** Below 1.0 the partitioner's aggressive rounds drop their allowlist, and an opaque
  custom op is then as recomputable as a pointwise one: on torch 2.13 a budget of 0.1 moved
  ``gemcompile::jagged_attention_fwd`` (and ``length_order``) into the backward graph of a two-layer toy
  model. ``keep_attention`` tags the forward of gemcompile's attention kernels, the per-step plans they
  share and every data-dependent size (unpad's token index) ``CheckpointPolicy.MUST_SAVE`` in the joint
  graph, the tag torch's own ``force_save_collectives`` uses: ``should_ban_recomputation`` refuses the
  node ("marked MUST_SAVE") and the knapsack leaves it out of its candidates (a budget of exactly 0 would
  skip both and recompute everything: MemoryConfig refuses 0). A node already tagged (a region the user
  wrapped in torch.utils.checkpoint) keeps the user's tag; ``MemoryConfig.recompute_attention`` hands the
  attention ops back to the partitioner.
* **FP8 saved activations.** ``MemoryConfig.fp8_saved`` rewrites the joint graph before partitioning
  (passes/fp8_saved.py): the weight gradient of a chosen Linear reads an FP8 copy of its input, which the
  partitioner then saves instead of the input. After the partition (``_partition_fp8``) each copy is
  settled: saved; moved across the partition where min-cut's weights tie (the two graphs edited to hand
  over the FP8 copy); or undone and the graph partitioned again where the backward keeps x, or what x is
  recomputed from, at full precision anyway, so dW reads FP8 values only where they save memory.
* **The record.** What the partition saved, read from its output (the backward graph's inputs other than
  tangents are exactly the saved values; their producers are found by name in the forward graph): one
  ``GraphMemory`` per joint graph in the active PassLog, rendered by ``explain`` (``memory_tables``).
  explain also partitions once more without the budget (``measure_default``) to mark what the budget
  recomputes; a real compile does not pay for that second partition. The saved bytes are not the peak: in
  explain the record also holds each graph's peak live bytes (``graph_peaks``, passes/graph_liveness.py: the nodes
  walked in order, each value freed after its last use; the backward counts the saved values and tangents
  from its start), for the default partition too when measured, and explain prints the backward's peak,
  where it is reached, what is alive there (saved, tangents, produced in the backward) and its largest
  values (``peak_line``, ``peak_table``). An estimate of the graphs' own liveness: Inductor may reuse or
  hold buffers differently; parameters, their gradients and optimizer state are not in it.

Where it plugs in: Inductor's ``custom_partitioner_fn`` slot (added mid-2025; feature-detected), a
``CustomPartitionerFn`` whose uuid covers this file, fp8_saved.py, the memory section and the versions,
installed by GemBackend through ``compile_fx(config_patches=...)`` for its compile only, chaining a
partitioner the user installed there. A torch without the slot still gets the budget (the patch around
compile_fx), but neither the attention tags, the FP8 copies nor the record (a warning says so when a budget
or fp8_saved is set). explain runs the same
partitioner in its own AOTAutograd call (without Inductor's own joint-graph pattern passes, which can
change a few nodes before Inductor partitions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import operator
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from gemcompile.config import GemConfig
from gemcompile.passes import fp8_saved
from gemcompile.passes.base import lowering_fingerprint
from gemcompile.passes.graph_liveness import peak_liveness
from gemcompile.passes.graph_liveness import size_hint as _hint
from gemcompile.passes.graph_liveness import storage_bytes as _storage_bytes
from gemcompile.passes.graph_liveness import storage_key as _storage
from gemcompile.passes.graph_liveness import token_hinted
from gemcompile.passes.records import GraphMemory, PeakMemory, SavedTensor, active_log, source_location
from gemcompile.version import versions

try:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as _PartitionerBase
except ImportError:  # a torch without Inductor's custom_partitioner_fn slot
    _PartitionerBase = object  # type: ignore[assignment, misc]

ATTENTION_OPS = ("jagged_attention_fwd", "jagged_attention_lse", "gdpa_fwd", "block_attention_fwd", "length_order",
                 "key_bounds")
"""gemcompile ops (``gemcompile::<name>``) never recomputed unless MemoryConfig.recompute_attention: the
attention kernels' forward (a whole kernel to recompute an output the size of q, plus its log-sum-exp) and
the per-step batch order and key bounds every attention site shares (passes/attention/plans.py: derived
once per step, by design)."""

DATA_DEPENDENT_OPS = ("valid_token_index", "valid_mask_index")
"""gemcompile ops never recomputed at all: unpad's token index (by lengths or by a token vector), whose
length T is data-dependent (recomputing it is a second device-to-host sync; a budget of 0.3 on GEM-ref tiny
moved it into the backward). Any other node that binds an unbacked size (``meta["unbacked_bindings"]``:
nonzero, item) is kept for the same reason."""

KEPT_OPS = ATTENTION_OPS + DATA_DEPENDENT_OPS

STATUSES = ("saved", "saved instead", "recomputed")


def has_partitioner_slot() -> bool:
    """True when this torch's Inductor takes a custom partitioner (``custom_partitioner_fn``)."""
    import torch._inductor.config as inductor_config

    return _PartitionerBase is not object and hasattr(inductor_config, "custom_partitioner_fn")


def budget_patch(budget: float | None) -> contextlib.AbstractContextManager:
    """``torch._functorch.config.activation_memory_budget = budget`` inside the block, restored after;
    nothing when the budget is None (the partitioner's own setting stays)."""
    import torch._functorch.config as functorch_config

    if budget is None:
        return contextlib.nullcontext()
    if not hasattr(functorch_config, "activation_memory_budget"):
        warnings.warn("GemConfig.memory.budget is ignored: this torch's partitioner has no "
                      "activation_memory_budget (torch >= 2.4 has)", stacklevel=3)
        return contextlib.nullcontext()
    return functorch_config.patch(activation_memory_budget=budget)


def _token_hinted_nbytes(val: Any) -> int | None:
    """Bytes of a node's value with unpad's packed-token counts at their hint (graph_liveness.token_hinted);
    None when no size in it is such a count (the partitioner's own sizing then stands)."""
    if isinstance(val, (list, tuple)):
        sizes = [_token_hinted_nbytes(v) for v in val]
        if all(s is None for s in sizes):
            return None
        # the other entries at the partitioner's own hint, as it sizes them
        plain = [_hint(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0 for v in val]
        return sum(p if s is None else s for s, p in zip(sizes, plain))
    if not isinstance(val, torch.Tensor):
        return None
    numel = token_hinted(val.numel())
    return None if numel is None else numel * val.element_size()


@contextlib.contextmanager
def token_sized_partition() -> Any:
    """The partitioner sizes tensors whose size is a packed-token count at unpad's hint, inside the block.

    torch 2.11's ``_size_of`` takes a tensor of unbacked size (unpad's (T, ...) rows) as 4096 elements (its
    fallback; 2.13 reads the hint unpad sets). Under a budget the packed activations, most of a padded
    sequence model's, then look free to keep, and only the padded ones are ever recomputed: on the H200
    (torch 2.11) no budget moved GEM-ref medium's peak by more than 3%. Patched at the module attribute the
    partitioner's own functions read, restored on exit."""
    from torch._functorch import partitioners

    original = getattr(partitioners, "_size_of", None)
    if original is None:  # another torch's layout: its sizing stands
        yield
        return

    def size_of(node: fx.Node) -> int:
        nbytes = _token_hinted_nbytes(node.meta.get("val"))
        return original(node) if nbytes is None else nbytes

    partitioners._size_of = size_of
    try:
        yield
    finally:
        partitioners._size_of = original


def current_budget() -> float | None:
    """The activation memory budget the partitioner would use now; None when it is 1.0 (no budget)."""
    import torch._functorch.config as functorch_config

    budget = getattr(functorch_config, "activation_memory_budget", 1.0)
    return None if budget >= 1.0 else float(budget)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        return name[: -len(".default")] if name.endswith(".default") else name
    return getattr(target, "__name__", None) or str(target)


def _is_gemcompile_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "gemcompile"


def _is_kept_op(node: fx.Node, attention: bool) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if node.meta.get("unbacked_bindings"):  # a data-dependent size: recomputing it syncs with the host again
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    # a random draw a gemcompile op reads (attention dropout's seed): recomputed, it would draw another seed
    # for the backward than the forward used (torch's partitioner bans only its own list of random ops when
    # a budget relaxes the allowlist, and aten.randint is not on it)
    if torch.Tag.nondeterministic_seeded in target.tags and any(_is_gemcompile_op(u) for u in node.users):
        return True
    namespace, _, name = target.name().partition("::")
    return namespace == "gemcompile" and (name in DATA_DEPENDENT_OPS
                                          or (attention and name in ATTENTION_OPS))


def keep_attention(graph: fx.Graph, attention: bool = True) -> int:
    """Tag data-dependent sizes, random draws a gemcompile op reads (the dropout seed) and (``attention``)
    gemcompile's attention forwards and plans MUST_SAVE: never recomputed. A node that already has a
    recompute policy (the user's checkpoint) keeps it. Returns the number of nodes tagged."""
    from torch.utils.checkpoint import CheckpointPolicy

    tagged = 0
    for node in graph.nodes:
        if _is_kept_op(node, attention) and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged += 1
    return tagged


# -- what a partition saved -----------------------------------------------------------------------------


class JointInfo:
    """What the joint graph tells about its values before partitioning: which inputs are parameters and
    which storages belong to inputs (so that a saved view of a parameter counts as the parameter), and which
    nodes belong to the forward (so that a backward node of the same name is a recompute)."""

    def __init__(self, graph: fx.Graph, static_input_indices: Iterable[int] | None):
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        primals = [n for n in placeholders if "tangents" not in str(n.target)
                   and not any(k in str(n.target) for k in ("fwd_seed", "fwd_base_offset", "bwd_seed",
                                                              "bwd_base_offset"))]
        static = set(static_input_indices or ())
        self.input_kinds = {n.name: "parameter" if i in static else "input" for i, n in enumerate(primals)}
        self.storage_kinds = {key: self.input_kinds[n.name] for n in primals
                              if (key := _storage(n.meta.get("val"))) is not None}
        backward: set[fx.Node] = {n for n in placeholders if "tangents" in str(n.target)}
        for node in graph.nodes:
            if node not in backward and any(a in backward for a in node.all_input_nodes):
                backward.add(node)
        self.forward_names = {n.name for n in graph.nodes if n.op == "call_function" and n not in backward}


def _module(node: fx.Node) -> str:
    from gemcompile.passes.mxfp8 import node_modules

    modules = node_modules(node, backward="nn_module_stack" not in node.meta)
    return f"{modules[-1][0]} ({modules[-1][1]})" if modules else ""


def _where(node: fx.Node) -> str:
    """The user's line of a node, else its innermost module; a node a pass emitted without either (an
    attention op) is placed by the module of its nearest input that has one."""
    location = source_location(node)
    if location is not None:
        return str(location)
    seen, frontier = {node}, [node]
    for _ in range(8):
        for n in frontier:
            if module := _module(n):
                return module
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen and not seen.add(a)]
    return ""


_VIEWS = {"aten.alias", "aten.view", "aten._unsafe_view", "aten.reshape", "aten.permute", "aten.t",
          "aten.transpose.int", "aten.select.int", "aten.slice.Tensor", "aten.expand", "aten.unsqueeze",
          "aten.squeeze.dim", "aten.squeeze.dims", "aten.as_strided"}
_NOT_SAVED = ("tangents", "seed", "base_offset")  # backward inputs that are not forward values


def _op_text(node: fx.Node, depth: int = 0) -> str:
    """What produced a node: its op; a getitem as ``op[i]``; a view as ``view of <what it views>``."""
    if node.op == "placeholder":
        return "input"
    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return f"{_op_name(node.args[0].target)}[{node.args[1]}]"
    name = _op_name(node.target)
    if name in _VIEWS and depth < 6 and node.args and isinstance(node.args[0], fx.Node):
        base = _op_text(node.args[0], depth + 1)
        return base if depth else f"{name} of {base.split(' of ')[-1]}"
    return name


def _producer(node: fx.Node, storage: Any, info: JointInfo) -> tuple[str, str]:
    """(op text, kind) of a forward-graph node that is saved."""
    if node.op == "placeholder":
        kind = info.input_kinds.get(node.name, "input")
        return kind, kind
    return _op_text(node), info.storage_kinds.get(storage, "activation")


def saved_tensors(fw: fx.GraphModule, bw: fx.GraphModule, info: JointInfo) -> dict[str, dict]:
    """name -> fields of a SavedTensor (no status) for every tensor ``fw`` hands to ``bw``, each storage
    counted once (at the first tensor that holds it)."""
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    holders: dict[Any, str] = {}
    out: dict[str, dict] = {}
    for node in bw.graph.nodes:
        if node.op != "placeholder" or any(k in str(node.target) for k in _NOT_SAVED):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):  # saved SymInts, opaque objects, backward state
            continue
        source = fw_nodes.get(node.name, node)
        storage = _storage(val)
        op, kind = _producer(source, storage, info)
        alias_of = holders.get(storage, "") if storage is not None else ""
        if storage is not None and not alias_of:
            holders[storage] = node.name
        out[node.name] = dict(
            name=node.name, op=op, kind=kind, dtype=str(val.dtype).removeprefix("torch."),
            shape="(" + ", ".join(str(s) for s in val.shape) + ("," if val.dim() == 1 else "") + ")",
            nbytes=0 if alias_of else _storage_bytes(val), where=_where(source), alias_of=alias_of,
        )
        if tag := source.meta.get(fp8_saved.TAG):  # an FP8 copy (or its scales) of a value: name the value
            of = fw_nodes.get(tag["of"])
            data = tag["role"] == "data"
            out[node.name].update(
                op=f"{'fp8' if data else 'fp8 scales'} of {_op_text(of) if of is not None else tag['of']}",
                where=_where(of) if of is not None else out[node.name]["where"], fp8_of=tag["of"],
                dtype_before=tag["dtype"] if data else "", nbytes_before=tag["nbytes"] if data else 0)
    return out


def graph_peaks(fw: fx.GraphModule, bw: fx.GraphModule, saved: dict[str, dict]
                ) -> tuple[PeakMemory, PeakMemory]:
    """(forward, backward) peaks of a partition's own live bytes (graph_liveness.py): the forward's inputs
    not counted, the backward's saved values (parameters excluded, as in the saved-tensor table) and tangents
    counted; a saved value's producer named as in that table."""
    forward = peak_liveness(fw.graph)
    counted = {n.name for n in bw.graph.nodes if n.op == "placeholder"
               and (n.name not in saved or saved[n.name]["kind"] != "parameter")}
    backward = peak_liveness(bw.graph, counted_inputs=counted)
    top = tuple(dataclasses.replace(v, op=saved[v.name]["op"]) if v.kind == "saved" and v.name in saved else v
                for v in backward.top)
    return forward, dataclasses.replace(backward, top=top)


def graph_memory(index: int, budget: float | None, saved: dict[str, dict], default: dict[str, dict] | None,
                 bw: fx.GraphModule, info: JointInfo, kept: int, peaks: tuple | None = None,
                 default_peaks: tuple | None = None) -> GraphMemory:
    """The record of one partition: ``saved`` under the budget, ``default`` without it (None: not
    measured); ``peaks`` / ``default_peaks``: (forward, backward) PeakMemory of each (graph_peaks)."""
    tensors = []
    for name, fields in saved.items():
        status = "saved" if default is None or name in default else "saved instead"
        tensors.append(SavedTensor(**fields, status=status))
    for name, fields in (default or {}).items():
        if name not in saved:
            tensors.append(SavedTensor(**fields, status="recomputed"))
    default_bytes = None if default is None else sum(
        f["nbytes"] for f in default.values() if f["kind"] != "parameter")
    recomputed = tuple(_op_name(n.target) for n in bw.graph.nodes
                       if n.op == "call_function" and n.name in info.forward_names
                       and n.target is not operator.getitem)
    forward_peak, backward_peak = peaks or (None, None)
    default_forward_peak, default_backward_peak = default_peaks or (None, None)
    return GraphMemory(graph=index, budget=budget, tensors=tuple(tensors), default_bytes=default_bytes,
                       recomputed_ops=recomputed, kept=kept, forward_peak=forward_peak,
                       backward_peak=backward_peak, default_forward_peak=default_forward_peak,
                       default_backward_peak=default_backward_peak)


# -- the partitioner ------------------------------------------------------------------------------------


class ActivationMemoryPartitioner(_PartitionerBase):  # type: ignore[misc, valid-type]
    """Inductor's min-cut partitioner under GemConfig.memory, recording what it saves (module docstring).

    ``chained``: a partitioner the user had installed in Inductor's slot, run instead of the min-cut one
    (under the same budget and tags). ``measure_default``: also partition without the budget, to mark what
    the budget recomputes (explain; a second partition per graph)."""

    def __init__(self, config: GemConfig, *, chained: Callable[..., Any] | None = None,
                 measure_default: bool = False):
        self.config = config
        self.options = config.memory
        self.chained = chained
        self.measure_default = measure_default

    def _partition(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict) -> tuple[Any, Any]:
        if self.chained is not None:
            return self.chained(gm, joint_inputs, **kwargs)
        from functorch.compile import min_cut_rematerialization_partition

        with token_sized_partition():
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def _partition_fp8(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict, sites: list
                       ) -> tuple[Any, Any, list]:
        """Partition, then settle each FP8 site (fp8_saved.settle): saved, moved across the partition, or
        undone (its readers get x back) with the graph partitioned once more, so that dW reads FP8 values only
        where they are saved. Returns the sites undone."""
        undone: list = []
        for attempt in range(2):
            fw, bw = self._partition(gm, joint_inputs, dict(kwargs))
            verdicts = {site: fp8_saved.settle(site, fw, bw, kwargs.get("num_fwd_outputs")) for site in sites}
            for site, (kind, detail) in verdicts.items():
                site.saved, site.reason = kind != "undo", detail if kind == "undo" else ""
            bad = [site for site, (kind, _) in verdicts.items() if kind == "undo"]
            if not bad or attempt == 1:  # one that turns bad in the second partition stays: reported unsaved
                break
            fp8_saved.undo(gm, bad)
            undone += bad
            sites = [site for site in sites if site not in bad]
        moving = [(site, plan) for site, (kind, plan) in verdicts.items() if kind == "move"]
        try:
            for site, plan in moving:
                fp8_saved.move(plan, fw, bw)
                site.moved = plan[0]
        except Exception as e:  # noqa: BLE001 - a layout settle did not foresee: partition without them
            warnings.warn(f"GemConfig.memory.fp8_saved: could not edit the partitioned graphs ({e}); the FP8 "
                          "copies the partitioner did not save itself are dropped", stacklevel=2)
            for site, _ in moving:
                site.saved, site.moved, site.reason = False, "", f"editing the partitioned graphs failed: {e}"
            fp8_saved.undo(gm, [site for site, _ in moving])
            undone += [site for site, _ in moving]
            fw, bw = self._partition(gm, joint_inputs, dict(kwargs))
        return fw, bw, undone

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        kept = keep_attention(gm.graph, attention=not self.options.recompute_attention)
        info = JointInfo(gm.graph, kwargs.get("static_lifetime_input_indices"))
        sites, refused = [], []
        if self.options.fp8_saved:  # before the partition, which then saves the FP8 copies (fp8_saved.py)
            parameters = {name for name, kind in info.input_kinds.items() if kind == "parameter"}
            sites, refused = fp8_saved.plan(gm.graph, self.options.fp8_saved, parameters)
            if sites:
                sites, failed = fp8_saved.rewrite(gm.graph, sites)
                refused += failed
                gm.recompile()
        log = active_log()
        if log is None:  # nobody to report to: partition only
            with budget_patch(self.options.budget):
                return self._partition_fp8(gm, joint_inputs, kwargs, sites)[:2]
        with budget_patch(self.options.budget):
            budget = current_budget()  # ours, or one the user set in torch's config
        default = default_peaks = None
        if self.measure_default and budget is not None:
            # the partitioner's default on the same joint graph; it only dead-codes, CSEs (names kept) and
            # tags the graph it is given, so the partition under the budget below sees the same nodes
            with budget_patch(1.0):
                fw0, bw0 = self._partition(gm, joint_inputs, dict(kwargs))
            default = saved_tensors(fw0, bw0, info)
            default_peaks = graph_peaks(fw0, bw0, default)
        with budget_patch(self.options.budget):
            fw, bw, undone = self._partition_fp8(gm, joint_inputs, kwargs, sites)
        saved = saved_tensors(fw, bw, info)
        # the liveness walk is for explain's report: a real compile does not pay for it either
        peaks = graph_peaks(fw, bw, saved) if self.measure_default else None
        if self.options.fp8_saved:
            fp8_saved.report(sites, undone, refused, log)
        if default is None and self.measure_default:
            default, default_peaks = saved, peaks  # no budget: the default is what was just saved
        log.memory.append(graph_memory(len(log.memory), budget, saved, default, bw, info, kept, peaks,
                                       default_peaks))
        return fw, bw

    def uuid(self) -> Any:
        chained_uuid = None
        if self.chained is not None:
            chained_uuid = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            if chained_uuid is None:
                return None  # a chained partitioner without a uuid: uncacheable, as Inductor would have it
        h = hashlib.sha256(Path(inspect.getsourcefile(type(self)) or __file__).read_bytes())
        h.update(Path(fp8_saved.__file__).read_bytes())  # the joint rewrite it runs
        for part in (self.config.fingerprint("memory"), repr(sorted(versions().items())),
                     lowering_fingerprint(), repr(chained_uuid)):
            h.update(part.encode())
        return h.hexdigest()


# -- explain's tables -----------------------------------------------------------------------------------


def format_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def memory_summary(record: GraphMemory) -> str:
    """One line: what graph ``record.graph`` saves, against its default and the budget."""
    counted = [t for t in record.tensors if t.kind != "parameter" and t.status != "recomputed"]
    text = f"graph {record.graph}: saves {format_bytes(record.saved_bytes)} in {len(counted)} tensors"
    if record.default_bytes is not None and record.budget is not None:
        share = record.saved_bytes / record.default_bytes if record.default_bytes else 1.0
        text += f", {share:.0%} of the {format_bytes(record.default_bytes)} saved with no budget"
    text += f"; budget {record.budget:g}" if record.budget is not None else "; no budget"
    if record.kept:
        text += f"; {record.kept} attention / plan / data-dependent ops never recomputed"
    if record.fp8_bytes:
        text += (f"; in FP8: {format_bytes(record.fp8_bytes)} (with scales) instead of "
                 f"{format_bytes(record.fp8_bytes_before)}")
    return text


PEAK_NOTE = ("peaks: an estimate from the partitioned graphs' own liveness (Inductor may reuse or hold "
             "buffers differently); parameters, their gradients and optimizer state are not in it")


def peak_line(record: GraphMemory) -> str | None:
    """One line: the backward's peak live bytes (against the default's), what is alive there, and the
    forward's peak; None when not measured."""
    bw, fw = record.backward_peak, record.forward_peak
    if bw is None:
        return None

    def against(peak: PeakMemory | None) -> str:
        show = peak is not None and record.budget is not None
        return f" (default {format_bytes(peak.nbytes)})" if show else ""  # type: ignore[union-attr]

    parts = [f"saved {format_bytes(bw.saved_bytes)}"]
    if bw.tangent_bytes:
        parts.append(f"tangents {format_bytes(bw.tangent_bytes)}")
    parts.append(f"produced in the backward {format_bytes(bw.produced_bytes)}")
    text = (f"graph {record.graph}: backward peak {format_bytes(bw.nbytes)} at {bw.node}"
            f"{against(record.default_backward_peak)}: {' + '.join(parts)}")
    if fw is not None:
        text += f"; forward peak {format_bytes(fw.nbytes)}{against(record.default_forward_peak)}"
    return text


def peak_table(record: GraphMemory, max_rows: int = 6) -> Any:
    """A rich Table: the largest values alive at the backward's peak (None when not measured)."""
    from rich.markup import escape
    from rich.table import Table

    peak = record.backward_peak
    if peak is None:
        return None
    table = Table(title=f"graph {record.graph}: the largest values alive at the backward peak",
                  title_justify="left")
    for col, justify in (("value", "left"), ("produced by", "left"), ("shape", "left"), ("dtype", "left"),
                         ("bytes", "right"), ("kind", "left")):
        table.add_column(col, justify=justify)
    for v in peak.top[:max_rows]:
        table.add_row(escape(v.name), escape(v.op), escape(v.shape), v.dtype, format_bytes(v.nbytes), v.kind)
    rest = peak.nbytes - sum(v.nbytes for v in peak.top[:max_rows])
    if rest > 0:
        table.add_row("... the rest", "", "", "", format_bytes(rest), "")
    table.add_row("total", f"at {peak.node} ({peak.op})" if peak.op else f"at {peak.node}", "", "",
                  format_bytes(peak.nbytes), "", style="bold")
    return table


def memory_tables(records: Iterable[GraphMemory], max_rows: int = 12) -> list:
    """A rich Table per graph: the saved tensors (rows of equal op, module, shape, dtype and status grouped,
    the largest first, at most ``max_rows`` per status), parameters summed in one row (alive anyway, not
    counted), totals against the budget; each followed by the graph's peak_line and peak_table, and PEAK_NOTE
    once at the end."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    records = list(records)
    tables: list = []
    for record in records:
        table = Table(title=f"saved for backward, {memory_summary(record)}", title_justify="left")
        for col, justify in (("tensor", "left"), ("produced by", "left"), ("at", "left"), ("shape", "left"),
                             ("dtype", "left"), ("bytes", "right"), ("status", "left")):
            table.add_column(col, justify=justify)
        groups: dict[tuple, list[SavedTensor]] = {}
        parameters = [t for t in record.tensors if t.kind == "parameter" and t.status != "recomputed"]
        for t in record.tensors:  # a layer repeated L times: one row, counted (blocks.0, blocks.1: blocks.*)
            if t.kind != "parameter":
                where = re.sub(r"\.\d+(?=[. ]|$)", ".*", t.where)
                groups.setdefault((t.op, where, t.shape, t.dtype, t.status), []).append(t)
        where_of = {id(g): key[1] for key, g in groups.items()}
        rows = sorted(groups.values(), key=lambda g: -sum(t.nbytes for t in g))
        for status in STATUSES:
            of_status = [g for g in rows if g[0].status == status]
            for group in of_status[:max_rows]:
                t, where = group[0], where_of[id(group)]
                name = t.name + (f" (x{len(group)})" if len(group) > 1 else "")
                dtype = f"{t.dtype_before} -> {t.dtype}" if t.dtype_before else t.dtype
                table.add_row(escape(name), escape(t.op), escape(where), escape(t.shape), dtype,
                              format_bytes(sum(x.nbytes for x in group)), status)
            if len(of_status) > max_rows:
                rest = [t for g in of_status[max_rows:] for t in g]
                table.add_row(f"... {len(rest)} more", "", "", "", "",
                              format_bytes(sum(t.nbytes for t in rest)), status)
        if parameters:
            table.add_row(f"{len(parameters)} parameters / buffers", "(alive anyway, not counted)", "", "",
                          "", format_bytes(sum(t.nbytes for t in parameters)), "saved")
        table.add_row("total", "activations and inputs saved", "", "", "", format_bytes(record.saved_bytes),
                      "", style="bold")
        if record.fp8_bytes:
            fp8 = [t for t in record.tensors if t.dtype_before and t.status != "recomputed"]
            values = f"{len(fp8)} value{'s' if len(fp8) > 1 else ''} (+ scales)"
            before = f"{format_bytes(record.fp8_bytes_before)} in their own dtype"
            table.add_row("in fp8", f"{values}, {before}", "", "", "", format_bytes(record.fp8_bytes), "",
                          style="bold")
        if record.default_bytes is not None and record.budget is not None:
            table.add_row("default", "saved with no budget", "", "", "", format_bytes(record.default_bytes),
                          "", style="bold")
        tables.append(table)
        if (line := peak_line(record)) is not None:
            tables += [Text(line, style="bold"), peak_table(record)]
    if any(record.backward_peak is not None for record in records):
        tables.append(Text(PEAK_NOTE, style="dim"))
    return tables
