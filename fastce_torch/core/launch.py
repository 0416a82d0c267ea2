"""The host side of a kernel launch that every kernel shares, whatever its loss: the launchers (launch_cache.Launcher:
Triton's generic `kernel[grid](...)` the first time a variant runs, then that compiled variant's own launcher
directly, FASTCE_TORCH_LAUNCH_CACHE=0 at import turning this off; or GenericLauncher, Triton's own path every time,
where launch_cache.py is absent), the capture guard (a variant's first launch, which compiles it, refused inside a
CUDA graph capture with an error naming the cause), the device a launch runs on, the check that the kernels can run
(CUDA tensors, or Triton's interpreter: INTERPRETED), and forget_launches: every launcher registered here
(register_launchers) forgets its variants on request and in a forked child.
"""

import contextlib
import os
import sys

import torch
from triton import knobs

__all__ = [
    "FIRST_LAUNCH_IN_CAPTURE",
    "INTERPRETED",
    "LAUNCH_CACHE_VARIABLE",
    "GenericLauncher",
    "Launcher",
    "checked",
    "current_device",
    "forget_launches",
    "forget_variants_after_fork",
    "guard_capture",
    "launch_cache",
    "launch_cache_enabled",
    "launch_guarded",
    "launched",
    "launchers",
    "on_device",
    "register_launchers",
]

INTERPRETED = bool(knobs.runtime.interpret)


class GenericLauncher:
    """Triton's own launch path, every time: what every launcher is without launch_cache.py. The same interface as
    launch_cache.Launcher (`cached` never launches, `launch` is `kernel[grid](*args)`)."""

    hits = 0
    failure = None

    def __init__(self, kernel):
        self.kernel = kernel

    def cached(self, grid, args, num_warps=None, num_stages=None):
        return False

    def launch(self, grid, args, num_warps=None, num_stages=None):
        options = {} if num_warps is None else {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        return self.kernel[grid](*args, **options)

    def forget(self):
        pass


try:  # the one link to launch_cache.py: deleting that module leaves Triton's own launch path
    from .launch_cache import LAUNCH_CACHE_VARIABLE, Launcher, launch_cache, launch_cache_enabled
except ImportError:
    Launcher = GenericLauncher
    LAUNCH_CACHE_VARIABLE = "FASTCE_TORCH_LAUNCH_CACHE"

    def launch_cache_enabled():
        return False

    @contextlib.contextmanager
    def launch_cache(enabled):
        if enabled:
            raise RuntimeError("the launch cache is off in this process: fastce_torch.core.launch_cache is absent")
        yield


# The current device as torch's C getter reads it (as Triton's driver and the launch cache read it).
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def checked(tensor):
    """Raise unless the kernels can run on `tensor`: a CUDA tensor, or any tensor under Triton's interpreter."""
    if not tensor.is_cuda and not INTERPRETED:
        raise RuntimeError(
            "the Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before "
            "triton is first imported, or use backend='reference'"
        )


_SAME_DEVICE = contextlib.nullcontext()  # stateless: one instance serves every call


def on_device(tensor):
    """Triton launches on the current device's current stream: make the tensor's device current for the launch
    (logits on cuda:1 while cuda:0 is current). A no-op (one shared nullcontext) when it already is; the current
    device comes from torch's C getter, as the launch cache reads it (a CUDA tensor means CUDA is initialised)."""
    if tensor.is_cuda and tensor.get_device() != current_device():
        return torch.cuda.device(tensor.device)
    return _SAME_DEVICE


FIRST_LAUNCH_IN_CAPTURE = (
    "fastce_torch: this kernel variant (options, reduction, dtype, device) has not run yet in this process, and its "
    "first launch cannot be captured in a CUDA graph: Triton compiles and loads a kernel on its first launch, which "
    "stream capture forbids. Run the same step once outside the capture first (torch.cuda.graph's documented "
    "warm-up on a side stream does it), then capture."
)
# Kernel variants that have been launched in this process (so Triton has compiled and loaded their modules).
launched = set()


def guard_capture(variant, tensor):
    """Raise FIRST_LAUNCH_IN_CAPTURE instead of letting a first launch invalidate a CUDA graph capture (whose own
    error, "operation failed due to a previous error during capture", names no cause)."""
    if variant not in launched:
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(FIRST_LAUNCH_IN_CAPTURE)
        launched.add(variant)


def launch_guarded(launcher, grid, args, variant, tensor, warps=None):
    """A launch through the cache, or Triton's generic path guarded against a first launch inside a capture
    (guard_capture; `variant` keys what Triton compiles for it)."""
    with on_device(tensor):
        if not launcher.cached(grid, args, warps):
            guard_capture(variant, tensor)
            launcher.launch(grid, args, warps)


# Every kernel's launcher, as (module name, attribute): looked up at each call, so a launcher replaced by a test is the
# one forgotten.
_REGISTERED = []


def register_launchers(module_name, *attributes):
    """Record the launchers that the module `module_name` keeps as these attributes, for forget_launches."""
    _REGISTERED.extend((module_name, attribute) for attribute in attributes)


def launchers():
    """Every registered launcher, as its module holds it now."""
    return [getattr(sys.modules[module], attribute) for module, attribute in _REGISTERED]


def forget_launches():
    """Forget which kernel variants have run (the capture guard's record and the launch cache): the next launch of
    each variant takes Triton's generic path again, as in a fresh process."""
    launched.clear()
    for launcher in launchers():
        launcher.forget()


def forget_variants_after_fork():
    """What a forked child runs (os.register_at_fork): every launcher forgets its variants. A forked child cannot use
    its parent's CUDA context: its first launch must take Triton's generic path (and torch.cuda's checks), not a
    cached launcher whose device getter skips them."""
    for launcher in launchers():
        launcher.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_variants_after_fork)
