"""The GDPA kernels, compiled for sm_90a on the CPU (no GPU needed): their loops are software-pipelined.

What the compiler does with a kernel decides whether it can be fast: on Hopper the loads of the next
tiles must be asynchronous copies (cp.async) that overlap the current tile's wgmma dots, or every
iteration waits for global memory. Triton pipelines a load only if it can vectorize it, which needs the
head dim's stride to be known as 1: the JIT specializes an int argument equal to 1 into a constant at
launch (and marks 16-divisible ones), so contiguous q/k/v/dO (the layout the op's callers pass) get it. Packed
queries (token_offsets) are compiled too: their rows start at token_offsets[b], the loops stay pipelined.

Each kernel is compiled here with those launch-time specializations for bf16, causal silu with a bias
(HSTU's case, the configs the autotuner offers on sm_90), and its Triton GPU IR must show asynchronous
copies and wgmma dots; its PTX must evaluate silu with one SFU instruction per score (tanh.approx), where
tl.sigmoid takes two (ex2 and a division). The near-miss: the same kernel with the strides left generic
must not be pipelined, which shows that the check can fail and why the strides matter.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

# The test process imports the kernels under the CPU interpreter (tests/conftest.py), where they are not
# compilable JIT functions: the compiles run in one child process without TRITON_INTERPRET.
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemcompile.lowering.gdpa import bias_grad_triton as gdpa_bias_grad_triton
from gemcompile.lowering.gdpa import triton as gdpa_triton

FLAGS = dict(HEAD_D=64, BLOCK_D=64, Q_MODE=1, KV_MODE=1, CAUSAL=True, HAS_WINDOW=False, HAS_TARGETS=False,
             HAS_CONTEXT=False, HAS_KV_MASK=False, ACT=gdpa_triton.activation_code("silu"), FAST_ACT=True,
             DIVIDE=False, DOT_PRECISION="tf32")
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Bias": "*bf16", "DO": "*bf16", "Out": "*bf16",
            "DQ": "*bf16", "DK": "*bf16", "DV": "*bf16", "DS": "*fp32", "Part": "*fp32", "QLengths": "*i64",
            "KVLengths": "*i64", "NumTargets": "*i64", "Order": "*i64", "KVMask": "*u8", "KVBounds": "*i32"}
KERNELS = {  # kernel, its constexprs, (num_warps, num_stages): one of its sm_90 autotune configs
    "fwd": (gdpa_triton._gdpa_fwd_kernel, dict(FLAGS, HAS_BIAS=True, BLOCK_M=128, BLOCK_N=64), (8, 3)),
    "dq": (gdpa_triton._gdpa_bwd_dq_kernel, dict(FLAGS, HAS_BIAS=True, BIAS_GRAD=False, BLOCK_M=128, BLOCK_N=64),
           (8, 3)),
    "dkdv": (gdpa_triton._gdpa_bwd_dkdv_kernel, dict(FLAGS, HAS_BIAS=True, BLOCK_M=32, BLOCK_N=128), (8, 3)),
    "dbias": (gdpa_bias_grad_triton._gdpa_bwd_dbias_kernel,
              dict(FLAGS, SHARED_B=True, SHARED_H=True, BLOCK_M=64, BLOCK_N=64), (4, 3)),
}


def compiled(kernel, constexprs, warps, stages, unit_strides):
    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # through the autotuner
        fn = fn.fn
    consts = dict(constexprs)
    if unit_strides:  # a launch specializes an int equal to 1 into a constant: the head dim's strides
        consts.update({n: 1 for n in fn.arg_names
                       if n.startswith("stride_") and (n.endswith("d") or n in ("stride_zn", "stride_mn"))})
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n in ("scale", "out_scale") else "i32")
           for n in fn.arg_names}
    # ... and marks 16-divisible ints and pointers (contiguous tensors of these shapes)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (n.startswith("stride_") and n not in consts)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.asm


def sfu_ops(ptx):
    return {op: ptx.count(op) for op in ("tanh.approx.f32", "ex2.approx", "div.full.f32", "div.rn.f32")}


report = {}
for name, (kernel, constexprs, (warps, stages)) in KERNELS.items():
    for unit in (True, False) if name == "dbias" else (True,):
        asm = compiled(kernel, constexprs, warps, stages, unit)
        ir = asm["ttgir"]
        report[f"{name}:{'unit' if unit else 'generic'}"] = {
            "async_copies": ir.count("ttg.async_copy_global_to_local"), "wgmma": ir.count("ttng.warp_group_dot "),
            "sfu": sfu_ops(asm["ptx"])}
    # with a kv_mask (a contiguous or batch-expanded mask: its key stride is 1)
    ir = compiled(kernel, dict(constexprs, HAS_KV_MASK=True), warps, stages, True)["ttgir"]
    report[f"{name}:kv_mask"] = {"async_copies": ir.count("ttg.async_copy_global_to_local"),
                                 "wgmma": ir.count("ttng.warp_group_dot ")}
    # packed queries (token_offsets: Q_MODE 2, rows from token_offsets[b], a unit head-dim stride)
    ir = compiled(kernel, dict(constexprs, Q_MODE=2), warps, stages, True)["ttgir"]
    report[f"{name}:packed"] = {"async_copies": ir.count("ttg.async_copy_global_to_local"),
                                "wgmma": ir.count("ttng.warp_group_dot ")}
    # the near-miss of the activation: tl.sigmoid (FAST_ACT off, as for fp32 inputs)
    report[f"{name}:precise"] = {"sfu": sfu_ops(compiled(kernel, dict(constexprs, FAST_ACT=False), warps, stages,
                                                         True)["ptx"])}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["unit", "kv_mask", "packed"])
@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv", "dbias"])
def test_loops_load_with_async_copies_and_multiply_with_wgmma(report, name, variant):
    counts = report[f"{name}:{variant}"]
    assert counts["async_copies"] > 0, f"{name}: no asynchronous copies (its loads are not pipelined)"
    assert counts["wgmma"] > 0, f"{name}: no wgmma dot"


@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv", "dbias"])
def test_silu_takes_one_sfu_instruction_per_score(report, name):
    # FAST_ACT: sigmoid as 0.5 + 0.5 tanh(x / 2), the SFU's tanh.approx; no exp, no division
    fast, precise = report[f"{name}:unit"]["sfu"], report[f"{name}:precise"]["sfu"]
    assert fast["tanh.approx.f32"] > 0 and fast["ex2.approx"] == fast["div.full.f32"] == fast["div.rn.f32"] == 0
    # tl.sigmoid: exp and a division for each score, as many of each as the fast path has tanh
    assert precise["tanh.approx.f32"] == 0
    assert precise["ex2.approx"] == precise["div.full.f32"] + precise["div.rn.f32"] == fast["tanh.approx.f32"]


def test_near_miss_generic_strides_are_not_pipelined(report):
    assert report["dbias:generic"]["async_copies"] == 0 and report["dbias:generic"]["wgmma"] > 0
