"""gemcompile's on/off environment switches (GEMCOMPILE_TMA=0, GEMCOMPILE_STRICT=1, ...), read one way.

Each switch was read as ``!= "0"`` or ``== "1"``, so ``GEMCOMPILE_TRITON_ADAM=false`` left the kernel on
without a word. ``env_flag`` takes the usual spellings and refuses anything else with the variable named.
"""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: 1/true/yes/on or 0/false/no/off (any case); unset or empty gives ``default``;
    anything else raises ValueError naming the variable and the accepted values."""
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: use 1 or 0 (or true/false, yes/no, on/off)")
