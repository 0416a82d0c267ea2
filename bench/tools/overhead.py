"""Host-side cost per call of fastce_torch (what a GPU cannot hide when the kernels are short):
`PYTHONPATH=. python -m bench.tools.overhead` (about a minute on the H200 machine).

Part 1 times the Python + launch path with tiny inputs (the GPU idle, so wall time per call is host time), each row
twice: through the launch cache (the kernels' Launcher calling the compiled launcher directly) and through Triton's
generic `kernel[grid](...)` (kernels.launch_cache(False)), beside the baselines no loss can beat: an
autograd.Function that does nothing, one shaped like fastce's (three outputs, two non-differentiable, four saved
tensors), each the autograd engine's own round trip (on a CUDA graph task the backward runs on the engine's device
thread, so the caller waits for a thread hand-off), and F.cross_entropy. Between them: the launch path (kernels.forward
and backward with Triton's launch stubbed, _Launcher.cached, its launch key against Triton's binder, the compiled
launcher's C call alone, the device and stream getters), the forward's allocations, torch's share (a do-nothing
Function forward only, forward+backward, engine threads off), the backward's launch handed to another thread (as the
engine runs it) against a bare hand-off, leaf `.backward()` rows (as Unsloth's and most users' code call a loss),
and a closing summary of what remains of the eager forward+backward, computed from the rows.
`--part1-only --device cpu --calls 2 --repeat 1` (TRITON_INTERPRET=1) is a smoke run of part 1 on a CPU.
`--profile-entry-points` instead profiles cross_entropy (non-leaf and leaf) and those two calls (below) after their
timings: cProfile's top Python functions by own time, and torch.profiler's host-side table (aten ops and CUDA runtime
calls such as cudaStreamSynchronize), the evidence for where their host time goes.
Then linear_cross_entropy forward+backward at a tiny shape against F.linear + F.cross_entropy, and the
vocab-parallel call on a one-rank process group (NCCL on a GPU, gloo on a CPU) with the share of its collectives
(the same all-reduces replayed alone); each row is skipped, with its reason, when it cannot run here.
Part 2 times forward+backward of real shapes: eager (do_bench, as `python -m bench`) with and without the cache, the
two kernels launched back to back without autograd, and the two kernels replayed from a CUDA graph (kernel time
alone: no host work at all).
Part 2b does the same for the vocab-parallel call at the two-GPU bench's local shard shapes on a one-rank NCCL group
(eager, without process_group, its kernels back to back, its all-reduces alone): host-bound or not.
Part 3 checks that cached and generic launches give bitwise the same loss and gradient on a set of shapes, dtypes
and options (as fastce_torch/tests/test_launch_cache.py does under pytest --gpu).
"""

import contextlib
import json
import queue
import socket
import threading
import time

import torch
import triton.testing

import fastce_torch
from bench import envinfo
from fastce_torch import kernels
from fastce_torch.kernels import launch as launch_module

from . import host_cost

# _ThreeOutputs*: no-work stand-ins for fastce's Function
from .host_cost import _ThreeOutputs, _ThreeOutputsUnmaterialized, cache_module, ce_module

OPTIONS = kernels.Options()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, n=300, repeat=5):
    """Minimum over repeats of the mean wall time per call over n calls (synchronised at both ends)."""
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


class _DoNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, grad):
        return None


def _row(rows, name, us, note=""):
    rows[name] = us
    print(f"{name:50s} {us:7.1f} us{note}")


def _both_paths(rows, name, fn, n, repeat):
    """name's host time per call with the launch cache (when it is on) and with Triton's generic launch."""
    with kernels.launch_cache(False):
        generic = per_call_us(fn, n, repeat)
    if not kernels.launch_cache_enabled():
        _row(rows, name, generic, "   (generic launch; the cache is off)")
        return generic
    cached = per_call_us(fn, n, repeat)
    rows[name + ", generic"] = generic
    _row(rows, name, cached, f"   generic {generic:7.1f} us   saved {generic - cached:6.1f} us")
    return cached


