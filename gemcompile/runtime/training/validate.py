"""validate_batch: check a GemBatch at the model's input boundary, before the (compiled) model runs.

A bad id or length otherwise surfaces as an index error deep inside an embedding kernel, a CUDA
device-side assert, or silently wrong numbers (a length past the padded end attends to padding). The
check runs once per step outside the compiled region, so the compiled graph stays free of
data-dependent asserts. All range checks are reduced on the batch's device and read back with a
single host sync; only when something is wrong is more work done, to name the offending sample.

Every failure raises ValueError naming the input, the offending sample index and the allowed range.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["validate_batch"]

_INT_DTYPES = (torch.int64, torch.int32)


def _fail(message: str) -> None:
    raise ValueError(f"invalid batch: {message}")


def _check_tensor(
    name: str, value: Any, shape: tuple[int | None, ...], integer: bool, device: torch.device | None
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
        _fail(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    if integer and value.dtype not in _INT_DTYPES:
        _fail(f"{name} must be an int64 (or int32) tensor, got {value.dtype}")
    if not integer and not value.dtype.is_floating_point:
        _fail(f"{name} must be a floating-point tensor, got {value.dtype}")
    if device is not None and value.device != device:
        _fail(
            f"{name} is on {value.device}, but the batch is on {device} (every tensor must be on one device)"
        )
    return value


def _check_list(name: str, value: Any, n_seq: int) -> list:
    if not isinstance(value, (list, tuple)):
        _fail(f"{name} must be a list of {n_seq} tensors (one per sequence type), got {type(value).__name__}")
    if len(value) != n_seq:
        _fail(f"{name} has {len(value)} sequence types, the model expects {n_seq}")
    return list(value)


def _first_bad_sample(bad: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """(sample index, full index) of the first True entry of a (B, ...) boolean tensor."""
    index = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
    return index[0], index


def validate_batch(batch: Any, model_cfg: Any) -> None:
    """Raise ValueError if `batch` (a GemBatch) does not fit the model described by `model_cfg`.

    Checks: number of sequence types; shapes and dtypes of every input; one device; lengths in
    [0, N_k] with N_k the padded length of sequence k (seq_items[k].shape[1], at most the model's
    seq_max_lens[k]); sparse ids in [0, table_rows); item ids in [0, item_vocab); actions in
    [0, n_actions); domain in [0, n_domains); dense floats and event ages finite (ages >= 0); labels
    finite in [0, 1] with a boolean label_mask.
    """
    inputs = _checked_inputs(batch, model_cfg)
    ranges, finite = _value_checks(inputs, model_cfg)
    _check_values(ranges, finite)


class _Inputs(NamedTuple):
    """The batch's tensors, their shapes, dtypes and device checked."""

    dense: torch.Tensor
    sparse_ids: torch.Tensor
    domain: torch.Tensor
    items: list[torch.Tensor]
    actions: list[torch.Tensor]
    times: list[torch.Tensor]
    lengths: list[torch.Tensor]
    padded: list[int]
    """N_k per sequence type."""
    labels: torch.Tensor | None


