"""The launch cache: a reproduction of Triton 3.6.0's launch path (JITFunction.run) that, after Triton has compiled
and launched a kernel variant once, calls that variant's compiled launcher directly.

This module is self-contained: core/launch.py imports it under one guard, and without it (deleted, or another
Triton) every launch takes Triton's own `kernel[grid](...)`.

Triton's `kernel[grid](*args)` costs ~26 us of host time per launch on the H200 machine (bench/NOTES.md): it reads
its options, binds and specialises every argument, builds a string key, checks the kernel's globals and builds a
launch-metadata record, before calling the compiled variant's launcher (~8 us). After Triton has compiled and
launched a variant once, `Launcher` calls that launcher itself, keyed on what Triton's specialisation of the
arguments depends on (dtypes, 16-byte alignment of pointers, integers equal to 1, divisible by 16, 32 or 64 bits,
the constexprs), computed by `ArgumentLayout` without Triton's binder (2.5 us against 6.2 us for the forward's
38 arguments, helpers' CPU) and checked against the binder at every variant recorded, and on the options Triton
adds to its key, so a cached variant is exactly the one Triton would launch. Written against Triton 3.6.0's runtime
(JITFunction.run, CompiledKernel, native_specialize_impl); any other version, the interpreter, or
FASTCE_TORCH_LAUNCH_CACHE=0 (read once, at import) keeps the generic path.
"""

import contextlib
import os

import torch
import triton
from triton import knobs

__all__ = [
    "LAUNCH_CACHE_TRITON",
    "LAUNCH_CACHE_VARIABLE",
    "ArgumentLayout",
    "LaunchCacheSetting",
    "Launcher",
    "binder_key",
    "current_device",
    "current_stream",
    "launch_cache",
    "launch_cache_enabled",
    "launch_cache_refusal",
    "launch_cache_setting",
]

LAUNCH_CACHE_VARIABLE = "FASTCE_TORCH_LAUNCH_CACHE"
LAUNCH_CACHE_TRITON = "3.6.0"  # the Triton release whose launch path Launcher reproduces


def launch_cache_refusal():
    """Why the launch cache cannot be used in this process, or "" when it can."""
    if knobs.runtime.interpret:
        return "Triton's interpreter (TRITON_INTERPRET=1) runs the kernels"
    if os.environ.get(LAUNCH_CACHE_VARIABLE, "1") == "0":
        return f"{LAUNCH_CACHE_VARIABLE}=0"
    if triton.__version__ != LAUNCH_CACHE_TRITON:
        return f"Triton {triton.__version__}: the cached launch is written for Triton {LAUNCH_CACHE_TRITON}"
    return ""


class LaunchCacheSetting:
    """The process's launch-cache setting: decided once at import, switched only by `launch_cache(...)`."""

    def __init__(self):
        self.refusal = launch_cache_refusal()
        self.enabled = not self.refusal


launch_cache_setting = LaunchCacheSetting()


def launch_cache_enabled():
    return launch_cache_setting.enabled


@contextlib.contextmanager
def launch_cache(enabled):
    """Run the block with the launch cache on or off (tests, bench tools: the same kernels through both paths).
    Turning it on where it is refused (interpreter, FASTCE_TORCH_LAUNCH_CACHE=0, another Triton) raises."""
    if enabled and launch_cache_setting.refusal:
        raise RuntimeError(f"the launch cache is off in this process: {launch_cache_setting.refusal}")
    saved = launch_cache_setting.enabled
    launch_cache_setting.enabled = bool(enabled)
    try:
        yield
    finally:
        launch_cache_setting.enabled = saved


_MISSING = object()

# What Triton's CUDA driver asks for the current device and stream (driver.active.get_current_device is
# torch.cuda.current_device, get_current_stream torch._C._cuda_getCurrentRawStream), as the C getters themselves: a
# cached launch skips torch.cuda.current_device's lazy-initialisation check, which cannot matter there, since a
# variant is only known after a generic launch initialised CUDA in this process, and a forked child forgets every
# variant (the fork hook in core/launch.py). CPU builds of torch have neither getter; nothing is cached there.
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)

# Triton 3.6's integer specialisation (native_specialize_impl, handle_long_type): an int equal to 1 becomes the
# constexpr 1 (unless do_not_specialize), else "i32" within the int32 range, "i64" within int64, "u64" up to 2**64 - 1
# (anything beyond raises); its attribute is "D" when divisible by 16 (unless do_not_specialize_on_alignment), else "".
_INT_TYPES = ("i32", "i64", "u64")
_INT_CLASS = (
    "(0 if -0x80000000 <= {a} <= 0x7FFFFFFF else 1 if -0x8000000000000000 <= {a} <= 0x7FFFFFFFFFFFFFFF "
    "else 2 if 0 <= {a} <= 0xFFFFFFFFFFFFFFFF else 3)"
)
_KEYED_CONSTEXPR_TYPES = (int, bool)  # constexpr values keyed by value: for these, equal values print alike