def host_costs(device="cuda", n=300, repeat=5):
    """Part 1: ({row: us per call}, summary's breakdown), printed as measured, then what remains of the eager
    forward+backward and why."""
    rows = {}
    logits = torch.randn(64, 1000, device=device, requires_grad=True) * 1
    labels = torch.randint(0, 1000, (64,), device=device)
    raw = logits.detach()
    _, lse, denominator = kernels.forward(raw, labels, OPTIONS, reduction="mean")
    grad_loss = torch.ones((), device=device)
    grad_buffer = torch.empty_like(raw)
    leaf = logits.detach().requires_grad_()
    leaf_logits = raw.clone().requires_grad_()

    def step():
        return torch.autograd.grad(fastce_torch.cross_entropy(logits, labels), logits)

    def leaf_step():
        leaf_logits.grad = None  # as optimizer.zero_grad() leaves it
        fastce_torch.cross_entropy(leaf_logits, labels).backward()

    def torch_leaf_step():
        leaf_logits.grad = None
        torch.nn.functional.cross_entropy(leaf_logits, labels).backward()

    print(f"part 1: host time per call, 64x1000 float32 on {device} (GPU idle)")
    _both_paths(
        rows, "kernels.forward (1 launch)", lambda: kernels.forward(raw, labels, OPTIONS, reduction="mean"), n, repeat
    )
    _both_paths(
        rows,
        "kernels.backward (1 launch)",
        lambda: kernels.backward(grad_loss, raw, labels, lse, grad_buffer, OPTIONS, denominator=denominator),
        n,
        repeat,
    )
    _both_paths(
        rows,
        "kernels.forward + backward, no autograd",
        lambda: kernels.backward(
            grad_loss, raw, labels, kernels.forward(raw, labels, OPTIONS, reduction="mean")[1], grad_buffer, OPTIONS,
            denominator=denominator,
        ),
        n,
        repeat,
    )  # fmt: skip
    _both_paths(rows, "cross_entropy forward", lambda: fastce_torch.cross_entropy(logits, labels), n, repeat)
    fwd_bwd = _both_paths(rows, "cross_entropy forward+backward", step, n, repeat)
    leaf_bwd = _both_paths(rows, "cross_entropy(leaf).backward()", leaf_step, n, repeat)
    ones = torch.ones(labels.shape, device=device)
    _both_paths(
        rows,
        "cross_entropy(reduction='none') fwd+bwd",  # no counters: the forward's scratch is not filled
        lambda: torch.autograd.grad(fastce_torch.cross_entropy(logits, labels, reduction="none"), logits, ones),
        n,
        repeat,
    )

    print("  the launch path, forward kernel (64x1000, reduction 'mean'):")
    with host_cost.no_launches():
        stubbed_forward = per_call_us(lambda: kernels.forward(raw, labels, OPTIONS, "mean"), n, repeat)
        stubbed_backward = per_call_us(
            lambda: kernels.backward(grad_loss, raw, labels, lse, grad_buffer, OPTIONS, denominator=denominator),
            n,
            repeat,
        )
    _row(rows, "  kernels.forward, Triton's launch stubbed", stubbed_forward)
    _row(rows, "  kernels.backward, Triton's launch stubbed", stubbed_backward)
    grid, (warps, stages), args = host_cost._forward_args(raw, labels, OPTIONS)
    launcher = launch_module.forward_launcher
    cached_path = launcher.failure is None and launcher.cached(grid, args, warps, stages)
    if cached_path:
        device_index = cache_module.current_device()
        layout = launcher.layout(args, device_index)
        binder = launcher.kernel.device_caches[device_index][4]
        run, function, metadata = layout[2][launcher.key(layout, args, warps, stages)]
        stream = cache_module.current_stream(device_index)
        _row(
            rows,
            "  _Launcher.cached (key, lookup, C launch)",
            per_call_us(lambda: launcher.cached(grid, args, warps, stages), n, repeat),
        )
        _row(
            rows,
            "    launch key (kernels._ArgumentLayout)",
            per_call_us(lambda: launcher.key(layout, args, warps, stages), n, repeat),
        )
        _row(
            rows,
            "    the same key through Triton's binder",
            per_call_us(lambda: cache_module.binder_key(binder)(args, warps, stages, False, ""), n, repeat),
        )
        _row(
            rows,
            "    the compiled launcher's C call alone",
            per_call_us(lambda: run(*grid, stream, function, metadata, None, None, None, *args), n, repeat),
        )
        _row(
            rows,
            "    the current device and stream",
            per_call_us(lambda: cache_module.current_stream(cache_module.current_device()), n, repeat),
        )
    # The forward's zeroed buffer: its one int32 tensor argument (counters, then the float32 scratch).
    n_scratch = max((a.numel() for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32), default=0)
    _row(
        rows,
        "  the forward's allocations (empty loss, zeroed scratch)",
        per_call_us(
            lambda: (
                torch.empty((), dtype=torch.float32, device=device),
                torch.zeros(n_scratch, dtype=torch.int32, device=device),
            ),
            n,
            repeat,
        ),
    )
    _row(
        rows,
        "    torch.empty of the same scratch (no fill)",
        per_call_us(lambda: torch.empty(n_scratch, dtype=torch.int32, device=device), n, repeat),
    )

    print("  torch's share: autograd.Function and engine, no work (baselines no autograd.Function loss can beat):")
    function = ce_module.CrossEntropyFunction
    apply_args = (logits, labels, "mean", None, True, OPTIONS)
    try:
        _row(
            rows,
            "  _CrossEntropyFunction.apply, forward only",
            per_call_us(lambda: ce_module.apply_function(function, *apply_args), n, repeat),
        )
    except Exception as error:  # the Function's signature is cross_entropy.py's; this row follows it or is left out
        print(f"  _CrossEntropyFunction.apply: not measured ({type(error).__name__}: {error})")
    baselines = {
        "do-nothing Function, forward only": lambda: _DoNothing.apply(leaf),
        "do-nothing Function fwd+bwd": lambda: torch.autograd.grad(_DoNothing.apply(leaf), leaf, allow_unused=True),
        "fastce-shaped Function fwd+bwd": lambda: torch.autograd.grad(
            _ThreeOutputs.apply(leaf, labels)[0], leaf, allow_unused=True
        ),
        "  the same, output grads not materialised": lambda: torch.autograd.grad(
            _ThreeOutputsUnmaterialized.apply(leaf, labels)[0], leaf, allow_unused=True
        ),
        "F.cross_entropy forward+backward": lambda: torch.autograd.grad(
            torch.nn.functional.cross_entropy(logits, labels), logits
        ),
        "F.cross_entropy(leaf).backward()": torch_leaf_step,
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
    _other_thread_rows(
        rows,
        lambda: kernels.backward(grad_loss, raw, labels, lse, grad_buffer, OPTIONS, denominator=denominator),
        n,
        repeat,
    )
    breakdown = summary(rows, fwd_bwd, leaf_bwd, cached_path)
    other_entry_points(rows, device, n, repeat)
    return rows, breakdown


class _OtherThread:
    """A thread that runs one callable per request while the caller waits, as the autograd engine's device thread
    runs a backward on CUDA tensors."""

    def __init__(self):
        self._todo, self._done = queue.SimpleQueue(), queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while (fn := self._todo.get()) is not None:
            try:
                fn()
            finally:
                self._done.put(None)

    def __call__(self, fn):
        self._todo.put(fn)
        self._done.get()

    def close(self):
        self._todo.put(None)
        self._thread.join()


def _other_thread_rows(rows, backward_call, n, repeat):
    """Whether the backward's launch path costs more on another thread than on the caller's (the engine runs it on
    its device thread): the hand-off alone, then the same backward launch handed over."""
    other = _OtherThread()
    try:
        handoff = per_call_us(lambda: other(_nothing), n, repeat)
        handed = per_call_us(lambda: other(backward_call), n, repeat)
    finally:
        other.close()
    _row(rows, "a hand-off to another thread and back (no work)", handoff)
    _row(rows, "kernels.backward (1 launch) on another thread", handed)
    print(f"  kernels.backward on another thread: {handed - handoff:.1f} us besides the hand-off, against "
          f"{rows.get('kernels.backward (1 launch)', float('nan')):.1f} us on this thread")  # fmt: skip


def _nothing():
    return None


def _skip(name, why):
    print(f"{name:50s} skipped: {why}")


def profile_cross_entropy(device, n):
    """cross_entropy's forward+backward profiled both ways users call it: autograd.grad on non-leaf logits, and
    .backward() on leaf logits (whose host time has measured 26-170 us above the non-leaf call's, where
    F.cross_entropy's two differ by ~4 us)."""
    logits = torch.randn(64, 1000, device=device, requires_grad=True) * 1
    labels = torch.randint(0, 1000, (64,), device=device)
    leaf_logits = logits.detach().clone().requires_grad_()

    def leaf_step():
        leaf_logits.grad = None
        fastce_torch.cross_entropy(leaf_logits, labels).backward()

    profile_call("cross_entropy fwd+bwd (64x1000)", lambda: torch.autograd.grad(
        fastce_torch.cross_entropy(logits, labels), logits), n)  # fmt: skip
    profile_call("cross_entropy(leaf).backward() (64x1000)", leaf_step, n)


def other_entry_points(rows, device, n, repeat, profile=False):
    """linear_cross_entropy and the vocab-parallel call, each beside the plain-torch equivalent it replaces."""
    print("  other entry points (default backend: the kernels on CUDA, plain torch on a CPU):")
    try:
        _linear_rows(rows, device, n, repeat, profile)
    except Exception as error:  # a row that cannot run here is reported, never fatal to the other rows
        _skip("linear_cross_entropy fwd+bwd", f"{type(error).__name__}: {error}")
    try:
        _vocab_parallel_rows(rows, device, n, repeat, profile)
    except Exception as error:
        _skip("vocab-parallel cross_entropy fwd+bwd", f"{type(error).__name__}: {error}")


def _linear_rows(rows, device, n, repeat, profile=False, n_rows=64, hidden_size=64, vocab=1000):
    hidden = torch.randn(n_rows, hidden_size, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    inputs = (hidden, weight)

    def fused():
        return torch.autograd.grad(fastce_torch.linear_cross_entropy(hidden, weight, labels), inputs)

    def unfused():
        logits = torch.nn.functional.linear(hidden, weight)
        return torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels), inputs)

    shape = f"{n_rows}x{hidden_size}x{vocab}"
    _both_paths(rows, f"linear_cross_entropy fwd+bwd ({shape})", fused, n, repeat)
    _row(rows, "  F.linear + F.cross_entropy fwd+bwd", per_call_us(unfused, n, repeat))
    if profile:
        profile_call(f"linear_cross_entropy fwd+bwd ({shape})", fused, n)
        profile_call("F.linear + F.cross_entropy fwd+bwd", unfused, n)


