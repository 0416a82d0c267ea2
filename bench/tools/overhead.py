"""Host-side cost per call of fastce_torch (what a GPU cannot hide when the kernels are short):
`PYTHONPATH=. python -m bench.tools.overhead`.

Part 1 times the Python + launch path with tiny inputs (the GPU idle), beside two baselines that no loss can beat:
an autograd.Function that does nothing (the autograd engine's own round trip: on a CUDA graph task the backward
runs on the engine's device thread, so the caller waits for a thread hand-off) and F.cross_entropy.
Part 2 times forward+backward of real shapes two ways: eager (do_bench, as `python -m bench`), and the two kernels
launched back to back without autograd (GPU-bound: what the kernels cost once the host keeps up).
"""

import time

import torch
import triton.testing

import fastce_torch
from fastce_torch import kernels

OPTIONS = kernels.Options()


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


class _DoNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, grad):
        return None


def host_costs():
    logits = torch.randn(64, 1000, device="cuda", requires_grad=True) * 1
    labels = torch.randint(0, 1000, (64,), device="cuda")
    _, lse, _ = kernels.forward(logits.detach(), labels, OPTIONS)
    grad_loss = torch.ones((), device="cuda").expand(64)
    leaf = logits.detach().requires_grad_()
    rows = {
        "kernels.forward (1 launch)": lambda: kernels.forward(logits.detach(), labels, OPTIONS),
        "kernels.backward (1 launch)": lambda: kernels.backward(
            grad_loss, logits.detach(), labels, lse, torch.empty_like(logits), OPTIONS
        ),
        "cross_entropy forward": lambda: fastce_torch.cross_entropy(logits, labels),
        "cross_entropy forward+backward": lambda: torch.autograd.grad(
            fastce_torch.cross_entropy(logits, labels), logits
        ),
        "F.cross_entropy forward+backward": lambda: torch.autograd.grad(
            torch.nn.functional.cross_entropy(logits, labels), logits
        ),
        "do-nothing autograd.Function fwd+bwd": lambda: torch.autograd.grad(
            _DoNothing.apply(leaf), leaf, allow_unused=True
        ),
    }
    for name, fn in rows.items():
        print(f"{name:44s} {per_call_us(fn):8.1f} us per call")
    torch.autograd.set_multithreading_enabled(False)  # backward on the calling thread: no hand-off
    try:
        for name in (
            "cross_entropy forward+backward",
            "F.cross_entropy forward+backward",
            "do-nothing autograd.Function fwd+bwd",
        ):
            print(f"{name + ', engine threads off':44s} {per_call_us(rows[name]):8.1f} us per call")
    finally:
        torch.autograd.set_multithreading_enabled(True)


def device_times(shapes=((512, 256000), (8192, 32000))):
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
        raw = logits_nonleaf.detach()
        grad_loss = torch.ones((), device="cuda")

        def kernels_only():
            _, lse, denominator = kernels.forward(raw, labels, OPTIONS, reduction="mean")
            kernels.backward(grad_loss, raw, labels, lse, raw, OPTIONS, denominator=denominator)

        launched = triton.testing.do_bench(kernels_only, return_mode="median")
        print(
            f"N={n_rows} V={vocab} bf16 forward+backward: eager {eager:.3f} ms, kernels launched back to back "
            f"{launched:.3f} ms"
        )


def main():
    host_costs()
    device_times()


if __name__ == "__main__":
    main()
