"""gemcompile's on/off environment switches: the usual spellings either way, unset means the default, and
anything else is one error naming the variable (GEMCOMPILE_TRITON_ADAM=false used to leave the kernel on)."""

import pytest

from gemcompile.env import env_flag


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                                           ("0", False), ("false", False), ("No", False), ("off", False)])
def test_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("GEMCOMPILE_SWITCH", raw)
    assert env_flag("GEMCOMPILE_SWITCH", not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("GEMCOMPILE_SWITCH", raising=False)
    assert env_flag("GEMCOMPILE_SWITCH", default) is default
    monkeypatch.setenv("GEMCOMPILE_SWITCH", "")
    assert env_flag("GEMCOMPILE_SWITCH", default) is default


def test_anything_else_names_the_variable(monkeypatch):
    monkeypatch.setenv("GEMCOMPILE_TRITON_ADAM", "maybe")
    from gemcompile.runtime.training.adam import triton_adam_enabled

    with pytest.raises(ValueError, match=r"GEMCOMPILE_TRITON_ADAM='maybe': use 1 or 0"):
        triton_adam_enabled()
