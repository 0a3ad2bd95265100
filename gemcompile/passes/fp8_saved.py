"""FP8 saved activations (GemConfig.memory.fp8_saved): the input x of a Linear-like GEMM, which the forward
keeps for the weight gradient dW = dy^T x, is held from the forward to the backward in FP8.

**Numerics.** E4M3 elements, one power-of-two scale per 1x128 block along x's last dim (K, the Linear's
in_features; one scale per row when K is not a multiple of 128), chosen by the "rceil" rule (amax / 448
rounded up to a power of two: never clips): the activation quantization of the "blockwise" recipe, equal bit
for bit to ``lowering/fp8/numerics.block_quantize(x, (1, 128), "rceil")`` (a test checks it).
* 1x128 rather than per row: activation outliers sit in a few channels, present in every row; a row scale
  lets one such channel flush the row's small values, a block confines it to its 128 channels, for 4 bytes of
  scale per 128 elements.
* Powers of two: ``x * 2^-e`` and ``q * 2^e`` are exact in every implementation (eager ATen, Inductor's C++
  and Triton code, which rewrites a division by a constant as a multiplication), so the compiled graph and
  the eager reference ``fake_quantize`` agree bit for bit. The exponent comes from amax's bits (integer ops:
  no log2, frexp or division), which gives exactly ceil(log2(amax / 448)).
* A block holding NaN or +-Inf gets a NaN scale: its values decode to NaN, never hidden.
* Only dW reads the FP8 copy; the output, dx and every other gradient read x as computed.

**Where.** Inside gemcompile's partitioner (passes/activation_memory.py), in two steps.
1. Joint graph, before torch's min-cut partition (``plan``, ``rewrite``): for each forward ``mm`` / ``addmm``
   with a parameter operand and an activation operand x, the backward GEMMs of the same forward op
   (``meta["seq_nr"]``; the module when it is missing) that read x, directly or through views, read
   ``dequantize(quantize(x))`` instead. The quantize (amax, scale, cast) goes right after x, where Inductor
   fuses it into x's producer; the dequantize right before its first reader, so its full-precision result
   lives only until dW (a GEMM, which Inductor cannot fuse into). This fixes what reads FP8 values whatever
   the partition, and offers the partitioner an FP8 tensor (1 byte an element) and its scales beside x.
2. After the partition (``settle``), per site, what the backward receives:
   * the FP8 elements: done;
   * the dequantized copy, or x (or what x is recomputed from) read by the quantize alone: min-cut weighs a
     value only fusible ops read twice, so one FP8 byte weighs as much as a bfloat16 byte and loses the tie
     (in bfloat16 it always does). ``move`` edits the two graphs: the forward hands over the FP8 elements and
     scales in place of those values. It relies on the contract torch's own ``activation_quantization_aten_
     pass`` relies on (the tensors saved for the backward follow the user's outputs among the forward's
     outputs and precede the tangents among the backward's inputs, in the same order; one output
     descriptor per output), checked first;
   * values the backward reads at full precision anyway (a GELU's input, a ReLU's mask source, a norm's
     input): an FP8 copy saves nothing. The site is undone (``undo``) and the joint graph partitioned again,
     so dW reads FP8 values only where they are saved.

**Why not only edit the partitioned graphs** (swap a saved value for its FP8 copy, as torch's pass does):
the partition rarely saves a Linear's input for dW alone. For ``Linear -> ReLU -> Linear`` it saves ReLU's
output, which ReLU's backward also reads (its mask); for a GELU it saves the GELU's input. Quantizing those
changes more than dW. The joint rewrite states exactly which reads see FP8 values and lets min-cut re-cut
around them (for ReLU in float32: the FP8 copy plus a bool mask instead of the float output); the edit of the
partitioned graphs only settles min-cut's ties.

**Left alone**, with the reason in ``explain``:
* x a graph input or parameter (alive anyway);
* an output of a gemcompile op (attention outputs, log-sum-exp, plans);
* not floating, fewer than MIN_ELEMENTS elements, or a symbolic last dim;
* in a region the user checkpointed (recomputed, not saved);
* read at full precision by the backward anyway: another module's dW before partitioning, a GELU's or a
  norm's backward after it (``settle``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gemcompile.lowering.fp8.numerics import E4M3_MAX
from gemcompile.passes.graph import erase_dead
from gemcompile.passes.mxfp8 import _TRANSPARENT, _hint, match_pattern, node_modules
from gemcompile.passes.records import Refusal, Rewrite, describe_nodes, source_location

aten = torch.ops.aten

FP8 = torch.float8_e4m3fn
BLOCK = 128
MIN_ELEMENTS = 1 << 16
"""Smallest x quantized: 64 Ki elements (256 KiB in float32). Below it the bytes saved do not pay for a
quantize in the forward and a dequantize in the backward, and activations that small do not set the peak."""

TAG = "gemcompile_fp8_saved"
"""Meta key on the nodes this pass adds to the joint graph: ``{"role": "data" | "scale", "of": x's name,
"dtype": x's dtype, "nbytes": x's bytes}``; it rides along into the forward and backward graphs."""

PASS_NAME = "fp8_saved"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
_BACKWARD_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_MOVES = _TRANSPARENT | {aten.index.Tensor, aten.index_select.default, aten.gather.default}
"""Ops that only move their first input's values (unpad gathers an attention's output into packed tokens)."""
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
          aten.permute.default, aten.transpose.int, aten.alias.default, aten.expand.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}


# -- numerics: run eagerly (the reference), traced into the joint graph (the pass) -------------------------


def block_of(k: int) -> int:
    """Elements per scale along the last dim: 128, or the whole row when 128 does not divide it."""
    return BLOCK if k % BLOCK == 0 else k


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent from its float32 bits; exponent + 127 must lie in [1, 254] (a normal float)."""
    return torch.bitwise_left_shift(exponent + 127, 23).view(torch.float32)


