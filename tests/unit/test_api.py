"""gem_compile's public forms and its errors."""

import pytest
import torch
import torch.nn as nn

from gemcompile import GemConfig, gem_compile
from gemcompile.backend import GemBackend


class TinyNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x)) * 2


@pytest.fixture
def backend_calls(monkeypatch):
    """The configs GemBackend compiled graphs with, in order."""
    calls = []
    original = GemBackend.__call__

    def recording_call(self, gm, example_inputs, **kwargs):
        calls.append(self.config)
        return original(self, gm, example_inputs, **kwargs)

    monkeypatch.setattr(GemBackend, "__call__", recording_call)
    return calls


def test_on_a_module_instance_returns_what_torch_compile_returns(backend_calls):
    model = TinyNet()
    compiled = gem_compile(model)
    assert type(compiled) is type(torch.compile(model))
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x))
    assert backend_calls == [GemConfig()]


def test_bare_decorator_on_a_function(backend_calls):
    @gem_compile
    def f(x):
        return torch.sin(x) * 2

    x = torch.randn(5)
    torch.testing.assert_close(f(x), torch.sin(x) * 2)
    assert backend_calls == [GemConfig()]


def test_decorator_with_arguments(backend_calls):
    config = GemConfig(jagged_attention={"enabled": False})

    @gem_compile(config=config, fullgraph=True)
    def f(x):
        return torch.cos(x) + 1

    x = torch.randn(5)
    torch.testing.assert_close(f(x), torch.cos(x) + 1)
    assert backend_calls == [config]


def test_decorator_on_a_module_class_keeps_state_dict_keys(backend_calls):
    Compiled = gem_compile(TinyNet)
    model = Compiled(8)
    assert Compiled.__name__ == "TinyNet"
    assert set(model.state_dict()) == {"linear.weight", "linear.bias"}
    x = torch.randn(2, 8)
    eager = TinyNet(8)
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), eager(x))
    assert backend_calls == [GemConfig()]


def test_backend_is_registered_by_name():
    compiled = torch.compile(lambda x: x * 3, backend="gemcompile")
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))


@pytest.mark.parametrize("bad", [3, "model", None.__class__, [nn.Linear(2, 2)]])
def test_rejects_what_is_neither_module_nor_callable(bad):
    with pytest.raises(TypeError, match="gem_compile"):
        gem_compile(bad)


def test_rejects_a_config_of_the_wrong_type():
    with pytest.raises(TypeError, match="GemConfig"):
        gem_compile(TinyNet(), config={"jagged_attention": {}})


def test_rejects_a_backend_argument():
    with pytest.raises(TypeError, match="own backend"):
        gem_compile(TinyNet(), backend="inductor")


def test_mode_and_options_together_are_rejected_like_torch_compile():
    with pytest.raises(RuntimeError, match="mode or options"):
        gem_compile(TinyNet(), mode="max-autotune-no-cudagraphs", options={"max_autotune": False})


def test_options_reach_inductor(monkeypatch):
    seen = {}
    import torch._inductor.compile_fx as compile_fx_module

    original = compile_fx_module.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        seen.update(config_patches or {})
        return original(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    compiled = gem_compile(TinyNet(), options={"epilogue_fusion": False})
    compiled(torch.randn(2, 8))
    assert seen.get("epilogue_fusion") is False


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "not-a-mode"}, r"unknown mode 'not-a-mode'; valid modes: default, .*max-autotune"),
    ({"mode": 3}, r"unknown mode 3; valid modes"),
    ({"options": {"no_such_option": 1}}, r"unknown option 'no_such_option'.*valid options .*epilogue_fusion"),
    ({"options": {"epilogue_fusio": True}}, r"did you mean 'epilogue_fusion'"),
    ({"options": {"epilogue-fusion": 1}}, r"option 'epilogue-fusion' = 1 is of type int, expected bool"),
    ({"options": ["max_autotune"]}, r"options must be a dict"),
])
def test_mode_and_options_are_checked_when_called_like_torch_compile(kwargs, message, backend_calls):
    with pytest.raises(RuntimeError, match=message) as info:
        gem_compile(TinyNet(), **kwargs)
    assert str(info.value).startswith("gem_compile: ")  # the reason first, never the config's repr
    with pytest.raises(RuntimeError, match=message):  # the decorator form checks at once too
        gem_compile(**kwargs)
    assert backend_calls == []


def test_a_backend_error_leads_with_the_reason_not_the_config(monkeypatch):
    import gemcompile.backend as backend

    def failing_pass(*args, **kwargs):
        raise ValueError("the pass found something wrong")

    monkeypatch.setattr(backend, "run_pre_grad", failing_pass)
    with pytest.raises(Exception, match="the pass found something wrong") as info:
        gem_compile(TinyNet())(torch.randn(2, 8))
    head = str(info.value)[:120]
    assert "the pass found something wrong" in head and "GemConfig" not in str(info.value)


def test_eager_training_imports_no_compiler_stack_and_the_public_names_stay_functions():
    """``import gemcompile`` and the training loop leave Dynamo's tracer, Inductor's pattern matcher and the
    passes unloaded (imported on first use of gem_compile / explain); importing the submodule
    gemcompile.explain first does not turn the public ``gemcompile.explain`` into a module."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import gemcompile\n"
        "from gemcompile.runtime.training.train import train\n"
        "heavy = [m for m in ('gemcompile.passes', 'gemcompile.api', 'torch._inductor.pattern_matcher') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import gemcompile.explain\n"
        "from gemcompile import explain, gem_compile, ExplainReport\n"
        "assert callable(explain) and explain.__name__ == 'explain' and gemcompile.explain is explain\n"
        "assert gem_compile.__name__ == 'gem_compile' and isinstance(ExplainReport, type)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("imports", ["import torch", "import torch, gemcompile"])
def test_the_backend_name_works_without_importing_the_compiler(imports):
    """torch.compile(..., backend="gemcompile") in a process that imported only torch (the package's
    torch_dynamo_backends entry point) or only the lazy top-level package: it was an InvalidBackend there."""
    import subprocess
    import sys

    code = f"{imports}\nf = torch.compile(lambda x: x * 3, backend='gemcompile')\nprint(f(torch.ones(2)).tolist())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "[3.0, 3.0]" in done.stdout, done.stderr[-2000:]
