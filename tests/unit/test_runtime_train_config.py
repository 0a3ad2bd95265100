"""runtime/training/config.py, flags.py: TrainConfig validation and `gemcompile train` argument parsing."""

import argparse

import pytest

from gemcompile.config import ParallelConfig
from gemcompile.runtime.training.config import DEFAULT_BATCH_SIZE, TrainConfig
from gemcompile.runtime.training.flags import add_train_arguments, config_from_args


def test_defaults():
    cfg = TrainConfig()
    assert (cfg.size, cfg.steps, cfg.compile, cfg.device, cfg.dtype) == (
        "tiny",
        50,
        "eager",
        "cpu",
        "float32",
    )
    assert cfg.batch_size == DEFAULT_BATCH_SIZE["tiny"] == 64
    assert TrainConfig(size="small").batch_size == 256
    assert TrainConfig(batch_size=8).batch_size == 8


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("size", "huge", r"TrainConfig.size = 'huge' is invalid: expected one of tiny, small, medium, large"),
        ("steps", 0, r"TrainConfig.steps = 0 is invalid: expected an int in \[1, 2\*\*63\)"),
        ("steps", 2.5, r"TrainConfig.steps = 2.5"),
        ("batch_size", -4, r"TrainConfig.batch_size = -4"),
        ("lr", 0.0, r"TrainConfig.lr = 0.0 is invalid: expected a float > 0, at most 1e\+30"),
        ("lr", float("nan"), r"TrainConfig.lr = nan"),
        ("lr", 1e39, r"TrainConfig.lr = 1e\+39 is invalid"),  # finite in Python, inf in the fp32 optimizer
        ("lr", 1e38, r"TrainConfig.lr = 1e\+38 is invalid"),  # float32 holds it, Adam's first step (x 10) not
        ("embedding_lr", float("inf"), r"TrainConfig.embedding_lr = inf"),
        (
            "compile",
            "tensorrt",
            r"TrainConfig.compile = 'tensorrt' is invalid: expected one of eager, inductor, gem",
        ),
        ("device", "mps", r"TrainConfig.device = 'mps'"),
        ("dtype", "float16", r"TrainConfig.dtype = 'float16' is invalid: expected one of float32, bfloat16"),
        ("fill", 1.5, r"TrainConfig.fill = 1.5 is invalid: expected a float in \(0, 1\]"),
        ("fill", 0, r"TrainConfig.fill = 0"),
        ("length_dist", "zipf", r"TrainConfig.length_dist = 'zipf'"),
        ("seed", -1, r"TrainConfig.seed = -1"),
        ("seed", 2**63, r"TrainConfig.seed = 9223372036854775808 is invalid: expected an int in \[0, 2"),
        ("log_every", 0, r"TrainConfig.log_every = 0"),
        # past a signed 64-bit int: an OverflowError in a deque's maxlen, or torch's "Overflow when unpacking"
        ("log_every", 2**63, r"TrainConfig.log_every = 9223372036854775808 is invalid: expected an int in \[1, 2"),
        ("batch_size", 10**20, r"TrainConfig.batch_size = 100000000000000000000 is invalid"),
        ("save_every", 2**63, r"TrainConfig.save_every = 9223372036854775808 is invalid"),
        ("resume", "yes", r"TrainConfig.resume = 'yes' is invalid: expected a bool"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_combinations():
    with pytest.raises(ValueError, match="save_every needs TrainConfig.checkpoint_dir"):
        TrainConfig(save_every=5)
    with pytest.raises(ValueError, match="resume = True needs TrainConfig.checkpoint_dir"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match="explain = True needs compile='gem'"):
        TrainConfig(explain=True)
    TrainConfig(explain=True, compile="gem")
    TrainConfig(save_every=5, checkpoint_dir="/tmp/x", resume=True)


def test_a_checkpoint_dir_given_as_a_path_is_taken_as_its_string():
    import pathlib

    assert TrainConfig(checkpoint_dir=pathlib.Path("/tmp/ck")).checkpoint_dir == "/tmp/ck"


def test_arguments_round_trip():
    parser = add_train_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--size",
            "tiny",
            "--steps",
            "7",
            "--batch-size",
            "16",
            "--lr",
            "0.01",
            "--compile",
            "inductor",
            "--dtype",
            "bfloat16",
            "--fill",
            "0.25",
            "--length-dist",
            "heavy_tail",
            "--seed",
            "3",
            "--log-every",
            "2",
            "--checkpoint-dir",
            "/tmp/ck",
            "--save-every",
            "3",
            "--resume",
            "--quiet",
        ]
    )
    cfg = config_from_args(args)
    assert cfg == TrainConfig(
        size="tiny",
        steps=7,
        batch_size=16,
        lr=0.01,
        compile="inductor",
        dtype="bfloat16",
        fill=0.25,
        length_dist="heavy_tail",
        seed=3,
        log_every=2,
        checkpoint_dir="/tmp/ck",
        save_every=3,
        resume=True,
        quiet=True,
    )
    assert config_from_args(parser.parse_args([])) == TrainConfig()