def quantize_as(x: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, k) of ``dtype`` -> (elements (M, k / b, b) float8_e4m3fn, scales (M, k / b, 1) float32),
    b = block_of(k)."""
    b = block_of(k)
    xb = x.view(-1, k // b, b)
    if dtype != torch.float32:
        # the round trip through int16 bits pins x's own rounding: Inductor otherwise hands a fused
        # consumer its producer's float32 value (emulate_precision_casts=False), which quantizes differently
        xb = xb.view(torch.int16).view(dtype).to(torch.float32)  # exact: bf16 / fp16 fit in fp32
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # ceil(log2(amax / 448)) from amax = 1.m * 2^E: E - 8 when 1.m <= 1.75 (448 = 1.75 * 2^8), else E - 7.
    # Subnormal or zero amax lands below -127 and is clamped there, as numerics.block_quantize does.
    bits = amax.view(torch.int32)
    above = (torch.bitwise_and(bits, 0x7FFFFF) > 0x600000).to(torch.int32)
    exponent = (torch.bitwise_right_shift(bits, 23) + above - (127 + 8)).clamp(-127, 127)
    # non-finite amax gives exponent 120, so 2^-exponent and 2^(exponent + 1) stay normal floats
    elements = (xb * _pow2(-exponent)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    scale = _pow2(exponent + 1) * 0.5  # 2^-127 is subnormal: halve 2^-126
    scale = torch.where(amax < math.inf, scale, amax * math.nan)  # +inf or NaN in the block: NaN scale
    return elements, scale


def dequantize_as(elements: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The (M, k) tensor of ``dtype`` that ``quantize_as`` encoded (exact: q * 2^e has 4 significant bits)."""
    return (elements.to(torch.float32) * scale).to(dtype).view(-1, k)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_as`` of a 2-D tensor."""
    return quantize_as(x, x.shape[-1], x.dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """What dW reads in place of a 2-D x saved in FP8: dequantize(quantize(x)), in x's dtype."""
    return dequantize_as(*quantize(x), x.shape[-1], x.dtype)


# -- which values --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Site:
    """One activation chosen for FP8: ``xs`` are the nodes holding it (the first, and views of its base
    equal to it: ``q``, ``k`` and ``v`` of one input each view it anew), ``readers`` the users of those
    nodes that get the dequantized copy; after the rewrite, the names of what was added."""

    xs: list[fx.Node]
    modules: list[str] = field(default_factory=list)
    wgrads: set[fx.Node] = field(default_factory=set)
    readers: list[fx.Node] = field(default_factory=list)
    name: str = ""
    elements: str = ""
    scale: str = ""
    dequantized: str = ""
    block: int = 0
    moved: str = ""
    """What ``move`` moved across the partition for it: "quantize" (into the forward), "dequantize" (into
    the backward), or nothing."""
    saved: bool = False
    """Whether the final partition hands its FP8 elements to the backward."""
    reason: str = ""
    """Why the FP8 copy is not saved, when it is not (``settle``)."""


