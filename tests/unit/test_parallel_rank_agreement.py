"""runtime/training/rank_agreement.py: what the ranks of `train --parallel` must share, and the one line
that names where they differ (the exchange itself runs under torchrun:
tests/integration/test_parallel_rank_agreement.py)."""

import dataclasses

import pytest

from gemcompile.config import ParallelConfig
from gemcompile.runtime.distributed.plan import resolve_axes
from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.rank_agreement import configuration_fingerprint, disagreement


def _fingerprint(parallel=None, world=2, **fields):
    parallel = ParallelConfig(enabled=True, gpus_per_node=world, **(parallel or {}))
    cfg = TrainConfig(batch_size=16, parallel=parallel, **fields)
    return configuration_fingerprint(cfg, resolve_axes(parallel, world))


def test_the_fingerprint_holds_the_trajectory_steps_checkpoints_and_the_resolved_plan():
    fp = _fingerprint(steps=3, checkpoint_dir="ck", parallel={"emb_outer": 2})
    for name in ("seed", "lr", "fill", "grad_clip", "batch_size", "steps", "checkpoint_dir", "save_every",
                 "resume", "compile", "embedding_sharding", "world_size", "dp_shard", "emb_outer", "emb_inner"):
        assert name in fp, name
    assert (fp["steps"], fp["checkpoint_dir"], fp["emb_outer"], fp["emb_inner"]) == (3, "ck", 2, 1)
    assert "quiet" not in fp and "collective_timeout_s" not in fp  # may differ per rank


def test_ranks_that_agree_pass_and_per_rank_fields_may_differ():
    assert disagreement([_fingerprint(quiet=False), _fingerprint(quiet=True)]) is None
    # a size given on one rank that equals the others' default is the same plan
    assert disagreement([_fingerprint(), _fingerprint(parallel={"emb_inner": 2})]) is None
    assert disagreement([_fingerprint(parallel={"collective_timeout_s": 5}), _fingerprint()]) is None
    # one directory spelled three ways (it was a disagreement by text)
    assert disagreement([_fingerprint(checkpoint_dir=d) for d in ("ck", "./ck", "ck/")]) is None


def test_each_differing_field_is_named_with_the_ranks_that_hold_each_value():
    ranks = [_fingerprint(), _fingerprint(seed=1), _fingerprint(), _fingerprint(seed=2, checkpoint_dir="b")]
    assert disagreement(ranks) == (
        "ranks disagree on the configuration: seed is 0 on ranks [0, 2], 1 on ranks [1] and 2 on ranks [3]; "
        "checkpoint_dir is None on ranks [0, 1, 2] and 'b' on ranks [3]: every rank must be launched with the "
        "same flags")


def test_the_plan_and_the_number_of_steps_must_agree():
    line = disagreement([_fingerprint(steps=3), _fingerprint(steps=2, parallel={"emb_outer": 2})])
    assert "steps is 3 on ranks [0] and 2 on ranks [1]" in line
    assert "emb_outer is 1 on ranks [0] and 2 on ranks [1]" in line
    assert "\n" not in line


def test_a_field_only_some_ranks_have_is_a_disagreement():
    other = dict(_fingerprint(), new_field=1)
    assert "new_field is absent on ranks [0] and 1 on ranks [1]" in disagreement([_fingerprint(), other])


def test_every_train_config_field_but_the_per_rank_ones_is_compared():
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"quiet", "parallel"}
    assert names <= set(_fingerprint())


@pytest.mark.parametrize("env, message", [
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK = 1 is invalid for WORLD_SIZE = 1"),  # waited 30 min for rank 0
    ({"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE = -2 is invalid"),  # was called "no WORLD_SIZE"
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE = 'abc' is invalid: expected an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "abc"}, "MASTER_PORT = 'abc' is invalid: expected an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, r"MASTER_PORT = 70000 is invalid: expected a TCP port"),
])
def test_a_launch_environment_that_cannot_rendezvous_is_refused_before_joining(monkeypatch, env, message):
    from gemcompile.runtime.training.parallel import ParallelTraining

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ParallelTraining.start(None)  # before the configuration is read