def profile_call(name, step, n, top=18):
    """Where one call's host time goes: cProfile's functions by own time, then torch.profiler's host table (aten
    ops and CUDA runtime calls; a cudaStreamSynchronize or cudaMemcpy there is a wait for the device)."""
    import cProfile
    import io
    import pstats

    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"--- profile: {name}, {n} calls; cProfile by own time ---")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as trace:
        for _ in range(n):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"--- profile: {name}, {n} calls; torch.profiler by self CPU time ---")
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(backend):
    """A process group of this process alone (rank 0 of 1) on a free local port, destroyed afterwards."""
    dist = torch.distributed
    if dist.is_initialized():  # someone else's group: use it as it is
        yield dist.group.WORLD
        return
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _recorded_all_reduces(record):
    """torch.distributed.all_reduce, recording (a copy of the tensor, op, group) for every call."""
    dist = torch.distributed
    original = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record.append((tensor.detach().clone(), op, group))
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording
    try:
        yield
    finally:
        dist.all_reduce = original


def all_reduces_of(step):
    """(the all-reduces one call of step() makes, as (tensor copy, op, group), a function that replays them alone).
    step() runs twice: once to make the communicator (on the first collective), once recorded."""
    step()
    collectives = []
    with _recorded_all_reduces(collectives):
        step()

    def replay():
        for tensor, op, group in collectives:
            torch.distributed.all_reduce(tensor, op=op, group=group)

    return collectives, replay


