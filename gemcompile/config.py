"""GemConfig: what gemcompile's passes do, one frozen section per pass.

Every field has a docstring under it (torchtitan style) and is validated in ``__post_init__``: a bad
value raises an error that names the field and the valid values, before anything is compiled. The
sections are folded into each pass's ``uuid()``, so a changed knob never reuses a stale cache entry.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A GemConfig field has a value outside its valid range."""


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is tuple:
        (item, *_rest) = typing.get_args(annotation)
        return f"a tuple of {_describe(item)}"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _matches(value: Any, annotation: Any) -> bool:
    """True if value has the type the annotation names (the small subset configs use)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return isinstance(value, tuple) and all(_matches(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, annotation)
    return isinstance(value, annotation)


def _check_types(obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            raise ConfigError(
                f"{type(obj).__name__}.{f.name} = {value!r} is invalid: expected {_describe(hints[f.name])}"
            )


def _reject_unknown_fields(cls):
    """Replace a dataclass's TypeError for an unknown keyword by one that lists the valid fields."""
    generated_init = cls.__init__

    @functools.wraps(generated_init)
    def __init__(self, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"{cls.__name__} has no field {', '.join(hints)}; valid fields: {', '.join(names)}"
            )
        generated_init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def config_section(cls):
    """Decorator for config dataclasses: frozen, keyword-only, typed fields checked, unknown fields named."""
    cls = dataclass(frozen=True, kw_only=True)(cls)
    return _reject_unknown_fields(cls)


@config_section
class JaggedAttentionConfig:
    """Padded softmax attention whose mask comes from per-sample lengths -> gemcompile::jagged_attention."""

    enabled: bool = True
    """Rewrite provable padded softmax attention into the jagged kernel."""

    min_kv_len: int = 1
    """Leave attention over fewer padded keys than this alone (tiny attentions gain nothing)."""

    def __post_init__(self):
        _check_types(self)
        if self.min_kv_len < 1:
            raise ConfigError(f"JaggedAttentionConfig.min_kv_len = {self.min_kv_len} is invalid: expected >= 1")


@config_section
class GdpaConfig:
    """Padded pointwise-activation attention (HSTU, GDPA cross-attention, PMA) -> gemcompile::gdpa."""

    enabled: bool = True
    """Rewrite provable act(q k^T) @ v attention (silu, gelu, relu, relu squared, sigmoid) into the kernel."""

    def __post_init__(self):
        _check_types(self)


@config_section
class BlockAttentionConfig:
    """Block-diagonal or sliding-window masked attention (+ RoPE just before) -> gemcompile::block_attention."""

    enabled: bool = True
    """Rewrite provable block-diagonal / windowed padded attention into the block-attention kernel."""

    fuse_rotary: bool = True
    """Fold a rotary embedding applied to q and k just before the attention into the kernel."""

    def __post_init__(self):
        _check_types(self)


@config_section
class Mxfp8Config:
    """Block-scaled FP8 casts around qualifying GEMMs of the forward and backward graphs (post-grad)."""

    enabled: bool = False
    """Insert FP8 quantization and scaled GEMMs (off by default: it changes numerics)."""

    def __post_init__(self):
        _check_types(self)


@config_section
class ParallelConfig:
    """The 5D parallel plan: sizes of the mesh axes for dense weights, experts and embedding tables."""

    enabled: bool = False
    """Annotate parameters with their DTensor placements and run the plan (off: single process)."""

    def __post_init__(self):
        _check_types(self)


@config_section
class GemConfig:
    """Everything gemcompile's passes do. Sections may be given as dicts: GemConfig(jagged_attention={...})."""

    jagged_attention: JaggedAttentionConfig = field(default_factory=JaggedAttentionConfig)
    """Padded softmax attention -> jagged flash attention (pre-grad, and joint graph)."""

    gdpa: GdpaConfig = field(default_factory=GdpaConfig)
    """Padded pointwise-activation attention -> the GDPA kernel (pre-grad)."""

    block_attention: BlockAttentionConfig = field(default_factory=BlockAttentionConfig)
    """Block-diagonal / sliding-window attention (with fused RoPE) -> the block-attention kernel (pre-grad)."""

    mxfp8: Mxfp8Config = field(default_factory=Mxfp8Config)
    """FP8 block-scaled GEMMs in the forward and backward graphs (post-grad)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The 5D parallel plan (sharding annotations pre-grad; the runtime applies them)."""

    chain_existing_passes: bool = True
    """Run a pass the user installed in an Inductor slot gemcompile also uses (before gemcompile's own).
    False drops it, with a warning."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            section_type = hints[f.name]
            if dataclasses.is_dataclass(section_type) and isinstance(value, dict):
                try:
                    object.__setattr__(self, f.name, section_type(**value))
                except TypeError as e:
                    raise TypeError(f"GemConfig.{f.name}: {e}") from None
        _check_types(self)

    def section(self, name: str) -> Any:
        """The config section a pass reads, by field name."""
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, section: str | None = None) -> str:
        """Stable text of the whole config or one section, for pass uuids."""
        data = self.to_dict() if section is None else dataclasses.asdict(self.section(section))
        return json.dumps(data, sort_keys=True, default=repr)
