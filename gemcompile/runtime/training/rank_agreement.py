"""Every rank of `gemcompile train --parallel` must run the same configuration.

torchrun starts one process per rank, and nothing stops a launcher from giving them different flags (two
nodes started by different scripts). Ranks with another plan wait in different collectives until the
collective timeout (30 minutes by default); another --steps has one rank save while the others step;
another seed, lr or fill trains silently on a mix; another --checkpoint-dir splits one checkpoint over two
folders. So right after the process group is joined, before any other collective, the ranks exchange
their configuration (one all_gather_object, bounded by the collective timeout) and every rank stops with
the same one-line error naming each field they disagree on.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["check_ranks_agree", "configuration_fingerprint", "disagreement"]

_PER_RANK_FIELDS = ("quiet",)
"""TrainConfig fields that may differ: ranks other than 0 are made quiet anyway."""

_PARALLEL_PER_RANK_FIELDS = ("collective_timeout_s",)
"""ParallelConfig fields that may differ: the timeout only sets how long this rank waits."""

_PARALLEL_SIZE_FIELDS = ("dp_replicate", "dp_shard", "ep", "emb_outer", "emb_inner", "gpus_per_node")
"""Compared as the plan resolved them (a size given on one rank equal to another's default is the same
plan; a LOCAL_WORLD_SIZE that differs between nodes is not)."""


def configuration_fingerprint(cfg, axes) -> dict[str, Any]:
    """The fields every rank must share: the TrainConfig's (trajectory, steps, checkpoints, compile
    mode, ...), the ParallelConfig's and the plan's resolved axes (`axes`: a MeshAxes), by name."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in (*_PER_RANK_FIELDS, "parallel")}
    skipped = (*_PARALLEL_PER_RANK_FIELDS, *_PARALLEL_SIZE_FIELDS)
    fields.update({f.name: getattr(cfg.parallel, f.name) for f in dataclasses.fields(cfg.parallel)
                   if f.name not in skipped})
    fields.update({name: value for name, value in axes.as_dict().items() if name != "efsdp"})  # efsdp: derived
    if fields.get("checkpoint_dir") is not None:  # `ck`, `./ck` and `ck/` name one directory (by text alone:
        # on several nodes the same relative path may lie under other working directories, legitimately)
        fields["checkpoint_dir"] = os.path.normpath(fields["checkpoint_dir"])
    return fields


def _ranks_by_value(values: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """Each distinct value (by repr, which tells 1 from 1.0 and True) with the ranks holding it, in
    rank order."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), (value, []))[1].append(rank)
    return list(groups.values())


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def disagreement(fingerprints: Sequence[dict[str, Any]]) -> str | None:
    """None when every rank's fingerprint is the same, else one line naming each differing field and
    which ranks hold which value."""
    names = list(dict.fromkeys(name for fp in fingerprints for name in fp))
    missing = object()  # a field one rank's version of gemcompile does not have
    problems = []
    for name in names:
        groups = _ranks_by_value([fp.get(name, missing) for fp in fingerprints])
        if len(groups) > 1:
            held = [f"{'absent' if value is missing else repr(value)} on ranks {ranks}" for value, ranks in groups]
            problems.append(f"{name} is {_join(held)}")
    if not problems:
        return None
    return ("ranks disagree on the configuration: " + "; ".join(problems)
            + ": every rank must be launched with the same flags")


def check_ranks_agree(fingerprint: dict[str, Any]) -> None:
    """Exchange `fingerprint` with every rank (a collective: call it on all of them, first); a ValueError
    on every rank when they differ."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fingerprint)
    problem = disagreement(gathered)
    if problem is not None:
        error = ValueError(problem)
        error.same_on_every_rank = True  # every rank gathered the same fingerprints: rank 0 says it
        raise error