def _gemcompile_op(node: fx.Node) -> str | None:
    """The gemcompile op that produced a node (directly, or as a getitem of its outputs)."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload) and target.name().startswith("gemcompile::"):
        return target.name()
    return None


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], fx.Node)


def _root(node: fx.Node, ops: set = _TRANSPARENT) -> fx.Node:
    while node.op == "call_function" and node.target in ops and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _terminals(node: fx.Node) -> list[fx.Node]:
    """The readers of a value through views: a view's users, recursively; any other node itself."""
    return [t for user in node.users for t in _terminals(user)] if _is_view(node) else [node]


def _tangent_closure(graph: fx.Graph) -> set[fx.Node]:
    closure = {n for n in graph.nodes if n.op == "placeholder" and "tangents" in str(n.target)}
    for node in graph.nodes:
        if node not in closure and any(a in closure for a in node.all_input_nodes):
            closure.add(node)
    return closure


def _module(node: fx.Node, backward: bool) -> tuple[list[tuple[str, str]] | None, str]:
    modules = node_modules(node, backward=backward)
    return modules, (modules[-1][0] if modules else "")


def _ineligible(x: fx.Node) -> str | None:
    """Why x is never quantized, or None."""
    from torch.utils.checkpoint import CheckpointPolicy

    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "no tensor value"
    if val.dtype not in _FLOATS:
        return f"dtype {str(val.dtype).removeprefix('torch.')} (floating activations only)"
    base = _root(x, _MOVES)  # through views, copies, casts and gathers: x is a copy of its values
    if base.op == "placeholder":
        return "a copy of a graph input or parameter (alive anyway: FP8 would add a copy)"
    if op := _gemcompile_op(base):
        return f"an output of {op} (gemcompile's attention outputs, log-sum-exp and plans stay as computed)"
    recompute = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    if x.meta.get("recompute") in recompute or base.meta.get("recompute") in recompute:
        return "inside a checkpointed region (recomputed in the backward, not saved)"
    if val.dim() != 2 or not isinstance(val.shape[-1], int):
        return f"shape {tuple(val.shape)}: a 2-D operand with a static last dim is quantized"
    rows = _hint(val.shape[0])
    if rows is None or rows * val.shape[-1] < MIN_ELEMENTS:
        count = "unknown" if rows is None else rows * val.shape[-1]
        return f"{count} elements < {MIN_ELEMENTS} (MIN_ELEMENTS)"
    return None


def _paired(forward: fx.Node, backward: fx.Node) -> bool:
    """Whether a backward GEMM belongs to a forward GEMM's op: same seq_nr, else the same module."""
    a, b = forward.meta.get("seq_nr"), backward.meta.get("seq_nr")
    if a is not None and b is not None:
        return a == b
    return bool(_module(forward, False)[1]) and _module(forward, False)[1] == _module(backward, True)[1]


def _same_value_key(x: fx.Node) -> Any:
    """Nodes with equal keys hold equal values (as the partitioner's CSE will find): a view or a copy is
    keyed by its op, its arguments and the key of what it reads."""
    if x.op != "call_function" or x.target not in _MOVES | _VIEWS:
        return x
    key = lambda a: _same_value_key(a) if isinstance(a, fx.Node) else a  # noqa: E731
    return (str(x.target), repr(fx.node.map_aggregate(x.args, key)), repr(x.kwargs))


