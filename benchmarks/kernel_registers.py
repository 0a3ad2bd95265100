"""Registers, spills and shared memory of the jagged attention kernels per tile config, compiled for
sm_90a on the CPU (no GPU: Triton's compiler and its ptxas), and whether ptxas serialized the wgmma.

Why: at head dim 128 the forward and dK/dV kernels run one CTA per SM (issue 25); capping registers
(``maxnreg``) to fit two would only pay if ptxas neither spills nor serializes the wgmma under the cap.

    python benchmarks/kernel_registers.py [--out DIR]
    python benchmarks/kernel_registers.py --kernels block-closed [--out DIR]
    python benchmarks/kernel_registers.py --kernels jagged-ws [--head-dim 64|128] [--out DIR]

``--kernels jagged-ws``: the jagged forward's and dK/dV's warp-specialized configs (WS=True,
common/warp_specialize.py), each at the head dim, causal or not: the warps the compiled kernel runs (12 when
Triton split the loop into a producer and two consumer groups), registers, spills, shared memory, and
whether the PTX sets per-group register counts (setmaxnreg).

``--kernels block-closed``: block attention's closed kernels (one tile per 64-token block, packed layout,
q_lengths), every closed config of the head dim's class, with and without the fused rotate-half rotary
(fp32 tables, as GEM-ref builds them), plus the barriers (bar.sync) in the PTX: the layout changes through
shared memory that splitting tiles into halves cost; and the PTX's global load instructions (cp.async
copies into shared memory, ld.global into registers): the tiles a program fetches; and the warp shuffles
(shfl.sync) and ld.shared / st.shared instructions: data moved between threads.

Each kernel is compiled as a launch specializes it (unit head-dim strides, 16-divisible pointers and
strides), bf16, not causal, no bias, without TRITON_INTERPRET; ptxas -v is run on the PTX.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("benchmarks/kernel_registers.py compiles real kernels: run it without TRITON_INTERPRET=1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from harness import environment, write_json  # noqa: E402

from gemcompile.lowering.jagged_attention import triton as jagged  # noqa: E402

CONFIGS = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, the lists' D 128 entries and neighbours
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 3)],
    "dkdv": [(32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
}
KERNELS = {"fwd": jagged._fwd_kernel, "dkdv": jagged._bwd_dkdv_kernel, "dq": jagged._bwd_dq_kernel}
POINTERS = {
    "Q": "*bf16",
    "K": "*bf16",
    "V": "*bf16",
    "Bias": "*bf16",
    "DO": "*bf16",
    "Out": "*bf16",
    "DQ": "*bf16",
    "DK": "*bf16",
    "DV": "*bf16",
    "DS": "*fp32",
    "Lse": "*fp32",
    "Delta": "*fp32",
    "GradLse": "*fp32",
    "KVMask": "*u8",
    "KVBounds": "*i32",
    "Uniform": "*u8",
    "Seed": "*i64",
    "QOffsets": "*i64",
    "QLengths": "*i64",
    "KVOffsets": "*i64",
    "KVLengths": "*i64",
    "Order": "*i64",
}


def _jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # through the autotuner
        kernel = kernel.fn
    return kernel


def compile_sm90(kernel, constexprs: dict, warps: int, stages: int, maxnreg: int | None, types: dict | None = None):
    """``types``: signature types beyond POINTERS (the forward's TMA descriptors)."""
    fn = _jit(kernel)
    types = {**POINTERS, **(types or {})}
    consts = dict(constexprs)
    # constexpr parameters left at their defaults (as a launch leaves them), not compiled as runtime args
    consts.update({p.name: p.default for p in fn.params
                   if p.is_constexpr and p.has_default and p.name not in consts})
    consts.update(
        {
            n: 1
            for n in fn.arg_names
            if n.startswith("stride_")
            and n not in consts
            and (n.endswith("d") or n in ("stride_zn", "stride_mn", "stride_lm"))
        }
    )
    sig = {
        n: "constexpr" if n in consts else types.get(n, "fp32" if "scale" in n else "i32")
        for n in fn.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride_") or n.endswith("BUCKET")))
    }
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options
    )


