"""Triton's interpreter re-patches triton.language on every device-function call inside a kernel: each call of a
@triton.jit helper walks the language modules with inspect.getmembers (a third of an interpreted test's CPU time in
a profile of bench/tests/test_rl_step.py). The launch around it has already patched those modules, and the helper's
patch would find nothing left to wrap (the builtins are wrapped already) and set the same tensor and core attributes
again. `install()` skips that repeat: inside a launch, a helper whose language modules the launch patched runs on the
launch's patch; a helper that sees another module (one the launch did not patch) is patched as Triton would. The
launch's own patch and its restore are Triton's.

Only for the interpreter of the Triton this was written against (3.6, CI's pin: the three names below, the launch
restoring the scope it got); any other release (the release jobs' 3.8 and 3.9) keeps Triton's own behaviour. Tests
only: the package never imports this module.
"""

import inspect

__all__ = ["install"]


def install():
    """Make Triton's interpreter skip the repeated patch (once per process; False where it is left alone)."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_fastce_patch_once", False):
        return True
    if not triton.__version__.startswith("3.6."):
        return False
    try:
        launch_source = inspect.getsource(interpreter.GridExecutor.__call__)
        call_source = inspect.getsource(interpreter.InterpretedFunction.__call__)
        original = interpreter._patch_lang
        interpreter._LangPatchScope  # noqa: B018  (the scope type the launch restores)
    except (AttributeError, OSError, TypeError):
        return False
    if "patch_scope = _patch_lang(self.fn)" not in launch_source or "_patch_lang(self.fn)" not in call_source:
        return False
    languages = (tl, tl.core)
    patched = []  # the language modules the running launch patched (empty outside a launch)

    def languages_of(fn):
        return frozenset(id(value) for value in fn.__globals__.values() if any(value is m for m in languages))

    def patch_lang(fn):
        seen = languages_of(fn)
        if patched and seen <= patched[-1]:
            return interpreter._LangPatchScope()  # the launch's patch covers this helper; nothing to restore
        scope = original(fn)
        if not patched:  # a launch (no device function runs outside one): its scope is restored when it ends
            patched.append(seen)
            restore = scope.restore

            def restore_and_leave():
                patched.pop()
                restore()

            scope.restore = restore_and_leave
        return scope

    interpreter._patch_lang = patch_lang
    interpreter._fastce_patch_once = True
    return True