def test_sparse_tables_resolution(monkeypatch):
    """None: sparse tables unless grad_clip, under parallel too (both embedding shardings train their
    shards sparsely); a sharding that could not would keep them dense, and refuse sparse_tables=True."""
    import gemcompile.runtime.training.config as config_module
    from gemcompile.config import ParallelConfig

    grid = ParallelConfig(enabled=True)
    replicated = ParallelConfig(enabled=True, embedding_sharding="replicated_groups")
    assert TrainConfig().trains_tables_sparsely and not TrainConfig(grad_clip=1.0).trains_tables_sparsely
    assert TrainConfig(parallel=grid).trains_tables_sparsely
    assert TrainConfig(parallel=replicated, sparse_tables=True).trains_tables_sparsely
    assert not TrainConfig(parallel=grid, grad_clip=1.0).trains_tables_sparsely
    assert not TrainConfig(parallel=grid, sparse_tables=False).trains_tables_sparsely
    with pytest.raises(ValueError, match="sparse_tables = True is invalid: expected None or False with"):
        TrainConfig(parallel=grid, sparse_tables=True, grad_clip=1.0)
    monkeypatch.setattr(config_module, "SPARSE_ROW_SHARDINGS", ("grid",))
    assert not TrainConfig(parallel=replicated).trains_tables_sparsely
    with pytest.raises(ValueError, match="with parallel embedding_sharding other than grid"):
        TrainConfig(parallel=replicated, sparse_tables=True)


def test_memory_flags_reach_the_gem_config():
    from gemcompile.runtime.training.config import gem_config

    parser = add_train_arguments(argparse.ArgumentParser())
    cfg = config_from_args(parser.parse_args(["--compile", "gem", "--memory-budget", "0.4", "--fp8-saved"]))
    assert cfg.memory_budget == 0.4 and cfg.fp8_saved is True
    gem = gem_config(cfg)
    assert gem.memory.budget == 0.4 and gem.memory.fp8_saved is True
    plain = gem_config(config_from_args(parser.parse_args(["--compile", "gem"])))
    assert plain.memory.budget is None and plain.memory.fp8_saved is False  # the default compile: untouched
    with_fp8 = gem_config(TrainConfig(compile="gem", mxfp8="mxfp8_emulated", fp8_saved=True))
    assert with_fp8.mxfp8.enabled and with_fp8.memory.fp8_saved is True


@pytest.mark.parametrize("kwargs, message", [
    ({"compile": "gem", "memory_budget": 0.0}, "memory_budget"),
    ({"compile": "gem", "memory_budget": 1.5}, "memory_budget"),
    ({"compile": "gem", "memory_budget": "0.5"}, "memory_budget"),
    ({"compile": "gem", "fp8_saved": 1}, "fp8_saved"),
    ({"compile": "inductor", "memory_budget": 0.5}, "needs compile='gem'"),
    ({"compile": "eager", "fp8_saved": True}, "needs compile='gem'"),
])
def test_memory_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_errors_every_rank_finds_alike_are_said_once_under_torchrun(rank, printed, monkeypatch, capsys):
    """A bad flag and a plan that does not fit the world are found by every rank alike: rank 0 alone prints
    them (each rank printed its copy). The exit status is every rank's."""
    from gemcompile.runtime.distributed.plan import ParallelPlanError, resolve_axes
    from gemcompile.runtime.training.flags import report_error

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as config_error:
        TrainConfig(steps=0)
    with pytest.raises(ParallelPlanError) as plan_error:
        resolve_axes(ParallelConfig(dp_shard=3), 8, gpus_per_node=2)
    with pytest.raises(ValueError) as parallel_error:  # (--dp-shard 0: a ParallelConfig value, printed per rank)
        ParallelConfig(dp_shard=0)
    for error in (config_error.value, plan_error.value, parallel_error.value):
        assert report_error("train", error, debug=False) == 2
        assert bool(capsys.readouterr().err) == printed


def test_a_stray_rank_in_a_one_process_run_hides_no_error(monkeypatch, capsys):
    """RANK=1 left in the environment of a plain (one-process) run: its errors are still said."""
    from gemcompile.runtime.training.flags import report_error

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as config_error:
        TrainConfig(lr=-1.0)
    assert report_error("train", config_error.value, debug=False) == 2
    assert "TrainConfig.lr" in capsys.readouterr().err


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_torchrun_without_parallel_is_refused(rank, printed, monkeypatch, capsys):
    """torchrun started two processes without --parallel: each trained the whole model alone, and with a
    checkpoint directory rank 1 stopped on rank 0's lock ("another run is writing checkpoints")."""
    from gemcompile.runtime.training.flags import run_train_from_args

    parser = add_train_arguments(argparse.ArgumentParser())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    assert run_train_from_args(parser.parse_args(["--steps", "1", "--checkpoint-dir", "unused"])) == 2
    err = capsys.readouterr().err
    expected = ("gemcompile train: error: WORLD_SIZE=2: 2 processes were started (torchrun) but --parallel "
                "is not given, so each would train the whole model alone; pass --parallel, or run one "
                "process\n")
    assert err == (expected if printed else "")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no --parallel needed
    assert config_from_args(parser.parse_args([])) == TrainConfig()