def plan(graph: fx.Graph, fp8_saved: bool | tuple[str, ...], parameters: set[str]
         ) -> tuple[list[Site], list[tuple[fx.Node, str]]]:
    """The sites to quantize in a joint graph, and (node, reason) for each GEMM input left alone."""
    backward = _tangent_closure(graph)
    is_weight = (lambda n: isinstance(n, fx.Node) and _root(n).op == "placeholder"
                 and _root(n).name in parameters)
    sites: dict[Any, Site] = {}
    refused: list[tuple[fx.Node, str]] = []
    gemms = [n for n in graph.nodes if n.op == "call_function" and n.target in _GEMMS and n not in backward]
    for gemm in gemms:
        operands = [gemm.args[i] for i in _GEMMS[gemm.target]]
        if sum(map(is_weight, operands)) != 1 or not all(isinstance(o, fx.Node) for o in operands):
            continue  # not Linear-like (two activations, or two weights): no dW to serve
        x = next(o for o in operands if not is_weight(o))
        modules, module = _module(gemm, backward=False)
        if isinstance(fp8_saved, tuple):
            if modules is None:
                refused.append((gemm, f"{x.name}: source module unknown"))
                continue
            if match_pattern(fp8_saved, modules) is None:
                refused.append((gemm, f"{x.name} ({module}): matches no fp8_saved pattern"))
                continue
        if reason := _ineligible(x):
            refused.append((gemm, f"{x.name} ({module}): {reason}"))
            continue
        wgrads = {t for user in x.users for t in _terminals(user)
                  if t in backward and t.target in _BACKWARD_GEMMS and _paired(gemm, t)}
        if not wgrads:
            refused.append((gemm, f"{x.name} ({module}): no weight gradient reads it (a frozen weight?)"))
            continue
        site = sites.setdefault(_same_value_key(x), Site([x]))
        if x not in site.xs:
            site.xs.append(x)
        site.modules.append(module)
        site.wgrads |= wgrads
    chosen = []
    for site in sites.values():
        if reason := _assign_readers(site, backward):
            refused.append((site.xs[0], f"{site.xs[0].name} ({', '.join(site.modules)}): {reason}"))
        else:
            chosen.append(site)
    return chosen, refused


def _assign_readers(site: Site, backward: set[fx.Node]) -> str | None:
    """The users of the site's nodes whose every reader is one of its dW GEMMs; None when those are all that
    reads the value (any view of it) in the backward, else why FP8 would save nothing."""
    for x in site.xs:
        site.readers += [u for u in x.users if all(t in site.wgrads for t in _terminals(u))]
    served = {t for u in site.readers for t in _terminals(u)}
    bases = {_root(x, _VIEWS) for x in site.xs}  # every view of them reads the same values
    exact = [t for base in bases for u in base.users for t in _terminals(u)
             if t in backward and t not in served]
    if not exact:
        return None
    modules = {m for t in exact if (m := _module(t, True)[1])}
    ops = ", ".join(sorted({str(t.target).removesuffix(".default") for t in exact}))
    return (f"the backward also reads it at full precision ({ops}" + (f" of {', '.join(sorted(modules))}"
            if modules else "") + "): FP8 would save nothing")


# -- the rewrite, its undoing and its report ----------------------------------------------------------------


def _emit(graph: fx.Graph, fn: Callable[..., Any], inputs: list[fx.Node]) -> list[fx.Node]:
    """Trace ``fn`` on the inputs' fake values with Inductor's decompositions and copy its nodes in at the
    insertion point: the joint graph is already decomposed, and Inductor refuses an op it decomposes (on
    torch 2.13, ``aten.clamp``), a set that changes between releases."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [n.meta["val"] for n in inputs]
    with values[0].fake_mode:
        traced = make_fx(fn, decomposition_table=select_decomp_table())(*values)
    env = dict(zip([n for n in traced.graph.nodes if n.op == "placeholder"], inputs))
    return list(graph.graph_copy(traced.graph, env))


def _rename(node: fx.Node, name: str) -> None:
    if hasattr(node, "_rename"):  # FX's own helper: a readable name in graphs and in explain
        node._rename(name)


def rewrite(graph: fx.Graph, sites: list[Site]) -> tuple[list[Site], list[tuple[fx.Node, str]]]:
    """Route each site's dW readers through dequantize(quantize(x)) (module docstring). Returns the sites
    rewritten, and (x, reason) for each whose quantize could not be traced (a layout ``view`` refuses)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    done, failed = [], []
    for site in sites:
        try:
            _rewrite_site(graph, site, order)
            done.append(site)
        except Exception as e:  # noqa: BLE001 - nothing was inserted for it: x stays exact
            where = f"{site.xs[0].name} ({', '.join(site.modules)})"
            failed.append((site.xs[0], f"{where}: its quantize could not be traced ({type(e).__name__})"))
    return done, failed