def _vocab_parallel_rows(rows, device, n, repeat, profile=False, n_rows=64, vocab=1000):
    name = f"vocab-parallel cross_entropy fwd+bwd ({n_rows}x{vocab}, 1 rank)"
    dist = torch.distributed
    if not dist.is_available():
        return _skip(name, "torch.distributed is not available")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        return _skip(name, "this torch has no NCCL")
    if backend == "gloo" and not dist.is_gloo_available():
        return _skip(name, "this torch has no gloo")
    logits = torch.randn(n_rows, vocab, device=device, requires_grad=True) * 1
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    with one_rank_group(backend) as group:

        def step():
            loss = fastce_torch.cross_entropy(logits, labels, process_group=group)
            return torch.autograd.grad(loss, logits)

        collectives, collectives_alone = all_reduces_of(step)
        total = _both_paths(rows, name + f", {backend}", step, n, repeat)
        alone = per_call_us(collectives_alone, n, repeat)
        sizes = ", ".join(f"{tuple(t.shape)} {str(op).rsplit('.', 1)[-1]}" for t, op, _ in collectives)
        _row(
            rows,
            f"  its {len(collectives)} all-reduces alone",
            alone,
            f"   ({alone / total:.0%} of the call; {sizes})",
        )
        _row(
            rows,
            "  the same call without process_group",
            per_call_us(lambda: torch.autograd.grad(fastce_torch.cross_entropy(logits, labels), logits), n, repeat),
        )
        if profile:
            profile_call(name + f", {backend}", step, n)


