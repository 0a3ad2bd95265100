"""runtime/training/gc_policy.py: objects alive at the freeze are out of the collector's passes until thawed;
the e2e benchmark's timed steps and the training loop freeze after their compiling steps and thaw at the end."""

import gc

from gemcompile.runtime.training.gc_policy import compiled_state_frozen, freeze_compiled_state


def test_freeze_then_thaw():
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(1000)]
    with compiled_state_frozen():
        freeze_compiled_state()
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0


def test_thawed_after_an_error():
    try:
        with compiled_state_frozen():
            freeze_compiled_state()
            raise RuntimeError("a failing step")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_the_training_loop_freezes_after_its_compiling_steps(monkeypatch):
    from gemcompile.runtime.training import train as train_module

    frozen_at = []
    monkeypatch.setattr(train_module, "freeze_compiled_state",
                        lambda: frozen_at.append(len(losses)))
    losses = []
    real_record = train_module._record_step

    def record(run, step, *args):
        losses.append(step)
        return real_record(run, step, *args)

    monkeypatch.setattr(train_module, "_record_step", record)
    train_module.train(size="tiny", steps=4, batch_size=4, device="cpu", compile="eager", log_every=2)
    assert frozen_at == [2]  # once, after the second step
    assert gc.get_freeze_count() == 0