class ArgumentLayout:
    """Triton 3.6's specialisation of one kernel's arguments, for argument sets whose exact types are `types`,
    computed without its binder. `key(args, *options)` is a flat tuple of what the specialisation depends on, per
    parameter in order: a constexpr's value; a tensor's dtype, and whether its data pointer is 16-byte aligned; an
    int's == 1, divisibility by 16 and int32/int64/uint64 range (each only where Triton looks at it); nothing for a
    bool, float or None (Triton gives them "u1", "fp32", constexpr None whatever the value); then the options.
    `specialization(key)` rebuilds Triton's own specialisation list from a key, so equal keys mean equal
    specialisations, and the launcher checks it against the binder's at every variant it records.

    `build` returns None where this reproduction is not certain (another argument type, a tensor subclass, an
    annotated parameter, a constexpr neither int nor bool, a backend whose tensor specialisation is not Triton's
    native one): those argument sets are keyed by the binder."""

    def __init__(self, parts, key):
        self.parts, self.key = parts, key

    @classmethod
    def build(cls, params, types, backend):
        if len(params) != len(types) or getattr(backend, "supports_native_tensor_specialization", None) is not True:
            return None
        parts, elements = [], []
        for index, (param, kind) in enumerate(zip(params, types)):
            a = f"a{index}"
            if param.is_constexpr:
                if kind not in _KEYED_CONSTEXPR_TYPES:
                    return None
                parts.append(("constexpr", None, False, False))
                elements.append(a)
                continue
            if param.annotation_type:
                return None
            specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
            if kind is torch.Tensor:
                parts.append(("tensor", param.is_const, specialize, align))
                elements.append(f"{a}.dtype")
                if specialize and align:
                    elements.append(f"not {a}.data_ptr() & 15")
            elif kind is int:
                parts.append(("int", None, specialize, align))
                if specialize:
                    elements.append(f"{a} == 1")
                    if align:
                        elements.append(f"not {a} & 15")
                elements.append(_INT_CLASS.format(a=a))
            elif kind in (bool, float, type(None)):
                parts.append((kind.__name__, None, False, False))
            else:
                return None
        names = [f"a{index}" for index in range(len(params))]
        source = (
            "def key(args, num_warps, num_stages, debug, instrumentation_mode):\n"
            f"    {', '.join(names)}, = args\n"
            f"    return ({''.join(e + ', ' for e in elements)}num_warps, num_stages, debug, instrumentation_mode)\n"
        )
        namespace = {}
        exec(compile(source, f"<fastce launch key of {len(params)} arguments>", "exec"), namespace)
        return cls(tuple(parts), namespace["key"])

    def specialization(self, key):
        """Triton's specialisation list (its binder's second result) of the arguments that gave `key`."""
        from triton._utils import canonicalize_ptr_dtype

        result, values = [], iter(key)
        for kind, is_const, specialize, align in self.parts:
            if kind == "constexpr":
                result.append(("constexpr", next(values)))
            elif kind == "tensor":
                dtype = canonicalize_ptr_dtype(next(values), is_const)
                attribute = None
                if specialize:
                    attribute = "D" if align and next(values) else ""
                result.append((dtype, attribute))
            elif kind == "int":
                one = next(values) if specialize else False
                divisible = next(values) if specialize and align else False
                int_class = next(values)
                if int_class == 3:
                    raise OverflowError("integer to be specialized too large to represent")
                if one:
                    result.append(("constexpr", 1))
                else:
                    result.append((_INT_TYPES[int_class], ("D" if divisible else "") if specialize else None))
            elif kind == "bool":
                result.append(("u1", None))
            elif kind == "float":
                result.append(("fp32", None))
            else:
                result.append(("constexpr", None))
        return result


def binder_key(binder):
    """The launch key through Triton's binder itself, for argument sets ArgumentLayout does not cover."""

    def key(args, num_warps, num_stages, debug, instrumentation_mode):
        return tuple(binder(*args)[1]), num_warps, num_stages, debug, instrumentation_mode

    return key


