"""Python's garbage collector in a training loop: what compiling left behind is kept out of its full passes.

torch.compile leaves about a million long-lived Python objects behind (FX graphs, guards, Inductor's
caches: 0.9 M after compiling GEM-ref tiny for the CPU, where one full collection then took 0.25-0.5 s).
A full (generation 2) collection walks every one of them, at a moment the collector picks, inside some
training step. ``gc.freeze()`` once the warm-up has compiled everything moves the objects alive then to a
permanent generation that collections skip, so the collector only walks what the steps themselves create.
(torchtitan's loop meets the same cost by disabling the collector and collecting generation 1 every N
steps.) ``thaw`` hands them back to the collector when the loop ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["compiled_state_frozen", "freeze_compiled_state", "thaw"]


def freeze_compiled_state() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (the loop's compiled state may now be released)."""
    gc.unfreeze()


@contextlib.contextmanager
def compiled_state_frozen() -> Iterator[None]:
    """Thaws on exit whatever ``freeze_compiled_state`` froze inside the block."""
    try:
        yield
    finally:
        thaw()
