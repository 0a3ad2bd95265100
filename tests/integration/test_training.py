"""Training end to end on tiny: the loss and NE go down, checkpoints resume bit-exactly, the CLI fails
cleanly on bad flags, and bad inputs are caught at the model boundary."""

import argparse
import math
import os
import shutil

import pytest
import torch

from gemcompile.models.gem import gem_ref_config
from gemcompile.runtime.training.checkpoint import checkpoint_path
from gemcompile.runtime.training.config import TrainConfig
from gemcompile.runtime.training.flags import add_train_arguments, run_train_from_args
from gemcompile.runtime.training.train import train

STEPS, SAVE_AT = 50, 20
BATCH = 64  # the tiny default


def _eager_tiny(directory, **overrides) -> TrainConfig:
    return TrainConfig(size="tiny", steps=STEPS, batch_size=BATCH, compile="eager",
                       checkpoint_dir=str(directory), quiet=True, **overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 50-step eager run on tiny that also writes checkpoints at 20 and 40."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = train(_eager_tiny(directory, save_every=SAVE_AT))
    return result, directory


def test_fifty_steps_lower_loss_and_ne(uninterrupted):
    result, _ = uninterrupted
    losses = result.losses
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * (sum(losses[:5]) / 5)
    first, last = result.first_window, result.last_window
    assert (first.first_step, first.last_step, last.first_step, last.last_step) == (1, 10, 41, 50)
    assert last.loss < first.loss
    for task in range(2):  # NE per task, first window vs last window
        assert last.ne[task] < first.ne[task]
    assert result.ne == last.ne


def test_run_reports_throughput_and_flops(uninterrupted):
    result, directory = uninterrupted
    assert result.steps_per_s > 0 and result.samples_per_s == pytest.approx(result.steps_per_s * BATCH)
    assert result.compile_time_s > 0
    assert 0 < result.useful_flops_per_step < result.padded_flops_per_step
    assert 0.3 < result.padding_efficiency < 0.7  # fill 0.5
    assert result.mfu is None  # no peak for the CPU
    assert result.checkpoints == [str(checkpoint_path(directory, s)) for s in (20, 40, 50)]


def test_resume_from_step_20_matches_uninterrupted_run(uninterrupted, tmp_path):
    reference, directory = uninterrupted
    # A directory holding only the step-20 checkpoint (the uninterrupted run also wrote 40 and 50).
    shutil.copytree(checkpoint_path(directory, SAVE_AT), checkpoint_path(tmp_path, SAVE_AT))
    resumed = train(_eager_tiny(tmp_path, resume=True))
    assert resumed.start_step == SAVE_AT
    assert resumed.losses[SAVE_AT:] == reference.losses[SAVE_AT:]  # steps 21-50, bit-exact
    assert resumed.losses == reference.losses  # steps 1-20 come from the checkpoint
    assert _nan_equal(resumed.windows, reference.windows)
    assert _nan_equal(resumed.ne, reference.ne) and _nan_equal(resumed.auc, reference.auc)


def _nan_equal(a, b):
    return repr(a) == repr(b)  # NaN-aware exact comparison of floats / dataclasses of floats


def test_resume_refuses_a_checkpoint_of_another_run(uninterrupted, tmp_path):
    _, directory = uninterrupted
    shutil.copytree(checkpoint_path(directory, SAVE_AT), checkpoint_path(tmp_path, SAVE_AT))
    with pytest.raises(
        ValueError, match=r"cannot resume from .*other settings \(seed: checkpoint 0 vs now 1\)"
    ):
        train(
            TrainConfig(
                size="tiny",
                steps=STEPS,
                batch_size=BATCH,
                seed=1,
                checkpoint_dir=str(tmp_path),
                resume=True,
                quiet=True,
            )
        )


def _gem_compile_passes_only(monkeypatch) -> dict:
    """train()'s compile="gem" with gemcompile's pre-grad passes (the attention rewrites to the custom ops) and the
    rewritten graph run by Dynamo's eager backend instead of Inductor: the compiled runner, its guards and the
    rewritten graph that a resume meets, without a cold Inductor C++ compile on CI's CPU. (aot_eager would add the
    joint-graph trace, nothing a checkpoint touches, at ~10 s a compile on CI's CPU.) Returns counts of what was
    compiled."""
    from torch._dynamo.backends.registry import lookup_backend

    from gemcompile.passes import PIPELINE
    from gemcompile.passes.base import instantiate, run_pre_grad
    from gemcompile.runtime.training import train as train_module

    seen = {"graphs": 0, "gemcompile_ops": 0}

    def gem_compile(model, config=None, **kwargs):
        def backend(gm, example_inputs):
            run_pre_grad(gm, instantiate(PIPELINE, config), example_inputs)
            seen["graphs"] += 1
            seen["gemcompile_ops"] += sum(n.op == "call_function" and str(n.target).startswith("gemcompile.")
                                          for n in gm.graph.nodes)
            return lookup_backend("eager")(gm, example_inputs)

        return torch.compile(model, backend=backend, **kwargs)

    monkeypatch.setattr(train_module, "gem_compile", gem_compile)
    return seen


@pytest.mark.parametrize("backend", [
    "passes+eager",
    pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.skipif(
        not os.environ.get("GEMCOMPILE_SLOW_TESTS"),
        reason="cold Inductor compile of tiny takes minutes on 2 CPU cores; set GEMCOMPILE_SLOW_TESTS=1")]),
])
def test_compiled_resume_matches_uninterrupted_run(tmp_path, monkeypatch, backend):
    """A compiled run (compile="gem") that resumes from its step-2 checkpoint trains the same losses as the run
    that wrote it. CI: gem_compile's passes with Dynamo's eager backend (about 20 s); GEMCOMPILE_SLOW_TESTS=1 adds
    real Inductor (compile="inductor"), and a run that never checkpointed."""
    # deterministic=True: Inductor's CPU scatter-adds (embedding backward) are atomic otherwise, and
    # their summation order varies from run to run.
    common = {"size": "tiny", "steps": 4, "batch_size": 8, "deterministic": True, "quiet": True,
              "compile": "gem" if backend == "passes+eager" else "inductor"}
    seen = _gem_compile_passes_only(monkeypatch) if backend == "passes+eager" else None
    reference = train(TrainConfig(checkpoint_dir=str(tmp_path / "a"), save_every=2, **common))
    shutil.copytree(checkpoint_path(tmp_path / "a", 2), checkpoint_path(tmp_path / "b", 2))
    resumed = train(TrainConfig(checkpoint_dir=str(tmp_path / "b"), resume=True, **common))
    assert resumed.start_step == 2
    assert len(resumed.losses) == 4 and all(math.isfinite(x) for x in resumed.losses)
    assert resumed.losses == reference.losses  # steps 3-4 trained after the resume, bit-exact
    if seen is not None:  # the compiled path ran: graphs through the passes, attention rewritten to our ops
        assert seen["graphs"] >= 2 and seen["gemcompile_ops"] > 0, seen
    else:
        uninterrupted = train(TrainConfig(**common))  # no checkpointing at all
        assert uninterrupted.losses == reference.losses