def _rewrite_site(graph: fx.Graph, site: Site, order: dict[fx.Node, int]) -> None:
    x, val = site.xs[0], site.xs[0].meta["val"]
    k, dtype = val.shape[-1], val.dtype
    start = x.next
    with graph.inserting_before(start):
        elements, scale = _emit(graph, lambda v: quantize_as(v, k, dtype), [x])
    try:
        with graph.inserting_before(min(site.readers, key=order.__getitem__)):
            (dequantized,) = _emit(graph, lambda q, s: (dequantize_as(q, s, k, dtype),), [elements, scale])
    except Exception:
        erase_dead([elements, scale])
        raise
    nbytes = (_hint(val.shape[0]) or 0) * k * val.element_size()
    node = x.next
    while node is not start:  # the elements, and every node of the scales' shape: the partitioner may save
        if node is elements or node.meta["val"].shape == scale.meta["val"].shape:  # amax in their place
            node.meta[TAG] = {"role": "data" if node is elements else "scale", "of": x.name,
                              "dtype": str(dtype).removeprefix("torch."), "nbytes": nbytes}
        node = node.next
    _rename(elements, f"fp8_{x.name}_data")  # no trailing number: FX would renumber it
    _rename(scale, f"fp8_{x.name}_scale")
    _rename(dequantized, f"fp8_{x.name}_read")
    for reader in site.readers:
        for x_i in site.xs:
            reader.replace_input_with(x_i, dequantized)
    site.name, site.elements, site.scale, site.dequantized, site.block = \
        x.name, elements.name, scale.name, dequantized.name, block_of(k)


def settle(site: Site, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int | None
           ) -> tuple[str, Any]:
    try:
        return _settle(site, fw, bw, num_fwd_outputs)
    except Exception as e:  # noqa: BLE001 - a partition this pass cannot read: no FP8 copy for the site
        return "undo", f"the partition could not be read ({type(e).__name__}: {e})"


def _settle(site: Site, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int | None
            ) -> tuple[str, Any]:
    """What a partition made of a site:
    * ("saved", None): the backward receives its FP8 elements;
    * ("move", plan): min-cut weighs a value that only fusible ops read twice, so an FP8 copy ties with a
      bfloat16 value and loses the tie. Either the forward hands over the dequantized copy (``move``
      dequantizes in the backward instead), or the backward quantizes itself from saved values that nothing
      else in the backward reads and which outweigh the FP8 copy (``move`` quantizes in the forward);
    * ("undo", reason): those saved values are read at full precision anyway (a GELU's input, a ReLU's
      mask source), so an FP8 copy saves nothing."""
    bw_nodes = {n.name: n for n in bw.graph.nodes}
    if bw_nodes.get(site.elements) is not None and bw_nodes[site.elements].op == "placeholder":
        return "saved", None
    if bw_nodes.get(site.dequantized) is not None and bw_nodes[site.dequantized].op == "placeholder":
        return _settle_dequantized(site, fw, num_fwd_outputs)
    ends = [bw_nodes[name] for name in (site.elements, site.scale)
            if name in bw_nodes and bw_nodes[name].op != "placeholder"]
    chain = [n for n in bw.graph.nodes if n in set(_ancestors(ends)) and n.op != "placeholder"]
    if bw_nodes.get(site.elements) not in chain:
        return "undo", "the partition reads neither its FP8 elements nor what they are computed from"
    dead = set(ends)  # what dies once the forward hands over the FP8 values: the chain nodes only they read
    for node in reversed(chain):
        if node not in dead and node.users and all(u in dead for u in node.users):
            dead.add(node)
    sources = {a for n in chain for a in n.all_input_nodes if a.op == "placeholder"}
    dropped = [p for p in bw.graph.nodes if p in sources and all(u in dead for u in p.users)]
    kept = [p for p in sources if p not in dropped]
    freed = _freed_bytes(dropped, bw, fw)
    if freed <= sum(_bytes(n.meta["val"]) for n in ends):
        readers = sorted({_op_label(t) for n in (*kept, *chain) if n not in dead for u in n.users
                          if u not in chain for t in _terminals(u)})
        if not kept:
            return "undo", "its FP8 copy would not be smaller than what the backward keeps"
        names = ", ".join(sorted(p.name for p in kept))
        return "undo", (f"the backward keeps {names} (what it is recomputed from) at full precision for "
                        f"{', '.join(readers)} as well: an FP8 copy would save nothing")
    if (problem := _forward_layout([p.name for p in dropped], fw, num_fwd_outputs)) is not None:
        return "undo", problem
    return "move", ("quantize", chain, dead, dropped, ends)


