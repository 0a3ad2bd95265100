"""The jagged attention kernels compile for Hopper (sm_90) without a GPU: triton.compile down to a cubin with
the bundled ptxas, in a subprocess without TRITON_INTERPRET (the interpreter replaces @triton.jit).

This catches what the interpreter cannot: code the compiler rejects, and register spills of the
configs the autotuner offers for D = 128 (a performance regression); both for the pointer loads and for
the TMA loads (USE_TMA: the ragged descriptors of common/ragged_tma.py as tensordesc arguments).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    r'''
    import json, os, re, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gemcompile.lowering.jagged_attention import triton as T
    from gemcompile.lowering.common import attention_triton

    POINTERS = {"Lse": "fp32", "GradLse": "fp32", "Delta": "fp32", "DS": "fp32", "QOffsets": "i64", "QLengths": "i64",
                "KVOffsets": "i64", "KVLengths": "i64", "Order": "i64", "KVMask": "u8",
                "KVBounds": "i32", "Uniform": "u8", "Seed": "i64"}
    DATA = ("Q", "K", "V", "Bias", "Out", "DO", "DK", "DV", "DQ")
    DESCS = {"QDesc": "BLOCK_M", "KDesc": "BLOCK_N", "VDesc": "BLOCK_N", "DODesc": "BLOCK_M"}

    def jit_fn(kernel):
        while not isinstance(kernel, triton.runtime.jit.JITFunction):
            kernel = kernel.fn
        return kernel

    def compile_kernel(kernel, dtype, constexprs, num_warps, num_stages):
        """Specialise as a launch on contiguous tensors would: d strides 1, other strides, pointers % 16."""
        fn = jit_fn(kernel)
        signature, constants, attrs = {}, dict(constexprs), {}
        if "USE_TMA" in fn.arg_names:
            constants.setdefault("USE_TMA", False)
        if "WS" in fn.arg_names:
            constants.setdefault("WS", False)
        for i, name in enumerate(fn.arg_names):
            if name in DESCS:  # a ragged descriptor with the config's box, or None (the pointer loads)
                if constants["USE_TMA"]:
                    box = constexprs[DESCS[name]]
                    signature[name] = f"tensordesc<{dtype}[1,1,{box},{constexprs['BLOCK_D']}]>"
                else:
                    constants[name] = None
                    signature[name] = "constexpr"
            elif name in constants:
                signature[name] = "constexpr"
            elif name in DATA or name in POINTERS:
                signature[name] = "*" + POINTERS.get(name, dtype)
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("qk_scale", "scale", "dropout_scale"):
                signature[name] = "fp32"
            elif name.startswith("stride_") and (name.endswith("d") or name in ("stride_lm", "stride_zn",
                                                                                "stride_mn")):
                constants[name] = 1
                signature[name] = "constexpr"
            else:
                signature[name] = "i32"
                if name.startswith("stride_") or name in ("max_q_len", "max_kv_len", "LQ_BUCKET",
                                                          "LK_BUCKET"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})

    def spill_bytes(compiled):
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if not os.path.exists(tool) or "cubin" not in compiled.asm:
            return None
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
            fh.write(compiled.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
        os.unlink(fh.name)
        m = re.search(r"STACK:(\d+)", out)
        return int(m.group(1)) if m else None

    PART = sys.argv[1]  # "kernels" or "warp_specialized" (a test each)
    results = []
    # bf16 D 128, no bias, no mask, not causal: the benchmark's variant
    PLAIN_D128 = dict(HEAD_D=128, BLOCK_D=128, Q_MODE=1, KV_MODE=1, HAS_BIAS=False, CAUSAL=False,
                      DOT_PRECISION="tf32", HAS_KV_MASK=False, HAS_UNIFORM=False, DROPOUT=False)
    if PART == "kernels":
        variants = [  # dtype, D, q mode, kv mode, bias, causal, dot precision, kv_mask (and uniform_keys), dropout
            ("bf16", 64, 1, 1, True, True, "tf32", False, False),
            ("fp16", 96, 0, 1, True, False, "tf32", False, False),  # head dim padded to BLOCK_D = 128
            ("fp32", 32, 1, 1, False, True, "tf32x3", False, False),
            ("bf16", 128, 2, 2, False, True, "tf32", False, True),  # packed layout, dropout
            ("bf16", 128, 1, 0, True, True, "tf32", True, False),  # kv_mask and uniform_keys, no kv_lengths
        ]
        for dtype, D, q_mode, kv_mode, bias, causal, precision, kv_mask, dropout in variants:
            flags = dict(HEAD_D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), Q_MODE=q_mode, KV_MODE=kv_mode,
                         HAS_BIAS=bias, CAUSAL=causal, DOT_PRECISION=precision, HAS_KV_MASK=kv_mask,
                         HAS_UNIFORM=kv_mask, DROPOUT=dropout)
            for name, kernel, extra in (("fwd", T._fwd_kernel, {}), ("dkdv", T._bwd_dkdv_kernel, {}),
                                        ("dq", T._bwd_dq_kernel, {"BIAS_GRAD": bias})):
                compile_kernel(kernel, dtype, dict(flags, BLOCK_M=64, BLOCK_N=64, **extra), 4, 3)
                results.append([name, dtype, D, "compiled", None])
            compile_kernel(attention_triton.bwd_delta_kernel, dtype,
                           dict(HEAD_D=D, BLOCK_D=flags["BLOCK_D"], Q_MODE=q_mode, BLOCK_M=64), 4, 1)
            results.append(["delta", dtype, D, "compiled", None])
        for name, kernel, extra in (("fwd", T._fwd_kernel, {}), ("dkdv", T._bwd_dkdv_kernel, {}),
                                    ("dq", T._bwd_dq_kernel, {"BIAS_GRAD": True})):
            flags = dict(HEAD_D=128, BLOCK_D=128, Q_MODE=1, KV_MODE=1, HAS_BIAS=True, CAUSAL=True,
                         DOT_PRECISION="tf32", HAS_KV_MASK=name == "dkdv", HAS_UNIFORM=False, DROPOUT=True)
            compile_kernel(kernel, "bf16", dict(flags, BLOCK_M=64, BLOCK_N=64, USE_TMA=True, **extra), 4, 3)
            results.append([name + "-tma", "bf16", 128, "compiled", None])
        # the largest tile of each kernel that the autotuner offers at D = 128 must not spill registers
        flags = PLAIN_D128
        for name, kernel, shapes, extra in (("fwd", T._fwd_kernel, T._FWD_SHAPES, {}),
                                            ("dkdv", T._bwd_dkdv_kernel, T._DKDV_SHAPES, {}),
                                            ("dq", T._bwd_dq_kernel, T._DQ_SHAPES, {"BIAS_GRAD": False}),
                                            ("fwd-tma", T._fwd_kernel, T._FWD_TMA_SHAPES, {"USE_TMA": True}),
                                            ("dkdv-tma", T._bwd_dkdv_kernel, T._DKDV_TMA_SHAPES, {"USE_TMA": True}),
                                            ("dq-tma", T._bwd_dq_kernel, T._DQ_TMA_SHAPES,
                                             {"BIAS_GRAD": False, "USE_TMA": True})):
            large = [cfg for cfg, heads in shapes.items() if "large" in heads]
            m, n, w, s = max(large, key=lambda c: (c[0] * c[1], -c[2]))
            compiled = compile_kernel(kernel, "bf16", dict(flags, BLOCK_M=m, BLOCK_N=n, **extra), w, s)
            results.append([name, "bf16", 128, f"{m}x{n} w{w} s{s}", spill_bytes(compiled)])
        # the forward's q as the wgmma's A operand: from registers with A_REGS (common/attention_triton.in_registers),
        # else from shared memory; counted in the PTX (a register A operand is a {...} list after the accumulators)
        operands = {}
        for a_regs in (False, True):
            fwd_flags = dict(flags, HEAD_D=64, BLOCK_D=64, USE_TMA=True, BLOCK_M=64, BLOCK_N=64, A_REGS=a_regs)
            ptx = compile_kernel(T._fwd_kernel, "bf16", fwd_flags, 4, 3).asm["ptx"]
            wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
            operands[str(a_regs)] = [sum("}, {" in line for line in wgmma), len(wgmma)]
        print("OPERANDS " + json.dumps(operands))
    else:
        flags = PLAIN_D128
        # the warp-specialized forward and dK/dV (WS, common/warp_specialize.py): their loop splits into a
        # producer and two consumer warp groups (12 warps from num_warps=4), at the head dims each config serves,
        # causal, padded and packed
        for name, kernel, shapes in (("fwd", T._fwd_kernel, T._FWD_WS_SHAPES),
                                     ("dkdv", T._bwd_dkdv_kernel, T._DKDV_WS_SHAPES)):
            for (m, n, w, s), heads in shapes.items():
                for D in [d for d, head in ((64, "small"), (128, "large")) if head in heads]:
                    for causal, mode in ((False, 1), (True, 2)):
                        ws_flags = dict(flags, HEAD_D=D, BLOCK_D=D, CAUSAL=causal, Q_MODE=mode, KV_MODE=mode,
                                        USE_TMA=True, BLOCK_M=m, BLOCK_N=n, WS=True)
                        compiled = compile_kernel(kernel, "bf16", ws_flags, w, s)
                        results.append([f"{name}-ws-w{compiled.metadata.num_warps}", "bf16", D, f"{m}x{n} w{w} s{s}",
                                        spill_bytes(compiled)])
    print("RESULTS " + json.dumps(results))
    '''
)


def _compile(part: str):
    """Run SCRIPT's ``part`` in a child process without TRITON_INTERPRET -> (its stdout, its RESULTS rows)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, part], capture_output=True, text=True, env=env,
                          timeout=900)
    if proc.returncode != 0 and ("GPUTarget" in proc.stderr or "ASTSource" in proc.stderr):
        pytest.skip(f"this triton cannot compile ahead of time here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return proc.stdout, json.loads(line[len("RESULTS ") :])


def _assert_no_spill_over_64_bytes(results):
    spills = [r for r in results if r[3] != "compiled"]
    assert spills, "no autotune config checked for spills"
    for name, dtype, D, config, stack in spills:
        if stack is not None:
            assert stack <= 64, f"{name} {config} spills {stack} bytes at D={D}"


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    stdout, results = _compile("kernels")
    assert sum(r[3] == "compiled" for r in results) == 23
    assert {r[0] for r in results if r[3] != "compiled"} >= {"fwd-tma", "dkdv-tma", "dq-tma"}
    line = next(line for line in stdout.splitlines() if line.startswith("OPERANDS "))
    operands = json.loads(line[len("OPERANDS ") :])
    (regs_off, total_off), (regs_on, total_on) = operands["False"], operands["True"]
    assert total_on == total_off and regs_on == total_on and regs_off < total_off, operands
    _assert_no_spill_over_64_bytes(results)


@pytest.mark.slow
def test_warp_specialized_kernels_compile_for_sm90_without_spills():
    """The WS configs (off on the GPU, common/warp_specialize.py) still compile into a producer and two
    consumer groups."""
    _, results = _compile("warp_specialized")
    ws = [r for r in results if "-ws-" in r[0]]
    assert len(ws) == len(results) == 2 * 2 * 2 + 3 * 2, ws  # (config, head dim) pairs, causal or not
    assert all(r[0].endswith("-ws-w12") for r in ws), ws  # specialized: 12 warps
    _assert_no_spill_over_64_bytes(results)