def summary(rows, fwd_bwd, leaf_bwd, cached_path):
    """What remains of the eager forward+backward and why, from the rows just measured."""
    nothing = rows["do-nothing Function fwd+bwd"]
    # The cheaper of the two fastce-shaped Functions: what a Function with these outputs can reach.
    shaped = min(rows["fastce-shaped Function fwd+bwd"], rows["  the same, output grads not materialised"])
    hand_off = nothing - rows["do-nothing Function fwd+bwd, threads off"]
    engine = nothing - rows["do-nothing Function, forward only"]
    launches = 2 * rows["    the compiled launcher's C call alone"] if cached_path else float("nan")
    keys = rows["    launch key (kernels._ArgumentLayout)"] if cached_path else float("nan")
    allocations = rows["  the forward's allocations (empty loss, zeroed scratch)"]
    # What the engine's device thread costs this call beyond the bare hand-off: the threads-on minus threads-off
    # difference of the real call less that of the do-nothing Function (no CUDA work in its backward; the
    # fastce-shaped one with materialised output grads allocates zeros there, so it is no baseline).
    threads_real = fwd_bwd - rows["cross_entropy fwd+bwd, engine threads off"]
    thread_excess = threads_real - hand_off
    ours = fwd_bwd - shaped - launches - allocations - thread_excess
    print("what remains of cross_entropy forward+backward, and why (from the rows above):")
    print(
        f"  total {fwd_bwd:.1f} us (leaf .backward() {leaf_bwd:.1f} us); F.cross_entropy "
        f"{rows['F.cross_entropy forward+backward']:.1f} us (leaf {rows['F.cross_entropy(leaf).backward()']:.1f})"
    )
    print(
        f"  {shaped:.1f} us torch's autograd.Function with fastce's outputs and saved tensors, doing nothing: "
        f"a do-nothing Function costs {nothing:.1f} us, of which the engine's round trip {engine:.1f} us and the "
        f"hand-off to the device thread {hand_off:.1f} us; no eager autograd.Function goes below it (a CUDA graph "
        f"of the step does)"
    )
    print(
        f"  {launches:.1f} us two C launches (the compiled launchers' own call into the driver; no Python left "
        f"in them to cut)"
    )
    print(
        f"  {allocations:.1f} us the forward's two allocations (the scratch's counters must start at zero: a fill "
        f"launch; {rows['    torch.empty of the same scratch (no fill)']:.1f} us without it)"
    )
    print(
        f"  {thread_excess:.1f} us what the engine's device thread costs this call beyond the bare hand-off "
        f"(threads on minus off: this call {threads_real:.1f} us, the do-nothing Function {hand_off:.1f} us): the "
        f"backward's Python and launch run on a thread woken for them; engine threads off or a CUDA graph of the "
        f"step avoid it"
    )
    print(
        f"  {ours:.1f} us fastce's own Python around them (argument checks, layouts, views, launch keys {keys:.1f} us "
        f"for the forward, lookups); what could still go is in this share"
    )
    apply_forward = rows.get("  _CrossEntropyFunction.apply, forward only")
    stubbed = rows["  kernels.forward, Triton's launch stubbed"], rows["  kernels.backward, Triton's launch stubbed"]
    if apply_forward is not None:
        before = rows["cross_entropy forward"] - apply_forward
        print(
            f"    of which before the Function's apply (checks, Options, layout) {before:.1f} us; kernels.forward / "
            f"backward without their launches {stubbed[0]:.1f} / {stubbed[1]:.1f} us"
        )
    if cached_path:
        path = rows["  _Launcher.cached (key, lookup, C launch)"]
        binder = rows["    the same key through Triton's binder"]
        c_call = rows["    the compiled launcher's C call alone"]
        print(
            f"    the cached launch path per launch {path:.1f} us: key {keys:.1f} (Triton's binder would take "
            f"{binder:.1f}), C call {c_call:.1f}, the rest (hook checks, device, stream, lookups) "
            f"{path - keys - c_call:.1f}"
        )
    floor = shaped + launches + allocations
    print(f"  floor of this design on this host: {floor:.1f} us; the 100 us target is "
          f"{'within reach' if floor <= 100 else 'below the autograd machinery and the launches alone'}")  # fmt: skip
    return {
        "total_us": fwd_bwd,
        "leaf_backward_us": leaf_bwd,
        "torch_cross_entropy_us": rows["F.cross_entropy forward+backward"],
        "autograd_function_us": shaped,
        "do_nothing_function_us": nothing,
        "engine_round_trip_us": engine,
        "device_thread_hand_off_us": hand_off,
        "launches_us": launches,
        "allocations_us": allocations,
        "device_thread_excess_us": thread_excess,
        "fastce_python_us": ours,
        "floor_us": floor,
    }


