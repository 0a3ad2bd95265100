"""Triton's CPU interpreter re-patches triton.language at every call of a @triton.jit helper.

A kernel launch (``GridExecutor.__call__``) patches ``triton.language`` for the interpreter and restores it
when the grid is done. Every call of a jitted helper inside that kernel (``InterpretedFunction.__call__``)
patches it again, although it already is: ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and
``tl.math`` each time, whose scope is then dropped. Our kernels call small shared helpers inside their
loops: in the GDPA bias-gradient grid ~10 of the 28 s spent in the interpreter (cProfile), and that test
file takes 56 s instead of 79 s with the shortcut below (-n 2, this 2-core CPU).

``skip_repatching_inside_a_launch`` makes a helper call skip the patch when, within the running launch,
every language module the helper sees was already patched (by the launch, or by an earlier helper call
such as ``tl.zeros``, whose module sees ``tl.core`` too); the first call that sees a new module goes
through triton's own code as before. Re-patching a patched module changes nothing (patched members are
no longer builtins; the tensor and dtype hooks are set to equal ones), so the interpreter runs what it
ran before, in the same patched language. Tests only.
"""
from __future__ import annotations

import inspect


class _NothingToRestore:
    def restore(self) -> None:
        pass


_LANGUAGE_MODULES: dict[int, frozenset[int]] = {}  # by id of the function's globals: module imports only


def _language_modules(fn) -> frozenset[int]:
    key = id(fn.__globals__)
    if key not in _LANGUAGE_MODULES:
        import triton.language as tl

        _LANGUAGE_MODULES[key] = frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return _LANGUAGE_MODULES[key]


def skip_repatching_inside_a_launch() -> bool:
    """Install the shortcut; returns False (and changes nothing) where this triton's interpreter does not
    have the shape it was written against."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_skips_inside_a_launch", False):
        return original is not None
    if not hasattr(interpreter, "GridExecutor") or not hasattr(interpreter, "InterpretedFunction"):
        return False
    patched_in_launch: list[set[int]] = []  # launches do not nest: at most one entry

    def patch_lang(fn):
        langs = _language_modules(fn)
        if patched_in_launch:  # a helper called inside a running kernel
            if langs <= patched_in_launch[-1]:
                return _NothingToRestore()
            patched_in_launch[-1] |= langs
            return original(fn)  # triton drops this scope, as before
        scope = original(fn)  # a kernel launch: GridExecutor restores this scope in its finally
        patched_in_launch.append(set(langs))
        restore = scope.restore

        def restore_and_forget():
            patched_in_launch.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang._skips_inside_a_launch = True
    interpreter._patch_lang = patch_lang
    return True