def ptxas_report(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        done = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spill.group(1)) if spill else 0,
        "wgmma_serialized": bool(re.search(r"wgmma.*serializ", log, re.IGNORECASE)),
    }


def block_closed_rows(head_dim: int) -> list[dict]:
    """One row per (kernel, rotary, closed config) of block attention's closed kernels at this head dim."""
    from gemcompile.lowering.block_attention import triton as block

    POINTERS.update({"Cos": "*fp32", "Sin": "*fp32", "Lengths": "*i64", "KvMask": "*u8", "KvRange": "*i32",
                     "QLengths": "*i64", "Offsets": "*i64"})
    rows = []
    for name, kernel, shapes in (("closed_fwd", block._closed_fwd_kernel, block._CLOSED_FWD_SHAPES),
                                 ("closed_bwd", block._closed_bwd_kernel, block._CLOSED_BWD_SHAPES)):
        for rotary in ("none", "half"):
            variant = block._variant(head_dim, block.ROTARY_CODES[rotary])
            served = {shape: () for shape, kinds in shapes.items() if variant in kinds}
            for config in block._closed_configs(served):
                consts = dict(HEAD_D=head_dim, ATTN_BLOCK=64, HAS_WINDOW=False, CAUSAL=False,
                              ROTARY=block.ROTARY_CODES[rotary], DOT_PRECISION="tf32", HAS_KV_MASK=False,
                              HAS_Q_LENGTHS=True, PACKED=True, **config.kwargs)
                row = {"kernel": name, "rotary": rotary, **config.kwargs, "num_warps": config.num_warps,
                       "num_stages": config.num_stages}
                try:
                    compiled = compile_sm90(kernel, consts, config.num_warps, config.num_stages, None)
                    ptx = compiled.asm["ptx"]
                    row.update(ptxas_report(ptx), shared_bytes=compiled.metadata.shared,
                               barriers=len(re.findall(r"bar\.sync", ptx)),
                               # global loads in the PTX: asynchronous copies into shared memory (cp.async,
                               # the pipelined tiles) and loads into registers
                               cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
                               ld_global=len(re.findall(r"ld\.global", ptx)),
                               # register shuffles between threads (a tl.gather across the head dim) and
                               # shared-memory traffic outside the copies and the dots' own operands
                               shfl=len(re.findall(r"shfl\.sync", ptx)),
                               ld_shared=len(re.findall(r"ld\.shared", ptx)),
                               st_shared=len(re.findall(r"st\.shared", ptx)))
                except Exception as e:  # noqa: BLE001  a refused config is recorded; the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(row, flush=True)
    return rows