def _settle_dequantized(site: Site, fw: fx.GraphModule, num_fwd_outputs: int | None) -> tuple[str, Any]:
    """The forward computed the dequantized copy and hands it over (in x's dtype): hand over the FP8
    elements and scales instead, and dequantize in the backward."""
    nodes = {n.name: n for n in fw.graph.nodes}
    ends = [nodes.get(site.elements), nodes.get(site.scale)]
    copy = nodes.get(site.dequantized)
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    if None in ends or copy is None or any(e in out.args[0] for e in ends) or list(copy.users) != [out]:
        return "undo", "the partition hands over its dequantized copy in a way this pass does not edit"
    if (problem := _forward_layout([site.dequantized], fw, num_fwd_outputs)) is not None:
        return "undo", problem
    between = set(_ancestors([copy])) - set(_ancestors(ends))
    return "move", ("dequantize", [n for n in fw.graph.nodes if n in between], ends)


def _ancestors(nodes: list[fx.Node]) -> list[fx.Node]:
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return list(seen)


def _op_label(node: fx.Node) -> str:
    return str(node.target).removesuffix(".default") if node.op == "call_function" else node.op


def _bytes(val: Any) -> int:
    return (_hint(val.numel()) or 0) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _storage(val: Any) -> Any:
    try:  # views share it; what the partitioner compares too
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - no storage to compare (a tensor subclass, a size)
        return None


def _freed_bytes(dropped: list[fx.Node], bw: fx.GraphModule, fw: fx.GraphModule) -> int:
    """Bytes the backward no longer holds without ``dropped``: their storages that no other input of the
    backward shares, graph inputs and parameters excluded (alive anyway)."""
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    held = {_storage(p.meta.get("val")) for p in bw.graph.nodes if p.op == "placeholder" and p not in dropped}
    freed: dict[Any, int] = {}
    for p in dropped:
        key = _storage(p.meta.get("val"))
        if p.name not in fw_inputs and (key is None or key not in held):
            key = key if key is not None else p
            freed[key] = max(freed.get(key, 0), _bytes(p.meta.get("val")))
    return sum(freed.values())


def _forward_layout(names: list[str], fw: fx.GraphModule, num_fwd_outputs: int | None) -> str | None:
    """Why the forward's outputs do not have the layout ``move`` edits (AOTAutograd's contract: the user's
    outputs, then the tensors saved for the backward, then saved sizes; an output descriptor per output
    where there are any), or None."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs, descs = list(out.args[0]), out.meta.get("desc")
    if num_fwd_outputs is None or (descs is not None and (not isinstance(descs, (list, tuple))
                                                          or len(descs) != len(outputs))):
        return "the partition's outputs are not laid out as expected"
    nodes = {n.name: n for n in fw.graph.nodes}
    for name in names:
        node = nodes.get(name)
        saved = [i for i, o in enumerate(outputs) if o is node and i >= num_fwd_outputs]
        if node is None or len(saved) != 1 or not isinstance(node.meta.get("val"), torch.Tensor) \
                or node.meta.get("saved_tensor_with_no_vc_check"):
            return f"the partition's outputs are not laid out as expected ({name})"
    return None


def move(plan: Any, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Make the forward hand over the FP8 elements and scales (``settle``), in place of the saved values
    only the quantize read (their quantize moves into the forward) or of the dequantized copy (its
    dequantize moves into the backward); the backward takes them as inputs at that place. The edit torch's
    own ``activation_quantization_aten_pass`` makes to the partitioned graphs, made only after ``settle``
    checked their layout."""
    if plan[0] == "dequantize":
        _move_dequantize(plan, fw, bw)
    else:
        _move_quantize(plan, fw, bw)
    fw.recompile()
    bw.recompile()