def test_bad_batch_is_caught_at_the_model_boundary(monkeypatch):
    from gemcompile.models.data import SyntheticData

    original = SyntheticData.batch

    def corrupted(self, step):
        batch = original(self, step)
        if step == 1:
            batch.seq_lengths[0][3] = 999
        return batch

    monkeypatch.setattr(SyntheticData, "batch", corrupted)
    n = gem_ref_config("tiny").seq_max_lens[0]
    with pytest.raises(
        ValueError,
        match=rf"invalid batch: seq_lengths\[0\] has value 999 at sample 3, "
        rf"allowed range \[0, {n}\]",
    ):
        train(TrainConfig(size="tiny", steps=3, batch_size=8, quiet=True))


def _parser():
    return add_train_arguments(argparse.ArgumentParser(prog="gemcompile train"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fill", "1.5"], "TrainConfig.fill = 1.5 is invalid: expected a float in (0, 1]"),
        (["--steps", "0"], "TrainConfig.steps = 0 is invalid: expected an int in [1, 2**63)"),
        (["--log-every", str(2**63)], f"TrainConfig.log_every = {2**63} is invalid: expected an int in [1, 2**63)"),
        (["--save-every", "5"], "TrainConfig.save_every needs TrainConfig.checkpoint_dir"),
        (["--explain"], "TrainConfig.explain = True needs compile='gem'"),
    ],
)
def test_cli_bad_flag_value_is_one_error_line(argv, message, capsys):
    assert run_train_from_args(_parser().parse_args(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemcompile train: error: ") and message in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cli_cuda_without_gpu_is_one_error_line(capsys):
    assert run_train_from_args(_parser().parse_args(["--device", "cuda", "--steps", "1"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device is available" in err[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--compile", "tvm"], "argument --compile: invalid choice: 'tvm'"),
    ],
)
def test_cli_unparsable_flag_is_an_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err


def test_cli_runs_and_prints_summary(capsys):
    assert (
        run_train_from_args(_parser().parse_args(["--steps", "2", "--batch-size", "8", "--log-every", "1"]))
        == 0
    )
    out = capsys.readouterr().out
    assert "step 2/2" in out and "useful FLOPs / step" in out and "NE CTR" in out