def jagged_ws_rows(head_dim: int) -> list[dict]:
    """One row per (kernel, WS config, causal) of the jagged kernels' warp-specialized configs."""
    head = "small" if head_dim <= 64 else "large"
    rows = []
    for name, shapes, boxes in (("fwd", jagged._FWD_WS_SHAPES, ("QDesc", "KDesc", "VDesc")),
                                ("dkdv", jagged._DKDV_WS_SHAPES, ("QDesc", "DODesc"))):
        for (m, n, warps, stages), heads in shapes.items():
            if head not in heads:
                continue
            for causal in (False, True):
                consts = dict(HEAD_D=head_dim, BLOCK_D=head_dim, Q_MODE=1, KV_MODE=1, HAS_BIAS=False,
                              CAUSAL=causal, DOT_PRECISION="tf32", HAS_KV_MASK=False, HAS_UNIFORM=False,
                              DROPOUT=False, USE_TMA=True, WS=True, BLOCK_M=m, BLOCK_N=n)
                # the host descriptors a TMA launch passes (unused by the WS loop, which makes its own)
                box = {"QDesc": m, "KDesc": n, "VDesc": n, "DODesc": m}
                types = {d: f"tensordesc<bf16[1,1,{box[d]},{head_dim}]>" for d in boxes}
                row = {"kernel": name + "-ws", "causal": causal, "BLOCK_M": m, "BLOCK_N": n,
                       "num_warps": warps, "num_stages": stages}
                try:
                    compiled = compile_sm90(KERNELS[name], consts, warps, stages, None, types)
                    ptx = compiled.asm["ptx"]
                    row.update(ptxas_report(ptx), shared_bytes=compiled.metadata.shared,
                               compiled_warps=compiled.metadata.num_warps, setmaxnreg="setmaxnreg" in ptx)
                except Exception as e:  # noqa: BLE001  a config this compiler refuses: recorded
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kernels", default="jagged", choices=["jagged", "jagged-ws", "block-closed"])
    parser.add_argument("--dropout", action="store_true", help="the jagged kernels with attention dropout")
    args = parser.parse_args()
    rows_of = {"jagged-ws": jagged_ws_rows, "block-closed": block_closed_rows}
    if args.kernels in rows_of:  # one file of rows per kernel family and head dim
        print(write_json(f"kernel_registers-{args.kernels}-d{args.head_dim}",
                         {"benchmark": "kernel_registers", "environment": environment(),
                          "target": "sm_90a (compiled on the CPU)", "kernels": args.kernels,
                          "rows": rows_of[args.kernels](args.head_dim)}, args.out))
        return
    base = dict(
        HEAD_D=args.head_dim,
        BLOCK_D=args.head_dim,
        Q_MODE=1,
        KV_MODE=1,
        HAS_BIAS=False,
        CAUSAL=False,
        DOT_PRECISION="tf32",
        HAS_KV_MASK=False,
        HAS_UNIFORM=False,
        DROPOUT=args.dropout,
    )
    rows = []
    variants = [(name, tma) for name in CONFIGS for tma in (False, True)]
    for name, tma in variants:
        for m, n, warps, stages in CONFIGS[name]:
            for maxnreg in (None, 168, 128):
                consts = dict(base, BLOCK_M=m, BLOCK_N=n, **({"BIAS_GRAD": False} if name == "dq" else {}))
                # pointer loads (no descriptors) or the TMA loads of the streamed tiles (ragged descriptors
                # whose boxes are the config's tile rows)
                consts["USE_TMA"] = tma
                boxes = {"fwd": {"QDesc": m, "KDesc": n, "VDesc": n}, "dkdv": {"QDesc": m, "DODesc": m},
                         "dq": {"KDesc": n, "VDesc": n}}[name]
                types = None
                if tma:
                    types = {d: f"tensordesc<bf16[1,1,{rows_},{args.head_dim}]>" for d, rows_ in boxes.items()}
                else:
                    consts.update(dict.fromkeys(boxes))
                row = {
                    "kernel": name + ("-tma" if tma else ""),
                    "BLOCK_M": m,
                    "BLOCK_N": n,
                    "num_warps": warps,
                    "num_stages": stages,
                    "maxnreg": maxnreg,
                }
                try:
                    compiled = compile_sm90(KERNELS[name], consts, warps, stages, maxnreg, types)
                    row.update(ptxas_report(compiled.asm["ptx"]), shared_bytes=compiled.metadata.shared)
                except Exception as e:  # noqa: BLE001  a config this compiler refuses: recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(row, flush=True)
    print(
        write_json(
            f"kernel_registers-d{args.head_dim}" + ("-dropout" if args.dropout else ""),
            {
                "benchmark": "kernel_registers",
                "environment": environment(),
                "target": "sm_90a (compiled on the CPU)",
                "dropout": args.dropout,
                "rows": rows,
            },
            args.out,
        )
    )


if __name__ == "__main__":
    main()
