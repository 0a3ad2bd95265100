"""What every op of lowering/ is made of, besides its own kernels: one torch.library handle, the dispatch
rules and the autograd plumbing.

How autograd and the log-sum-exp are wired (the pattern of every attention op)
-----------------------------------------------------------------------------
The backward must reuse what the forward computed (the log-sum-exp of a softmax), but a ``custom_op``'s
``setup_context`` only sees the op's own outputs. So an op ``X`` is three ops:

* ``gemcompile::X_fwd(...) -> (out, lse)``: a ``torch.library.custom_op`` (opaque to Dynamo/Inductor, so
  graphs and ``explain`` show one stable node) with a fake impl and ``register_autograd``; ``lse`` is saved
  for the backward and marked non-differentiable (GDPA has no softmax: its fwd returns ``out`` alone).
* ``gemcompile::X_bwd(grad_out, ..., bias_requires_grad) -> (dq, dk, dv[, dbias])``: a custom_op with a fake
  impl (dbias is an empty tensor when not needed).
* ``gemcompile::X``: the public op, ``CompositeImplicitAutograd``, a thin wrapper over ``X_fwd``. Dynamo
  keeps it as one node in the pre-grad graph (where the passes put it); AOTAutograd decomposes it into the
  fwd op in the forward graph and the bwd op in the backward graph. Its fake behaviour is the fwd op's
  fake impl. Works with ``fullgraph=True``.

``custom_op`` rather than ``triton_op``: the launchers autotune and argsort on the device; keeping the op
opaque keeps Inductor out of them and keeps the node name stable across torch 2.11-2.13.

The eager fast path: a plain eager call on CUDA (no tracing, no dispatch mode: :func:`takes_eager_path`)
skips the two custom ops and runs the same kernels through one ``torch.autograd.Function``. Why: an eager
forward+backward through the custom ops (``register_autograd`` wrapper, Python kernels at the Autograd and
CUDA dispatch keys, a zero-filled gradient for the non-differentiable lse) cost
more host time than the GPU time of the whole step on short shapes
(benchmarks/results/jagged_attention-overhead-*.json). Graph capture (Dynamo, AOTAutograd, make_fx,
FlopCounterMode, opcheck) never takes this path, so compiled graphs, FLOP counts and fake tensors still
see the custom ops.

Dispatch: CUDA runs an op's Triton kernels (:func:`use_triton`: not for float64, which falls back to the
reference); every other device runs its plain-PyTorch reference. Neither path syncs with the host.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["LIB", "cuda_kernel", "direct_cuda", "ignoring_plan", "input_grads", "is_fake", "kept_tensor",
           "save_for_backward", "takes_eager_path", "use_triton"]

LIB = torch.library.Library("gemcompile", "FRAGMENT")
"""The one torch.library handle of the gemcompile namespace (schemas and impls of the public ops)."""


def cuda_kernel(op):
    """Decorator: ``fn`` is the CUDA kernel of the custom op ``op``, registered at the dispatcher's CUDA key
    through :data:`LIB` rather than with ``op.register_kernel("cuda")``. The dispatcher then calls ``fn``
    itself; register_kernel wraps it in a Dynamo-disabled function and checks its outputs for aliasing on
    every call, 60-100 us of host time per call on the H200 machine
    (benchmarks/results/op_host_time-20261202-024518.json: ``op`` against ``cuda_impl``), which a
    host-bound training step pays for every attention call. The op's fake impl, autograd and default
    (other devices) impl are unchanged; ``fn`` gets the arguments as register_kernel's function did (the
    trailing optional ones may be left out: give them defaults)."""

    def register(fn):
        LIB.impl(op._name, fn, "CUDA")  # noqa: SLF001  (the op's name in the gemcompile namespace)
        return fn

    return register


def direct_cuda(op) -> None:
    """Register the custom op ``op``'s own (device-generic) implementation at the CUDA key too, as
    :func:`cuda_kernel` registers a CUDA-only one: CUDA calls then skip register_kernel's wrapper (a
    Dynamo-disabled function and the aliasing check). For the small ops a compiled step calls many times:
    token_mm ran 162 times a step of GEM-ref medium, and the wrappers were the largest item of the host's
    time under cProfile (benchmarks/results/e2e-medium-fill0.5-20261203-090042.json, host_profile). The
    implementation must return new tensors (the check it skips)."""
    LIB.impl(op._name, op._init_fn, "CUDA")  # noqa: SLF001


def is_fake(t: Tensor) -> bool:
    """A tensor without values: meta, or a FakeTensor while tracing."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake_tensor

    return t.device.type == "meta" or _is_fake_tensor(t)