def device_times(shapes=((512, 256000), (8192, 32000))):
    """Part 2: [{N, V, and the four times in ms}], printed as measured."""
    print("part 2: forward+backward of real shapes, bf16, ms (do_bench medians)")
    measured = []
    for n_rows, vocab in shapes:
        logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (n_rows,), device="cuda")
        labels[::7] = -100
        logits_nonleaf = logits * 1  # an intermediate: the backward writes in place, as in training

        def step():
            return torch.autograd.grad(
                fastce_torch.cross_entropy(logits_nonleaf, labels), logits_nonleaf, retain_graph=True
            )

        eager = triton.testing.do_bench(step, return_mode="median")
        with kernels.launch_cache(False):
            eager_generic = triton.testing.do_bench(step, return_mode="median")
        raw = logits_nonleaf.detach()
        grad_loss = torch.ones((), device="cuda")

        def kernels_only():
            _, lse, denominator = kernels.forward(raw, labels, OPTIONS, reduction="mean")
            kernels.backward(grad_loss, raw, labels, lse, raw, OPTIONS, denominator=denominator)

        launched = triton.testing.do_bench(kernels_only, return_mode="median")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kernels_only()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels_only()
        replayed = triton.testing.do_bench(graph.replay, return_mode="median")
        print(
            f"N={n_rows} V={vocab}: eager {eager:.3f} (generic launches {eager_generic:.3f}), kernels launched back "
            f"to back {launched:.3f}, kernels from a CUDA graph {replayed:.3f}"
        )
        measured.append(
            dict(
                N=n_rows,
                V=vocab,
                eager_ms=eager,
                eager_generic_ms=eager_generic,
                kernels_ms=launched,
                graph_ms=replayed,
            )
        )
    return measured


def vocab_parallel_device_times(shapes=((8192, 64128), (8192, 128000))):
    """The vocab-parallel call at the local shard shapes of the two-GPU bench (V = 128256 and 256000 over two ranks)
    on a one-rank NCCL group: is an isolated call bound by its host work? Eager forward+backward against the same
    logits without process_group, the vocab-parallel kernels launched back to back (no collectives), and the two
    all-reduces alone; eager well above kernels + collectives means the GPU waits on the host."""
    print("part 2b: vocab-parallel forward+backward at the two-GPU bench's local shard shapes, one NCCL rank, ms")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available()):
        return _skip("part 2b", "this torch has no NCCL")
    with one_rank_group("nccl") as group:
        for n_rows, vocab in shapes:
            logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            labels = torch.randint(0, vocab, (n_rows,), device="cuda")
            labels[::7] = -100
            logits_nonleaf = logits * 1

            def step(process_group=group):
                loss = fastce_torch.cross_entropy(logits_nonleaf, labels, process_group=process_group)
                return torch.autograd.grad(loss, logits_nonleaf, retain_graph=True)

            _, collectives_alone = all_reduces_of(step)
            eager = triton.testing.do_bench(step, return_mode="median")
            local = triton.testing.do_bench(lambda: step(None), return_mode="median")
            raw = logits_nonleaf.detach()
            grad_loss = torch.ones((), device="cuda")

            def kernels_only():
                lse, *_ = kernels.forward(raw, labels, OPTIONS, vocab_start=0, vocab_total=vocab)
                kernels.backward(grad_loss, raw, labels, lse, raw, OPTIONS, vocab_start=0, vocab_total=vocab)

            launched = triton.testing.do_bench(kernels_only, return_mode="median")
            alone = triton.testing.do_bench(collectives_alone, return_mode="median")
            print(
                f"N={n_rows} V_local={vocab}: eager {eager:.3f}, without process_group {local:.3f}, its kernels "
                f"back to back {launched:.3f} + its all-reduces alone {alone:.3f} = {launched + alone:.3f}"
            )


