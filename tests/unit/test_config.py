import dataclasses

import pytest

from gemcompile import GemConfig
from gemcompile.config import ConfigError, JaggedAttentionConfig


def test_defaults_are_frozen():
    config = GemConfig()
    assert config.jagged_attention.enabled
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chain_existing_passes = False  # type: ignore[misc]


def test_sections_may_be_given_as_dicts():
    config = GemConfig(jagged_attention={"enabled": False, "min_kv_len": 8})
    assert config.jagged_attention == JaggedAttentionConfig(enabled=False, min_kv_len=8)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(jaged_attention={}), TypeError, ["jaged_attention", "did you mean 'jagged_attention'", "valid fields"]),
        (dict(jagged_attention={"enabeld": True}), TypeError, ["enabeld", "did you mean 'enabled'"]),
        (dict(jagged_attention={"min_kv_len": 0}), ConfigError, ["min_kv_len", ">= 1"]),
        (dict(jagged_attention={"min_kv_len": "8"}), ConfigError, ["min_kv_len", "expected int"]),
        (dict(jagged_attention={"enabled": 1}), ConfigError, ["enabled", "expected bool"]),
        (dict(chain_existing_passes="yes"), ConfigError, ["chain_existing_passes", "expected bool"]),
        (dict(jagged_attention=3), ConfigError, ["jagged_attention", "JaggedAttentionConfig"]),
    ],
)
def test_bad_fields_name_the_field_and_valid_values(kwargs, error, words):
    with pytest.raises(error) as info:
        GemConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_fingerprint_changes_with_a_knob():
    a = GemConfig().fingerprint("jagged_attention")
    b = GemConfig(jagged_attention={"min_kv_len": 2}).fingerprint("jagged_attention")
    assert a != b
    assert a == GemConfig().fingerprint("jagged_attention")


@pytest.mark.parametrize("budget", [0, 0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_a_memory_budget_outside_0_1_is_refused(budget):
    with pytest.raises(ConfigError) as info:
        GemConfig(memory={"budget": budget})
    for word in ("MemoryConfig.budget", "(0, 1]", "None (off)"):
        assert word in str(info.value)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(memory={"budget": "0.5"}), ConfigError, ["MemoryConfig.budget", "expected float or None"]),
    (dict(memory={"budget": True}), ConfigError, ["MemoryConfig.budget", "expected float or None"]),
    (dict(memory={"budjet": 0.5}), TypeError, ["budjet", "did you mean 'budget'"]),
    (dict(memory={"recompute_attention": "no"}), ConfigError, ["recompute_attention", "expected bool"]),
])
def test_bad_memory_fields_name_the_field(kwargs, error, words):
    with pytest.raises(error) as info:
        GemConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_the_memory_budget_is_off_by_default_and_a_fraction_when_set():
    assert GemConfig().memory.budget is None and not GemConfig().memory.recompute_attention
    assert GemConfig(memory={"budget": 1}).memory.budget == 1.0
    assert isinstance(GemConfig(memory={"budget": 1}).memory.budget, float)
    assert GemConfig(memory={"budget": 0.25}).fingerprint("memory") != GemConfig().fingerprint("memory")