def _checked_inputs(batch: Any, cfg: Any) -> _Inputs:
    """Every input's type, shape, dtype and device (no value read)."""
    for attr in ("sparse_ids", "dense", "seq_items", "seq_actions", "seq_times", "seq_lengths", "domain"):
        if not hasattr(batch, attr):
            _fail(f"expected a GemBatch with field {attr!r}, got {type(batch).__name__}")
    n_seq = len(cfg.seq_max_lens)
    dense = batch.dense
    if not isinstance(dense, torch.Tensor) or dense.dim() != 2:
        _fail(
            f"dense must be a (B, {cfg.n_dense}) tensor, got "
            f"{tuple(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__}"
        )
    b, device = dense.shape[0], dense.device
    if b < 1:
        _fail("the batch is empty (dense.shape[0] == 0)")
    _check_tensor("dense", dense, (b, cfg.n_dense), integer=False, device=device)
    sparse_ids = _check_tensor("sparse_ids", batch.sparse_ids, (b, cfg.n_tables, cfg.max_hot), True, device)
    domain = _check_tensor("domain", batch.domain, (b,), True, device)
    items = _check_list("seq_items", batch.seq_items, n_seq)
    actions = _check_list("seq_actions", batch.seq_actions, n_seq)
    times = _check_list("seq_times", batch.seq_times, n_seq)
    lengths = _check_list("seq_lengths", batch.seq_lengths, n_seq)
    padded = []
    for k in range(n_seq):
        it = items[k]
        if not isinstance(it, torch.Tensor) or it.dim() != 2:
            _fail(
                f"seq_items[{k}] must be a (B, N_{k}) tensor, got "
                f"{tuple(it.shape) if isinstance(it, torch.Tensor) else type(it).__name__}"
            )
        n_k = it.shape[1]
        if not 1 <= n_k <= cfg.seq_max_lens[k]:
            _fail(
                f"seq_items[{k}] has padded length N_{k} = {n_k}, allowed range [1, {cfg.seq_max_lens[k]}] "
                f"(the model's seq_max_lens[{k}])"
            )
        _check_tensor(f"seq_items[{k}]", it, (b, n_k), True, device)
        _check_tensor(f"seq_actions[{k}]", actions[k], (b, n_k), True, device)
        _check_tensor(f"seq_times[{k}]", times[k], (b, n_k), False, device)
        _check_tensor(f"seq_lengths[{k}]", lengths[k], (b,), True, device)
        padded.append(n_k)
    labels = getattr(batch, "labels", None)
    label_mask = getattr(batch, "label_mask", None)
    if labels is not None:
        _check_tensor("labels", labels, (b, cfg.n_tasks), False, device)
        if not isinstance(label_mask, torch.Tensor) or label_mask.dtype != torch.bool:
            _fail(f"label_mask must be a bool tensor of shape ({b}, {cfg.n_tasks})")
        if tuple(label_mask.shape) != (b, cfg.n_tasks) or label_mask.device != device:
            _fail(
                f"label_mask must have shape ({b}, {cfg.n_tasks}) on {device}, got {tuple(label_mask.shape)} "
                f"on {label_mask.device}"
            )
    return _Inputs(dense, sparse_ids, domain, items, actions, times, lengths, padded, labels)


def _value_checks(inputs: _Inputs, cfg: Any) -> tuple[list[tuple[str, torch.Tensor, float, float, str]],
                                                       list[tuple[str, torch.Tensor]]]:
    """(name, tensor, low, high, what the range is) of every range check (values must lie in [low, high]),
    and (name, tensor) of every finiteness check."""
    ranges: list[tuple[str, torch.Tensor, float, float, str]] = [
        ("sparse_ids", inputs.sparse_ids, 0, cfg.table_rows - 1,
         f"table_rows = {cfg.table_rows}, 0 = padding"),
        ("domain", inputs.domain, 0, cfg.n_domains - 1, f"n_domains = {cfg.n_domains}"),
    ]
    for k, n_k in enumerate(inputs.padded):
        ranges += [
            (f"seq_lengths[{k}]", inputs.lengths[k], 0, n_k,
             f"the padded length N_{k} = seq_items[{k}].shape[1]"),
            (f"seq_items[{k}]", inputs.items[k], 0, cfg.item_vocab - 1,
             f"item_vocab = {cfg.item_vocab}, 0 = padding"),
            (f"seq_actions[{k}]", inputs.actions[k], 0, cfg.n_actions - 1, f"n_actions = {cfg.n_actions}"),
            (f"seq_times[{k}]", inputs.times[k], 0.0, float("inf"), "event age in seconds, finite and >= 0"),
        ]
    finite = [("dense", inputs.dense)] + [(f"seq_times[{k}]", t) for k, t in enumerate(inputs.times)]
    if inputs.labels is not None:
        ranges.append(("labels", inputs.labels, 0.0, 1.0, "a probability"))
        finite.append(("labels", inputs.labels))
    return ranges, finite


def _check_values(ranges: list[tuple[str, torch.Tensor, float, float, str]],
                  finite: list[tuple[str, torch.Tensor]]) -> None:
    """One reduction per check, one host sync for all of them; the first failure named in full."""
    flags = [((t < low) | (t > high)).any() for _, t, low, high, _ in ranges]
    flags += [(~torch.isfinite(t)).any() for _, t in finite]
    failed = torch.stack(flags).tolist()
    if not any(failed):
        return
    for (name, t), bad in zip(finite, failed[len(ranges) :]):
        if bad:
            sample, index = _first_bad_sample(~torch.isfinite(t))
            _fail(
                f"{name} has a non-finite value {t[index].item()} at sample {sample} (index {list(index)}); "
                f"values must be finite"
            )
    for (name, t, low, high, why), bad in zip(ranges, failed[: len(ranges)]):
        if bad:
            sample, index = _first_bad_sample((t < low) | (t > high))
            value = t[index].item()
            allowed = f"[{low}, {high}]" if high != float("inf") else f">= {low}"
            position = f" (index {list(index)})" if len(index) > 1 else ""
            _fail(f"{name} has value {value} at sample {sample}{position}, allowed range {allowed} ({why})")
