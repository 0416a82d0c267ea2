"""Host time per call of fastce_torch's eager calls (what a GPU cannot hide when the kernels are short):
`PYTHONPATH=. python -m bench.tools.overhead [--json PATH]` (about a minute on the H200 machine).

Tiny inputs (the GPU idles, so wall time is host time), fastce's calls with and without the launch cache beside
do-nothing autograd.Functions and F.cross_entropy, and the summary RESULTS.md renders. CPU smoke run: `--device cpu
--calls 2 --repeat 1` with TRITON_INTERPRET=1 (launch cache off: its figures are null).
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

import fastce_torch
from bench import envinfo
from bench.report import HOST_TIME_PARTS, write_json
from fastce_torch.core import launch as core_launch
from fastce_torch.core import launch_cache as cache_module
from fastce_torch.core.options import Options
from fastce_torch.losses.cross_entropy import launch as launch_module

OPTIONS = Options()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, n=300, repeat=5):
    """Minimum over repeats of the mean wall time per call over n calls (the least disturbed by other processes)."""
    for _ in range(min(n, 20)):
        fn()
    best = float("inf")
    for _ in range(repeat):
        _synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        _synchronize()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


# --- stand-ins: autograd.Functions that do no work, and the forward launch's arguments --------------------------------


class _DoNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, grad):
        return None


class _ThreeOutputs(torch.autograd.Function):
    """The shape of fastce's Function (three outputs, two non-differentiable, four saved tensors, output gradients not
    materialised: backward gets None for the two non-differentiable outputs, not a zero tensor each), no work."""

    @staticmethod
    def forward(x, labels):
        return x.new_empty(()), x.new_empty(x.shape[0]), x.new_empty(1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, labels = inputs
        _, lse, denominator = output
        ctx.mark_non_differentiable(lse, denominator)
        ctx.save_for_backward(x, labels, lse, denominator)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad, grad_lse, grad_denominator):
        assert len(ctx.saved_tensors) == 4  # unpacking the saved tensors is part of the cost
        return None, None


def _forward_args(logits, labels, options):
    """(grid, (warps, stages), args): what launch_module.forward passes to its launcher, captured from one call."""
    captured = []

    class Capture(launch_module.Launcher):
        def cached(self, grid, args, *rest):
            captured.append((grid, rest, args))
            return True

    saved = launch_module.forward_launcher
    launch_module.forward_launcher = Capture(None)
    try:
        launch_module.forward(logits, labels, options, "mean")
    finally:
        launch_module.forward_launcher = saved
    return captured[0]


def _row(rows, name, us, note=""):
    rows[name] = us
    print(f"{name:50s} {us:7.1f} us{note}")


def _both_paths(rows, name, fn, n, repeat):
    """name's host time per call with the launch cache (when it is on) and with Triton's generic launch."""
    with core_launch.launch_cache(False):
        generic = per_call_us(fn, n, repeat)
    if not core_launch.launch_cache_enabled():
        _row(rows, name, generic, "   (generic launch; the cache is off)")
        return generic
    cached = per_call_us(fn, n, repeat)
    rows[name + ", generic"] = generic
    _row(rows, name, cached, f"   generic {generic:7.1f} us   saved {generic - cached:6.1f} us")
    return cached


def _launch_and_allocation_rows(rows, device, raw, labels, n, repeat):
    """The compiled launcher's C call alone (CUDA only) and the forward's allocations; whether the C call ran."""
    grid, (warps, stages), args = _forward_args(raw, labels, OPTIONS)
    launcher = launch_module.forward_launcher
    cached_path = launcher.failure is None and launcher.cached(grid, args, warps, stages)
    if cached_path:
        device_index = cache_module.current_device()
        layout = launcher.layout(args, device_index)
        run, function, metadata = layout[2][launcher.key(layout, args, warps, stages)]
        stream = cache_module.current_stream(device_index)
        _row(rows, "    the compiled launcher's C call alone", per_call_us(
            lambda: run(*grid, stream, function, metadata, None, None, None, *args), n, repeat))  # fmt: skip
    # The forward's zeroed buffer: its one int32 tensor argument (counters, then the float32 scratch).
    n_scratch = max((a.numel() for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32), default=0)

    def loss_and_scratch():
        empty = torch.empty((), dtype=torch.float32, device=device)
        return empty, torch.zeros(n_scratch, dtype=torch.int32, device=device)

    _row(rows, "  the forward's allocations (empty loss, zeroed scratch)", per_call_us(loss_and_scratch, n, repeat))
    return cached_path


def host_costs(device="cuda", n=300, repeat=5):
    """Part 1: ({row: us per call}, the summary), printed as measured."""
    rows = {}
    logits = torch.randn(64, 1000, device=device, requires_grad=True) * 1  # an intermediate, as lm_head's output is
    labels = torch.randint(0, 1000, (64,), device=device)
    raw = logits.detach()
    launch_module.forward(raw, labels, OPTIONS, reduction="mean")  # records the launch's variant
    leaf = logits.detach().requires_grad_()
    leaf_logits = raw.clone().requires_grad_()
    ones = torch.ones(labels.shape, device=device)

    def shaped_fwd_bwd(function):  # a fastce-shaped Function's fwd+bwd
        return lambda: torch.autograd.grad(function.apply(leaf, labels)[0], leaf, allow_unused=True)

    def step():
        return torch.autograd.grad(fastce_torch.cross_entropy(logits, labels), logits)

    def unreduced_step():  # reduction='none' keeps no counters: the forward's scratch is not filled
        return torch.autograd.grad(fastce_torch.cross_entropy(logits, labels, reduction="none"), logits, ones)

    def leaf_step(loss_fn=fastce_torch.cross_entropy):
        leaf_logits.grad = None  # as optimizer.zero_grad() leaves it
        loss_fn(leaf_logits, labels).backward()

    print(f"host time per call, 64x1000 float32 on {device} (GPU idle)")
    _both_paths(rows, "cross_entropy forward", lambda: fastce_torch.cross_entropy(logits, labels), n, repeat)
    fwd_bwd = _both_paths(rows, "cross_entropy forward+backward", step, n, repeat)
    leaf_bwd = _both_paths(rows, "cross_entropy(leaf).backward()", leaf_step, n, repeat)
    _both_paths(rows, "cross_entropy(reduction='none') fwd+bwd", unreduced_step, n, repeat)
    cached_path = _launch_and_allocation_rows(rows, device, raw, labels, n, repeat)

    print("  torch's share: autograd.Function and engine, no work (baselines no autograd.Function loss can beat):")
    baselines = {
        "do-nothing Function, forward only": lambda: _DoNothing.apply(leaf),
        "do-nothing Function fwd+bwd": lambda: torch.autograd.grad(_DoNothing.apply(leaf), leaf, allow_unused=True),
        "fastce-shaped Function fwd+bwd": shaped_fwd_bwd(_ThreeOutputs),
        "F.cross_entropy forward+backward": lambda: torch.autograd.grad(F.cross_entropy(logits, labels), logits),
        "F.cross_entropy(leaf).backward()": lambda: leaf_step(F.cross_entropy),
    }
    for name, fn in baselines.items():
        _row(rows, name, per_call_us(fn, n, repeat))
    torch.autograd.set_multithreading_enabled(False)  # backward on the calling thread: no hand-off
    try:
        _both_paths(rows, "cross_entropy fwd+bwd, engine threads off", step, n, repeat)
        for name in ("do-nothing Function fwd+bwd", "fastce-shaped Function fwd+bwd"):
            _row(rows, name + ", threads off", per_call_us(baselines[name], n, repeat))
    finally:
        torch.autograd.set_multithreading_enabled(True)
    breakdown = summary(rows, fwd_bwd, leaf_bwd, cached_path)
    try:
        _linear_rows(rows, device, n, repeat)
    except Exception as error:  # reported, never fatal to the rows above
        print(f"linear_cross_entropy fwd+bwd: skipped ({type(error).__name__}: {error})")
    return rows, breakdown


def summary(rows, fwd_bwd, leaf_bwd, cached_path):
    """What remains of the eager forward+backward and why, from the rows just measured (NaN where a row needs the
    launch cache and it did not run)."""
    nothing = rows["do-nothing Function fwd+bwd"]
    shaped = rows["fastce-shaped Function fwd+bwd"]  # what a Function with these outputs can reach
    hand_off = nothing - rows["do-nothing Function fwd+bwd, threads off"]
    launches = 2 * rows["    the compiled launcher's C call alone"] if cached_path else float("nan")
    allocations = rows["  the forward's allocations (empty loss, zeroed scratch)"]
    # What the engine's device thread costs this call beyond the bare hand-off: the threads-on minus threads-off
    # difference of the real call less that of the do-nothing Function (no CUDA work in its backward).
    thread_excess = fwd_bwd - rows["cross_entropy fwd+bwd, engine threads off"] - hand_off
    figures = {"total_us": fwd_bwd, "leaf_backward_us": leaf_bwd,
               "torch_cross_entropy_us": rows["F.cross_entropy forward+backward"], "autograd_function_us": shaped,
               "do_nothing_function_us": nothing,
               "engine_round_trip_us": nothing - rows["do-nothing Function, forward only"],
               "device_thread_hand_off_us": hand_off, "launches_us": launches, "allocations_us": allocations,
               "device_thread_excess_us": thread_excess,
               "fastce_python_us": fwd_bwd - shaped - launches - allocations - thread_excess,
               "floor_us": shaped + launches + allocations}  # fmt: skip
    print(f"what remains of cross_entropy forward+backward, {fwd_bwd:.1f} us (leaf .backward() {leaf_bwd:.1f}; "
          f"F.cross_entropy {figures['torch_cross_entropy_us']:.1f}), and why:")  # fmt: skip
    for key, label in HOST_TIME_PARTS:
        print(f"  {figures[key]:7.1f} us {label}")
    print(f"  a do-nothing Function costs {nothing:.1f} us, of which the hand-off to the device thread "
          f"{hand_off:.1f}; floor of this design on this host: {figures['floor_us']:.1f} us")  # fmt: skip
    return figures


def _linear_rows(rows, device, n, repeat, n_rows=64, hidden_size=64, vocab=1000):
    hidden = torch.randn(n_rows, hidden_size, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    inputs = (hidden, weight)

    fused = lambda: torch.autograd.grad(fastce_torch.linear_cross_entropy(hidden, weight, labels), inputs)
    unfused = lambda: torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), labels), inputs)

    name = f"linear_cross_entropy fwd+bwd ({n_rows}x{hidden_size}x{vocab})"
    _both_paths(rows, name, fused, n, repeat)
    _row(rows, "  F.linear + F.cross_entropy fwd+bwd", per_call_us(unfused, n, repeat))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tools.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the rows and the summary to this file")
    args = parser.parse_args(argv)
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name()
    cache = f"{'on' if core_launch.launch_cache_enabled() else 'off'} {cache_module.launch_cache_setting.refusal}"
    print(f"launch cache: {cache}; torch {torch.__version__}, triton {triton.__version__}, {device}")  # fmt: skip
    if device != "cpu" and not core_launch.launch_cache_enabled():
        raise SystemExit("the launch cache is off in this process: nothing to compare")
    rows, breakdown = host_costs(args.device, args.calls, args.repeat)
    result = {"date": envinfo.today(), "commit": envinfo.git_commit(), "device": device, "torch": torch.__version__,
              "calls": args.calls, "repeat": args.repeat, "rows_us": rows, "summary": breakdown}  # fmt: skip
    launchers = (launch_module.forward_launcher, launch_module.backward_launcher)
    failures = [launcher.failure for launcher in launchers if launcher.failure]
    print(f"launch cache failures: {failures or 'none'}")
    if args.json:
        # Strict JSON: a figure not measured here (NaN) is written as null.
        write_json(json.loads(json.dumps(result), parse_constant=lambda nan: None), args.json)


if __name__ == "__main__":
    main()