def use_triton(q: Tensor) -> bool:
    """Whether an op runs its Triton kernels for inputs like ``q`` (CUDA, not float64)."""
    return q.device.type == "cuda" and q.dtype != torch.float64


def takes_eager_path(q: Tensor) -> bool:
    """Plain CUDA tensors outside any tracing or dispatch mode (the only case with no graph to build)."""
    return (
        q.device.type == "cuda"
        and type(q) is Tensor
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
    )


def save_for_backward(ctx, tensors: tuple, args, *, bias=None, bias_index: int | None = None,
                      lse=None) -> None:
    """A fwd op's setup_context (or an eager Function's forward): save the tensors, keep the non-tensor
    ``args`` as ``ctx.args``, note whether the bias (input ``bias_index``) needs a gradient, and mark the
    log-sum-exp non-differentiable."""
    ctx.save_for_backward(*tensors)
    ctx.args = args
    ctx.bias_requires_grad = bias is not None and bool(ctx.needs_input_grad[bias_index])
    if lse is not None:
        ctx.mark_non_differentiable(lse)


def input_grads(count: int, dq, dk, dv, dbias=None, bias_index: int = 5) -> tuple:
    """The backward's gradients for an op of ``count`` inputs: q, k, v first, the bias at ``bias_index``
    (None unless given), None for every other input."""
    grads = [dq, dk, dv] + [None] * (count - 3)
    if dbias is not None:
        grads[bias_index] = dbias
    return tuple(grads)


def contiguous_vectors(launcher):
    """``launcher`` with each 1-D integer tensor argument (lengths, num_targets, token offsets, orders) made
    contiguous: the Triton kernels read them with unit stride, so a column ``meta[:, 0]`` or an expanded
    ``(1,)`` would be read past what it holds. (q, k, v and masks carry their strides to the kernels.)"""
    def vector(x):
        if isinstance(x, Tensor) and x.dim() == 1 and not x.is_floating_point() and x.dtype != torch.bool:
            return x.contiguous()
        return x

    def launch(*args, **kwargs):
        return launcher(*(vector(a) for a in args), **{k: vector(v) for k, v in kwargs.items()})

    return launch


def ignoring_plan(reference):
    """``reference`` callable like the Triton launchers, which take the derived tensors (q_order, kv_order,
    kv_bounds: common/length_order.py) as keywords; a reference derives nothing, so it drops them."""

    def call(*args, q_order=None, kv_order=None, kv_bounds=None, **kwargs):
        return reference(*args, **kwargs)

    return call


def kept_tensor(make, device: torch.device) -> Tensor:
    """``make()`` for a tensor an op keeps across calls (a cache), allocated where no CUDA graph pool can
    own it. CUDA-graph trees route every allocation of the thread that warms up or records a graph into the
    graph's private pool, and fail the step if a tensor of that pool outlives the call without being an
    output ("tensor(s) in the cudagraph pool not tracked as outputs"). So on CUDA ``make`` runs in a helper
    thread, on a side stream it waits for before returning (a one-time cost per cache entry). Keep such a
    tensor for the life of the process, or free it only after a device synchronize: it was made on that side
    stream, so the allocator would not order its reuse after the kernels that read it."""
    if device.type != "cuda":
        return make()
    if device.index is None:  # the helper thread's current device is its own, not this thread's
        device = torch.device("cuda", torch.cuda.current_device())

    def build():
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            tensor = make()
        stream.synchronize()
        return tensor

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(build).result()