class Launcher:
    """Launches one @triton.jit kernel: `cached(grid, args, ...)` calls the compiled variant's launcher directly when
    Triton has launched that variant before on this device (True), else does nothing (False), and the caller
    then calls `launch`, Triton's generic path, which also records the variant it launched.

    args are all the kernel's parameters in its signature's order, constexprs included, as Triton itself passes
    them to a compiled launcher; grid is (x, y, z). What the cached launch keeps from JITFunction.run: the current
    device and stream as Triton reads them, its check that the kernel's globals did not change (a change takes the
    generic path, which raises Triton's error), and launch hooks (any registered hook, or a pre-run hook, takes the
    generic path). What it skips: the option parsing, the binder (the key comes from ArgumentLayout, per exact
    argument types, or from Triton's binder for types it does not cover), the string key, the launch-metadata record
    (built only for launch hooks), the grid canonicalisation. A variant is recorded only after checking that Triton's
    own key for the arguments maps to the CompiledKernel it launched and that the layout's key rebuilds the binder's
    specialisation; any failure while recording turns this launcher's cache off for good (`failure` says why) and
    every launch takes the generic path."""

    def __init__(
        self, kernel, setting=launch_cache_setting, current_device=current_device, current_stream=current_stream
    ):
        self.kernel, self.setting = kernel, setting
        # device -> {exact argument types: (key function, ArgumentLayout or None, {key: (launcher, function,
        # packed metadata)})}
        self.variants = {}
        self.failure = None
        self.hits = 0  # cached launches, for tests and bench tools
        self.current_device, self.current_stream = current_device, current_stream

    def key(self, layout, args, num_warps, num_stages):
        # Triton keys its compiled variants on (its specialisation of the arguments, str(the options)), where the
        # options are the launch's keywords (num_warps, num_stages) plus debug and instrumentation_mode.
        debug = self.kernel.debug or knobs.runtime.debug
        return layout[0](args, num_warps, num_stages, debug, knobs.compilation.instrumentation_mode)

    def cached(self, grid, args, num_warps=None, num_stages=None):
        if not self.setting.enabled or self.failure is not None:
            return False
        runtime = knobs.runtime
        # Triton 3.6's hooks are HookChains; anything else set there (a plain callable) counts as a hook.
        if (
            getattr(runtime.launch_enter_hook, "calls", True)
            or getattr(runtime.launch_exit_hook, "calls", True)
            or self.kernel.pre_run_hooks
        ):
            return False
        device = self.current_device()
        layouts = self.variants.get(device)
        if layouts is None:
            return False
        layout = layouts.get(tuple(map(type, args)))
        if layout is None:
            return False
        entry = layout[2].get(
            layout[0](
                args, num_warps, num_stages, self.kernel.debug or runtime.debug, knobs.compilation.instrumentation_mode
            )
        )
        if entry is None:
            return False
        for (name, _), (value, globals_dict) in self.kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != value:
                return False
        run, function, metadata = entry
        # No hooks are registered (checked above): Triton would call empty hook chains with a metadata record.
        run(grid[0], grid[1], grid[2], self.current_stream(device), function, metadata, None, None, None, *args)
        self.hits += 1
        return True

    def launch(self, grid, args, num_warps=None, num_stages=None):
        options = {}
        if num_warps is not None:
            options["num_warps"] = num_warps
        if num_stages is not None:
            options["num_stages"] = num_stages
        compiled = self.kernel[grid](*args, **options)
        if self.setting.enabled and self.failure is None:
            try:
                self._record(compiled, args, options, num_warps, num_stages)
            except Exception as error:  # never let the cache break a launch: the generic path stays
                self.failure = f"{type(error).__name__}: {error}"
        return compiled

    def layout(self, args, device=0):
        """The (key function, ArgumentLayout or None, entries) this launcher keys these arguments' types with on
        `device` (made if new): for tests and bench tools."""
        kernel_cache, kernel_key_cache, _, backend, binder = self.kernel.device_caches[device]
        layouts = self.variants.setdefault(device, {})
        types = tuple(map(type, args))
        layout = layouts.get(types)
        if layout is None:
            argument_layout = ArgumentLayout.build(self.kernel.params, types, backend)
            key = binder_key(binder) if argument_layout is None else argument_layout.key
            layout = layouts[types] = (key, argument_layout, {})
        return layout

    def _record(self, compiled, args, options, num_warps, num_stages):
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import compute_cache_key

        if not isinstance(compiled, CompiledKernel):  # a jit_cache_hook skipped the launch, or an async compile
            raise TypeError(f"kernel[grid](...) returned {type(compiled).__name__}, not a CompiledKernel")
        device = self.current_device()
        kernel_cache, kernel_key_cache, _, _, binder = self.kernel.device_caches[device]
        specialization = binder(*args)[1]
        triton_options = dict(options)
        triton_options["debug"] = self.kernel.debug or knobs.runtime.debug
        triton_options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, triton_options)) is not compiled:
            raise RuntimeError("Triton's own key for these arguments does not give the kernel it launched")
        layout = self.layout(args, device)
        key = self.key(layout, args, num_warps, num_stages)
        if layout[1] is not None and layout[1].specialization(key) != specialization:
            raise RuntimeError("the launch key does not rebuild Triton's specialisation of these arguments")
        known = layout[2].get(key)
        if known is not None and known[2] is not compiled.packed_metadata:
            raise RuntimeError("two compiled variants under one launch key")
        layout[2][key] = (compiled.run, compiled.function, compiled.packed_metadata)

    def forget(self):
        self.variants.clear()