def bitwise_check():
    from fastce_torch.tests.test_launch_cache import GPU_CASES, _step, bits

    device = torch.device("cuda")
    hits = launch_module.forward_launcher.hits, launch_module.backward_launcher.hits
    for strided in (False, True):
        for case in GPU_CASES:
            with kernels.launch_cache(False):
                expected = _step(case, 0, device, strided)
            _step(case, 1, device, strided)  # records the variants (first call of a new one may be generic)
            got = _step(case, 0, device, strided)
            same = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected))
            if not same:
                raise SystemExit(f"cached and generic launches differ: {case}, strided={strided}")
    hits = launch_module.forward_launcher.hits - hits[0], launch_module.backward_launcher.hits - hits[1]
    print(f"part 3: cached == generic bitwise on {2 * len(GPU_CASES)} cases ({hits[0]} + {hits[1]} cached launches)")


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.tools.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300, help="calls per timing (part 1)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--part1-only", action="store_true", help="part 1 alone (a CPU smoke run: TRITON_INTERPRET=1)")
    parser.add_argument(
        "--profile-entry-points",
        action="store_true",
        help="only the linear_cross_entropy and vocab-parallel rows, each profiled (cProfile, torch.profiler)",
    )
    parser.add_argument("--json", help="also write the rows, the summary and part 2 to this file")
    parser.add_argument(
        "--resummarize",
        metavar="JSON",
        help="measure nothing: recompute the summary of a --json file from its rows (after the summary's formula "
        "changes) and write it back",
    )
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize)
    gpu = args.device != "cpu"
    print(
        f"launch cache: {'on' if kernels.launch_cache_enabled() else 'off'} "
        f"{cache_module.launch_cache_setting.refusal}; torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name() if gpu else 'cpu'}"
    )
    if gpu and not kernels.launch_cache_enabled():
        raise SystemExit("the launch cache is off in this process: nothing to compare")
    if args.profile_entry_points:
        profile_cross_entropy(args.device, args.calls)
        other_entry_points({}, args.device, args.calls, args.repeat, profile=True)
        return
    rows, breakdown = host_costs(args.device, args.calls, args.repeat)
    result = {
        "date": envinfo.today(),
        "commit": envinfo.git_commit(),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "calls": args.calls,
        "repeat": args.repeat,
        "rows_us": rows,
        "summary": breakdown,
    }
    if not args.part1_only:
        result["device_times"] = device_times()
        parts_2b_and_3()
    if args.json:
        _write_json(args.json, result)


def resummarize(path):
    with open(path) as f:
        result = json.load(f)
    rows = {name: float("nan") if us is None else us for name, us in result["rows_us"].items()}
    cached_path = "    launch key (kernels._ArgumentLayout)" in rows
    fwd_bwd, leaf_bwd = rows["cross_entropy forward+backward"], rows["cross_entropy(leaf).backward()"]
    result["summary"] = summary(rows, fwd_bwd, leaf_bwd, cached_path)
    _write_json(path, result)


def _write_json(path, result):
    """Strict JSON: a figure not measured here (NaN) is written as null."""
    with open(path, "w") as f:
        json.dump(_nan_to_none(result), f, indent=1, allow_nan=False)


def _nan_to_none(value):
    if isinstance(value, dict):
        return {key: _nan_to_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(item) for item in value]
    return None if isinstance(value, float) and value != value else value


def parts_2b_and_3():
    """The vocab-parallel device times (reported, never fatal), the bitwise check, and the launch cache's failures."""
    try:
        vocab_parallel_device_times()
    except Exception as error:  # reported, never fatal to part 3
        _skip("part 2b", f"{type(error).__name__}: {error}")
    bitwise_check()
    failures = {
        name: launcher.failure
        for name, launcher in (
            ("forward", launch_module.forward_launcher),
            ("backward", launch_module.backward_launcher),
        )
        if launcher.failure
    }
    print(f"launch cache failures: {failures or 'none'}")


if __name__ == "__main__":
    main()
