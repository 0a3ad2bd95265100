"""CUDA-graph captures while training: under ``mode="reduce-overhead"`` CUDA-graph trees record a graph for
each new combination of a partition's dynamic sizes (GEM-ref: both sequences' packed token counts, bucketed
by UnpadConfig.token_buckets), and a capture inside a measured step costs it a warm-up run and a recording.
The e2e benchmark records them per step, as it records Triton JIT compiles (triton_compiles.py).

Through ``torch.cuda.CUDAGraph.capture_begin``, which ``torch.cuda.graph`` (what CUDA-graph trees capture
with) calls for every capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["recording_graph_captures"]


@contextlib.contextmanager
def recording_graph_captures(log: list[int]) -> Iterator[list[int]]:
    """Append 1 to ``log`` for every CUDA-graph capture that begins inside the block."""
    graph_class = torch.cuda.CUDAGraph
    original = graph_class.capture_begin

    def capture_begin(self, *args, **kwargs):
        log.append(1)
        return original(self, *args, **kwargs)

    graph_class.capture_begin = capture_begin
    try:
        yield log
    finally:
        graph_class.capture_begin = original
