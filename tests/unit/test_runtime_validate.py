"""runtime/training/validate.py: every bad input is a clear ValueError naming the input, sample and range."""

import pytest
import torch

from gemcompile.models.data import SyntheticData
from gemcompile.models.gem import gem_ref_config
from gemcompile.runtime.training.validate import validate_batch

CFG = gem_ref_config("tiny")
B = 6
N0, N1 = CFG.seq_max_lens[:2]


@pytest.fixture(scope="module")
def clean_batch():
    return SyntheticData(CFG.data_config(B)).batch(0)


def _copy(batch):
    from dataclasses import fields

    def clone(v):
        return [t.clone() for t in v] if isinstance(v, list) else v.clone()

    return type(batch)(**{f.name: clone(getattr(batch, f.name)) for f in fields(batch)})


def _set(attr, index, value):
    def mutate(b):
        target = getattr(b, attr)
        if isinstance(target, list):
            k, rest = index[0], index[1:]
            target[k][rest] = value
        else:
            target[index] = value

    return mutate


def _replace(attr, make):
    def mutate(b):
        setattr(b, attr, make(b))

    return mutate


CASES = [
    # (id, mutation, regex the message must match)
    (
        "length_too_long",
        _set("seq_lengths", (1, 4), CFG.seq_max_lens[1] + 1),
        rf"seq_lengths\[1\] has value {N1 + 1} at sample 4, allowed range \[0, {N1}\]",
    ),
    (
        "length_negative",
        _set("seq_lengths", (0, 2), -1),
        rf"seq_lengths\[0\] has value -1 at sample 2, allowed range \[0, {N0}\]",
    ),
    (
        "item_out_of_vocab",
        _set("seq_items", (0, 3, 5), CFG.item_vocab),
        rf"seq_items\[0\] has value {CFG.item_vocab} at sample 3 .*allowed range \[0, {CFG.item_vocab - 1}\]",
    ),
    ("item_negative", _set("seq_items", (1, 0, 0), -3), r"seq_items\[1\] has value -3 at sample 0"),
    (
        "action_out_of_range",
        _set("seq_actions", (0, 1, 0), CFG.n_actions),
        rf"seq_actions\[0\] has value {CFG.n_actions} at sample 1 .*allowed range \[0, {CFG.n_actions - 1}\]",
    ),
    (
        "sparse_id_too_big",
        _set("sparse_ids", (5, 1, 0), CFG.table_rows),
        (
            rf"sparse_ids has value {CFG.table_rows} at sample 5 \(index \[5, 1, 0\]\), "
            rf"allowed range \[0, {CFG.table_rows - 1}\]"
        ),
    ),
    (
        "domain_out_of_range",
        _set("domain", (2,), CFG.n_domains),
        rf"domain has value {CFG.n_domains} at sample 2, allowed range \[0, {CFG.n_domains - 1}\]",
    ),
    ("dense_nan", _set("dense", (4, 0), float("nan")), r"dense has a non-finite value nan at sample 4"),
    ("dense_inf", _set("dense", (1, 3), float("inf")), r"dense has a non-finite value inf at sample 1"),
    (
        "time_nan",
        _set("seq_times", (1, 3, 0), float("nan")),
        r"seq_times\[1\] has a non-finite value nan at sample 3",
    ),
    ("time_negative", _set("seq_times", (0, 2, 0), -5.0), r"seq_times\[0\] has value -5.0 at sample 2"),
    ("label_out_of_range", _set("labels", (0, 0), 2.0), r"labels has value 2.0 at sample 0"),
    (
        "too_few_sequence_types",
        _replace("seq_lengths", lambda b: b.seq_lengths[:1]),
        rf"seq_lengths has 1 sequence types, the model expects {CFG.n_seq}",
    ),
    (
        "too_many_sequence_types",
        _replace("seq_items", lambda b: b.seq_items + b.seq_items[:1]),
        rf"seq_items has {CFG.n_seq + 1} sequence types, the model expects {CFG.n_seq}",
    ),
    (
        "seq_not_a_list",
        _replace("seq_times", lambda b: b.seq_times[0]),
        rf"seq_times must be a list of {CFG.n_seq} tensors",
    ),
    (
        "dense_wrong_width",
        _replace("dense", lambda b: b.dense[:, :3]),
        rf"dense must have shape \({B}, {CFG.n_dense}\), got \({B}, 3\)",
    ),
    (
        "sparse_wrong_tables",
        _replace("sparse_ids", lambda b: b.sparse_ids[:, :2]),
        rf"sparse_ids must have shape \({B}, {CFG.n_tables}, {CFG.max_hot}\), got \({B}, 2, {CFG.max_hot}\)",
    ),
    (
        "lengths_wrong_batch",
        _replace("seq_lengths", lambda b: [b.seq_lengths[0][:4], b.seq_lengths[1]]),
        rf"seq_lengths\[0\] must have shape \({B}\), got \(4,\)",
    ),
    (
        "actions_wrong_length",
        _replace("seq_actions", lambda b: [b.seq_actions[0][:, :10], b.seq_actions[1]]),
        rf"seq_actions\[0\] must have shape \({B}, {N0}\), got \({B}, 10\)",
    ),
    (
        "padded_longer_than_model",
        _replace("seq_items", lambda b: [torch.zeros(B, N0 + 1, dtype=torch.int64), b.seq_items[1]]),
        rf"seq_items\[0\] has padded length N_0 = {N0 + 1}, allowed range \[1, {N0}\]",
    ),
    ("float_ids", _replace("sparse_ids", lambda b: b.sparse_ids.float()), r"sparse_ids must be an int64"),
    ("int_dense", _replace("dense", lambda b: b.dense.long()), r"dense must be a floating-point tensor"),
    (
        "mask_not_bool",
        _replace("label_mask", lambda b: b.label_mask.float()),
        r"label_mask must be a bool tensor",
    ),
    (
        "domain_wrong_shape",
        _replace("domain", lambda b: b.domain[:, None]),
        rf"domain must have shape \({B}\)",
    ),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_value_error(clean_batch, mutate, message):
    batch = _copy(clean_batch)
    mutate(batch)
    with pytest.raises(ValueError, match=message) as info:
        validate_batch(batch, CFG)
    assert str(info.value).startswith("invalid batch: ")


def test_clean_batch_passes(clean_batch):
    validate_batch(clean_batch, CFG)


def test_lengths_at_the_bounds_pass(clean_batch):
    batch = _copy(clean_batch)
    batch.seq_lengths[0][0] = 0
    batch.seq_lengths[0][1] = CFG.seq_max_lens[0]
    validate_batch(batch, CFG)


def test_shorter_bucketed_padding_is_accepted(clean_batch):
    # A batch padded to a smaller bucket than the model's maximum is fine; its lengths are checked
    # against its own padded length.
    batch = _copy(clean_batch)
    n = 16
    batch.seq_lengths[0] = batch.seq_lengths[0].clamp(max=n)
    for name in ("seq_items", "seq_actions", "seq_times"):
        getattr(batch, name)[0] = getattr(batch, name)[0][:, :n].contiguous()
    validate_batch(batch, CFG)
    batch.seq_lengths[0][3] = n + 1
    with pytest.raises(
        ValueError, match=rf"seq_lengths\[0\] has value {n + 1} at sample 3, allowed range \[0, {n}\]"
    ):
        validate_batch(batch, CFG)


def test_not_a_batch():
    with pytest.raises(ValueError, match="expected a GemBatch"):
        validate_batch({"dense": torch.zeros(2, 8)}, CFG)
