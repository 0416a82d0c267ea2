"""Host-side cost per call of fastce_torch (what a GPU cannot hide when the kernels are short):
`PYTHONPATH=. python -m bench.tools.overhead` (about a minute on the H200 machine).

Part 1 times the Python + launch path with tiny inputs (the GPU idle, so wall time per call is host time), each row
twice: through the launch cache (kernels._Launcher's direct call of the compiled launcher) and through Triton's
generic `kernel[grid](...)` (kernels.launch_cache(False)), beside the baselines no loss can beat: an
autograd.Function that does nothing, one shaped like fastce's (three outputs, two non-differentiable, four saved
tensors), each the autograd engine's own round trip (on a CUDA graph task the backward runs on the engine's device
thread, so the caller waits for a thread hand-off), and F.cross_entropy.
Part 2 times forward+backward of real shapes: eager (do_bench, as `python -m bench`) with and without the cache, the
two kernels launched back to back without autograd, and the two kernels replayed from a CUDA graph (kernel time
alone: no host work at all).
Part 3 checks that cached and generic launches give bitwise the same loss and gradient on a set of shapes, dtypes
and options (as fastce_torch/tests/test_launch_cache.py does under pytest --gpu).
"""

import time

import torch
import triton.testing

import fastce_torch
from fastce_torch import kernels

from .host_cost import _ThreeOutputs, _ThreeOutputsUnmaterialized  # no-work stand-ins for fastce's Function

OPTIONS = kernels.Options()


def per_call_us(fn, n=300, repeat=5):
    """Minimum over repeats of the mean wall time per call over n calls (synchronised at both ends)."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


class _DoNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, grad):
        return None


def _both_paths(name, fn):
    """name's host time per call with the launch cache and with Triton's generic launch."""
    cached = per_call_us(fn)
    with kernels.launch_cache(False):
        generic = per_call_us(fn)
    print(f"{name:46s} cached {cached:7.1f} us   generic {generic:7.1f} us   saved {generic - cached:6.1f} us")
    return cached, generic


def host_costs():
    logits = torch.randn(64, 1000, device="cuda", requires_grad=True) * 1
    labels = torch.randint(0, 1000, (64,), device="cuda")
    raw = logits.detach()
    _, lse, denominator = kernels.forward(raw, labels, OPTIONS, reduction="mean")
    grad_loss = torch.ones((), device="cuda")
    grad_buffer = torch.empty_like(raw)
    leaf = logits.detach().requires_grad_()

    def step():
        return torch.autograd.grad(fastce_torch.cross_entropy(logits, labels), logits)

    print("part 1: host time per call, 64x1000 float32 (GPU idle)")
    _both_paths("kernels.forward (1 launch)", lambda: kernels.forward(raw, labels, OPTIONS, reduction="mean"))
    _both_paths(
        "kernels.backward (1 launch)",
        lambda: kernels.backward(grad_loss, raw, labels, lse, grad_buffer, OPTIONS, denominator=denominator),
    )
    _both_paths(
        "kernels.forward + backward, no autograd",
        lambda: kernels.backward(
            grad_loss, raw, labels, kernels.forward(raw, labels, OPTIONS, reduction="mean")[1], grad_buffer, OPTIONS,
            denominator=denominator,
        ),
    )  # fmt: skip
    _both_paths("cross_entropy forward", lambda: fastce_torch.cross_entropy(logits, labels))
    fwd_bwd, _ = _both_paths("cross_entropy forward+backward", step)
    baselines = {
        "do-nothing autograd.Function fwd+bwd": lambda: torch.autograd.grad(
            _DoNothing.apply(leaf), leaf, allow_unused=True
        ),
        "fastce-shaped autograd.Function fwd+bwd": lambda: torch.autograd.grad(
            _ThreeOutputs.apply(leaf, labels)[0], leaf, allow_unused=True
        ),
        "  the same, output grads not materialised": lambda: torch.autograd.grad(
            _ThreeOutputsUnmaterialized.apply(leaf, labels)[0], leaf, allow_unused=True
        ),
        "F.cross_entropy forward+backward": lambda: torch.autograd.grad(
            torch.nn.functional.cross_entropy(logits, labels), logits
        ),
    }
    shaped = None
    for name, fn in baselines.items():
        us = per_call_us(fn)
        shaped = us if name.startswith("fastce-shaped") else shaped
        print(f"{name:46s} {us:7.1f} us")
    print(
        f"of cross_entropy forward+backward ({fwd_bwd:.1f} us, cached): the autograd.Function machinery and engine "
        f"round trip {shaped:.1f} us, the rest {fwd_bwd - shaped:.1f} us"
    )
    torch.autograd.set_multithreading_enabled(False)  # backward on the calling thread: no hand-off
    try:
        _both_paths("cross_entropy fwd+bwd, engine threads off", step)
        for name in ("do-nothing autograd.Function fwd+bwd", "fastce-shaped autograd.Function fwd+bwd"):
            print(f"{name + ', threads off':46s} {per_call_us(baselines[name]):7.1f} us")
    finally:
        torch.autograd.set_multithreading_enabled(True)


def device_times(shapes=((512, 256000), (8192, 32000))):
    print("part 2: forward+backward of real shapes, bf16, ms (do_bench medians)")
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


def bitwise_check():
    from fastce_torch.tests.test_launch_cache import GPU_CASES, _step, bits

    device = torch.device("cuda")
    hits = kernels._forward_launcher.hits, kernels._backward_launcher.hits
    for strided in (False, True):
        for case in GPU_CASES:
            with kernels.launch_cache(False):
                expected = _step(case, 0, device, strided)
            _step(case, 1, device, strided)  # records the variants (first call of a new one may be generic)
            got = _step(case, 0, device, strided)
            same = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected))
            if not same:
                raise SystemExit(f"cached and generic launches differ: {case}, strided={strided}")
    hits = kernels._forward_launcher.hits - hits[0], kernels._backward_launcher.hits - hits[1]
    print(f"part 3: cached == generic bitwise on {2 * len(GPU_CASES)} cases ({hits[0]} + {hits[1]} cached launches)")


def main():
    print(
        f"launch cache: {'on' if kernels.launch_cache_enabled() else 'off'} "
        f"{kernels._launch_cache_setting.refusal}; torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name()}"
    )
    if not kernels.launch_cache_enabled():
        raise SystemExit("the launch cache is off in this process: nothing to compare")
    host_costs()
    device_times()
    bitwise_check()
    failures = {
        name: launcher.failure
        for name, launcher in (("forward", kernels._forward_launcher), ("backward", kernels._backward_launcher))
        if launcher.failure
    }
    print(f"launch cache failures: {failures or 'none'}")


if __name__ == "__main__":
    main()
