"""Host-side (Python) cost of one eager fastce_torch.cross_entropy call with the Triton launches taken out, and its
parts: `PYTHONPATH=. python -m bench.tools.host_cost` (CPU is enough; on a GPU machine add --device cuda).

The two kernels are replaced by no-op launch objects, so what is timed is everything the call does on the host
besides Triton's own launch path (argument checks, Options, the layout checks, the autograd.Function with its
three outputs, the launchers' allocations and argument marshalling, the backward through the autograd engine).
Triton's launch (its dispatch on the arguments, then the driver call) comes on top: bench/tools/overhead.py measures
it on the GPU. The "cached launch" rows take the kernels' Launcher's cached path instead (the launch key, the lookup,
the call), with only the compiled launcher's C call stubbed. Minimum over repeats of the mean over
`number` calls: the minimum is the least disturbed by other processes on a shared machine. On CPU tensors the
autograd engine runs the backward on the calling thread; with CUDA tensors it hands it to a device thread, which
costs more (bench/NOTES.md).
"""

import argparse
import contextlib
import importlib
import os
import timeit

import torch

from fastce_torch import contract, kernels
from fastce_torch.kernels import launch as launch_module

ce_module = importlib.import_module("fastce_torch.cross_entropy")  # the module (the package exports the function)
cache_module = importlib.import_module("fastce_torch.kernels.launch_cache")  # kernels.launch_cache is the function


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) does nothing."""

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        return None


LAUNCHERS = ("forward_launcher", "backward_launcher")


@contextlib.contextmanager
def no_launches():
    """The launchers' generic path with Triton's launch taken out (the launch cache is off on the CPU)."""
    saved = [getattr(launch_module, name) for name in LAUNCHERS]
    for name in LAUNCHERS:
        setattr(launch_module, name, launch_module.Launcher(_NoLaunch(), setting=_Setting(False)))
    try:
        yield
    finally:
        for name, launcher in zip(LAUNCHERS, saved):
            setattr(launch_module, name, launcher)


class _Setting:
    def __init__(self, enabled):
        self.enabled = enabled


@contextlib.contextmanager
def cached_launches():
    """The launchers' cached path, everything but the compiled launcher's C call: the launchers get a stand-in JIT
    function with Triton's own binder for the CUDA backend (tests/test_launch_cache.py), whose compiled variants'
    launchers do nothing. The first launch of each variant records it, later ones take the cached path."""
    from fastce_torch.tests.test_launch_cache import FakeJIT

    saved = [getattr(launch_module, name) for name in LAUNCHERS]
    launchers = {}
    for name, kernel in zip(LAUNCHERS, (launcher.kernel for launcher in saved)):
        fake = FakeJIT(kernel)
        fake.direct = _Discard()
        launchers[name] = launch_module.Launcher(
            fake, setting=_Setting(True), current_device=lambda: 0, current_stream=lambda device: 0
        )
        setattr(launch_module, name, launchers[name])
    try:
        yield launchers
    finally:
        for name, launcher in zip(LAUNCHERS, saved):
            setattr(launch_module, name, launcher)


class _Discard:
    @staticmethod
    def append(call):
        pass


class _DoNothing(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.new_empty(())

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None


class _DoNothingCtxInForward(torch.autograd.Function):
    """_DoNothing without setup_context (ctx as forward's first argument): Function.apply then skips binding the
    arguments to forward's signature (inspect.signature on every call), which setup_context makes it do."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, grad):
        return None


class _ThreeOutputs(torch.autograd.Function):
    """The shape of fastce's Function (three outputs, two non-differentiable, four saved tensors), no work."""

    @staticmethod
    def forward(x, labels):
        return x.new_empty(()), x.new_empty(x.shape[0]), x.new_empty(1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, labels = inputs
        _, lse, denominator = output
        ctx.mark_non_differentiable(lse, denominator)
        ctx.save_for_backward(x, labels, lse, denominator)

    @staticmethod
    def backward(ctx, grad, grad_lse, grad_denominator):
        assert len(ctx.saved_tensors) == 4  # unpacking the saved tensors is part of the cost
        return None, None


class _ThreeOutputsUnmaterialized(_ThreeOutputs):
    """_ThreeOutputs with ctx.set_materialize_grads(False): autograd then hands backward None for the two
    non-differentiable outputs instead of filling a zero tensor for each (a fill launch each on a GPU)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        _ThreeOutputs.setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)


def _forward_args(logits, labels, options):
    """The argument tuple kernels.forward passes to its launcher (captured from one call)."""
    captured = []

    class Capture(launch_module.Launcher):
        def cached(self, grid, args, *rest):
            captured.append((grid, rest, args))
            return True

    saved = launch_module.forward_launcher
    launch_module.forward_launcher = Capture(None)
    try:
        kernels.forward(logits, labels, options, "mean")
    finally:
        launch_module.forward_launcher = saved
    return captured[0]


def per_call_us(fn, number, repeat):
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def breakdown(device="cpu", n_rows=64, vocab=1000, number=2000, repeat=7):
    """{name: microseconds per call}."""
    anchor = torch.zeros((), device=device, requires_grad=True)
    logits = anchor.expand(n_rows, vocab).contiguous()  # an intermediate, as lm_head's output is
    with torch.no_grad():
        logits.normal_()
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    raw = logits.detach()
    options = kernels.Options()
    lse = torch.zeros(n_rows, device=device)
    grad_loss = torch.ones((), device=device)
    denominator = torch.ones(1, device=device)
    backend = "kernel"
    rows = {}

    def time(name, fn):
        rows[name] = per_call_us(fn, number, repeat)

    with no_launches():
        time(
            "argument checks (contract.check_labels + check_options)",
            lambda: (
                contract.check_labels(labels, "logits", logits.shape, logits.device),
                contract.check_options(-100, "mean", None, 0.0, 0.0, 0.0, 0.0, backend),
            ),
        )
        if hasattr(contract, "checked_options"):  # cross_entropy's cache of checked Options
            time(
                "  check_options through cross_entropy's cache",
                lambda: contract.checked_options(-100, "mean", None, 0.0, 0.0, 0.0, 0.0, backend),
            )
        zero = 0.0
        time("Options(...) with four float() calls", lambda: contract.Options(-100, *map(float, (zero,) * 4)))
        time("row_layout + rows_overlap", lambda: (kernels.row_layout(logits), kernels.rows_overlap(logits)))
        time(
            "is_intermediate + under_functorch",
            lambda: (contract.is_intermediate(logits), contract.under_functorch()),
        )
        time("labels.reshape(-1).contiguous()", lambda: labels.reshape(-1).contiguous())
        time(
            "is_dtensor + is_compiling",
            lambda: (ce_module.sharding.is_dtensor(logits), torch.compiler.is_compiling()),
        )
        time(
            "launcher allocations (empty, empty, zeros)",
            lambda: (
                torch.empty((), dtype=torch.float32, device=device),
                torch.empty(3 * n_rows + 1, dtype=torch.float32, device=device),
                torch.zeros(n_rows + 1, dtype=torch.int32, device=device),
            ),
        )
        time("kernels.forward, launch stubbed", lambda: kernels.forward(raw, labels, options, "mean"))
        time("kernels.forward 'none' (no counters), launch stubbed", lambda: kernels.forward(raw, labels, options))
        time(
            "kernels.backward, launch stubbed",
            lambda: kernels.backward(grad_loss, raw, labels, lse, raw, options, denominator=denominator),
        )
        function = ce_module.CrossEntropyFunction
        apply_args = (logits, labels, "mean", None, True, options)
        time("_CrossEntropyFunction.apply, forward only", lambda: function.apply(*apply_args))
        base_apply = super(torch.autograd.Function, function).apply  # what Function.apply calls after binding
        time("  the same through torch._C._FunctionBase.apply", lambda: base_apply(*apply_args))
        time(
            "autograd.Function doing nothing, no setup_context",
            lambda: torch.autograd.grad(_DoNothingCtxInForward.apply(logits), logits, allow_unused=True),
        )
        time(
            "autograd.Function doing nothing, fwd+bwd",
            lambda: torch.autograd.grad(_DoNothing.apply(logits), logits, allow_unused=True),
        )
        time(
            "autograd.Function with fastce's 3 outputs, fwd+bwd",
            lambda: torch.autograd.grad(_ThreeOutputs.apply(logits, labels)[0], logits, allow_unused=True),
        )
        time(
            "  the same, output grads not materialised",
            lambda: torch.autograd.grad(
                _ThreeOutputsUnmaterialized.apply(logits, labels)[0], logits, allow_unused=True
            ),
        )
        time("cross_entropy forward, launch stubbed", lambda: ce_module.cross_entropy(logits, labels, backend=backend))
        time(
            "cross_entropy forward+backward, launches stubbed",
            lambda: torch.autograd.grad(ce_module.cross_entropy(logits, labels, backend=backend), logits),
        )
        ones = torch.ones(n_rows, device=device)
        time(
            "cross_entropy 'none' forward+backward, launches stubbed",
            lambda: torch.autograd.grad(
                ce_module.cross_entropy(logits, labels, reduction="none", backend=backend), logits, ones
            ),
        )
    with cached_launches() as launchers:
        time(
            "kernels.forward, cached launch (C launcher stubbed)", lambda: kernels.forward(raw, labels, options, "mean")
        )
        time(
            "kernels.backward, cached launch (C launcher stubbed)",
            lambda: kernels.backward(grad_loss, raw, labels, lse, raw, options, denominator=denominator),
        )
        forward = launchers["forward_launcher"]
        _, _, args = _forward_args(raw, labels, options)
        layout = forward.layout(args)
        binder = forward.kernel.device_caches[0][4]
        assert layout[1] is not None  # the real arguments are keyed without the binder
        time("  the forward's launch key (kernels._ArgumentLayout)", lambda: forward.key(layout, args, 4, 3))
        time(
            "  the forward's key through Triton's binder",
            lambda: cache_module.binder_key(binder)(args, 4, 3, False, ""),
        )
        time(
            "cross_entropy forward+backward, cached launches",
            lambda: torch.autograd.grad(ce_module.cross_entropy(logits, labels, backend=backend), logits),
        )
        assert forward.hits and launchers["backward_launcher"].hits and forward.failure is None
    with no_launches():
        time(
            "F.cross_entropy forward+backward (baseline)",
            lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels), logits),
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tools.host_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"host cost per call, Triton launches stubbed, device {args.device}, pid {os.getpid()}")
    for name, us in breakdown(args.device, number=args.number, repeat=args.repeat).items():
        print(f"{name:52s} {us:8.1f} us")


if __name__ == "__main__":
    main()
