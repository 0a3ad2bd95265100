"""Inductor's C++ kernels without SIMD in test processes (the pytest process and the torchrun test worker).

The tests check what gemcompile's passes and ops compute against eager, not Inductor's vectorizer, and on
tiny tensors the vector code only costs compile time (GEM-ref tiny's compiled test: 181 s with it, 139 s
without; the world-2 gem_compile test 203 -> 149 s, on a 2-core machine). GEMCOMPILE_TEST_CPP_SIMD=1 keeps
Inductor's default. Other subprocesses (the CLI) keep the default.
"""
import os


def compile_cpp_without_simd() -> None:
    if os.environ.get("GEMCOMPILE_TEST_CPP_SIMD", "0") != "1":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = 0