def _replace_outputs(fw: fx.GraphModule, replaced: list[fx.Node], new: list[fx.Node]) -> None:
    """The forward's outputs with ``new`` at the first of ``replaced`` and the others dropped (output
    descriptors alike: Inductor reads which outputs are saved for the backward from them)."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs, descs = list(out.args[0]), out.meta.get("desc")
    positions = sorted(max(i for i, o in enumerate(outputs) if o is r) for r in replaced)
    first = positions[0]
    keep = [i for i in range(len(outputs)) if i not in positions]
    before, after = [outputs[i] for i in keep if i < first], [outputs[i] for i in keep if i > first]
    out.args = (tuple(before + new + after), *out.args[1:])
    if descs is not None:
        out.meta["desc"] = [descs[i] for i in keep if i < first] + [descs[first]] * len(new) + \
            [descs[i] for i in keep if i > first]


def _new_inputs(bw: fx.GraphModule, before: fx.Node, values: list[fx.Node]) -> list[fx.Node]:
    """Backward inputs for forward values, named alike (the saved-tensor record pairs them by name)."""
    inputs = []
    with bw.graph.inserting_before(before):
        for value in values:
            inputs.append(bw.graph.placeholder(value.name))
            inputs[-1].meta.update(value.meta)
            if inputs[-1].name != value.name:  # the backward already had a node of that name
                _rename(value, inputs[-1].name)
    return inputs


def _move_dequantize(plan: Any, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    _, chain, ends = plan
    held = next(n for n in bw.graph.nodes if n.op == "placeholder" and n.name == chain[-1].name)
    inputs = _new_inputs(bw, held, ends)
    env = dict(zip(ends, inputs))
    with bw.graph.inserting_before(min(held.users, key=list(bw.graph.nodes).index)):
        for node in chain:
            env[node] = bw.graph.node_copy(node, env.__getitem__)
    _replace_outputs(fw, [chain[-1]], ends)
    erase_dead([chain[-1]])  # after the copy: erasing a node clears its arguments
    held.replace_all_uses_with(env[chain[-1]])
    bw.graph.erase_node(held)


def _move_quantize(plan: Any, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    _, chain, dead, dropped, ends = plan
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    env: dict[fx.Node, fx.Node] = {a: fw_nodes[a.name] for n in chain for a in n.all_input_nodes
                                   if a.op == "placeholder"}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    anchor = max(env.values(), key=order.__getitem__)
    with fw.graph.inserting_before(anchor.next):
        for node in chain:  # a recompute of a forward node is that node (same name); the rest is copied
            same = fw_nodes.get(node.name)
            env[node] = same if same is not None else fw.graph.node_copy(node, env.__getitem__)
    _replace_outputs(fw, [fw_nodes[p.name] for p in dropped], [env[n] for n in ends])
    inputs = _new_inputs(bw, min(dropped, key=list(bw.graph.nodes).index), [env[n] for n in ends])
    for node, placeholder in zip(ends, inputs):
        node.replace_all_uses_with(placeholder)
    for node in [*reversed([n for n in chain if n in dead]), *dropped]:
        bw.graph.erase_node(node)


def undo(gm: fx.GraphModule, sites: list[Site]) -> None:
    """Give the sites' readers x back and drop their quantize: dW reads FP8 values only where they are
    saved. By name: the partitioner replaced the joint graph by its CSE copy, which keeps names."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in sites:
        if site.dequantized in nodes and site.name in nodes:
            nodes[site.dequantized].replace_all_uses_with(nodes[site.name])
            erase_dead([nodes[site.dequantized]])  # and the quantize feeding it, up to x
    gm.recompile()


def report(sites: list[Site], undone: list[Site], refused: list[tuple[fx.Node, str]], log: Any) -> None:
    """Each site saved in FP8 as a rewrite; every value left alone, and every site undone, as a refusal."""
    for node, reason in refused:
        log.refusals.append(Refusal(PASS_NAME, "partition", source_location(node), reason,
                                    code=describe_nodes([node])))
    for site in sites:
        x = site.xs[0]
        modules = ", ".join(dict.fromkeys(site.modules))
        if site in undone or not site.saved:
            what = "left at full precision" if site in undone else "dW reads FP8 values that are not saved"
            log.refusals.append(Refusal(PASS_NAME, "partition", source_location(x),
                                        f"{site.name} ({modules}): {what}: {site.reason}",
                                        code=describe_nodes([x])))
            continue
        val = x.meta["val"]
        log.rewrites.append(Rewrite(
            PASS_NAME, "partition", source_location(x), describe_nodes(site.xs),
            f"{site.elements} = float8_e4m3fn {tuple(val.shape)} with a float32 scale per 1x{site.block} "
            f"block; dW of {modules} reads {site.dequantized}, its dequantized copy",
            detail=f"{site.name}: saved for the backward in float8_e4m3fn instead of "
                   f"{str(val.dtype).removeprefix('torch.')}" + (f" (its {site.moved} moved across the "
                                                                "partition)" if site.moved else ""),
            metrics={"modules": list(dict.fromkeys(site.modules)), "block": site.block, "moved": site.moved}))
