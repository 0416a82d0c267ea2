"""Host-side cost per call of fastce_torch (what a GPU cannot hide when the kernels are short):
`PYTHONPATH=. python -m bench.overhead`. Times the Python + launch path with tiny inputs, so the GPU is idle."""

import importlib
import time

import torch

import fastce_torch

ce = importlib.import_module("fastce_torch.cross_entropy")


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main():
    logits = torch.randn(64, 1000, device="cuda", requires_grad=True) * 1
    labels = torch.randint(0, 1000, (64,), device="cuda")
    _, lse, _ = ce.forward_kernels(logits.detach(), labels, -100, 0.0, 0.0, 0.0, 0.0)
    grad_loss = torch.ones((), device="cuda").expand(64)
    rows = {
        "forward_kernels (1 launch)": lambda: ce.forward_kernels(logits.detach(), labels, -100, 0.0, 0.0, 0.0, 0.0),
        "backward_kernels (1 launch)": lambda: ce.backward_kernels(grad_loss, logits.detach(), labels, lse,
                                                                   torch.empty_like(logits), -100, 0.0, 0.0, 0.0, 0.0),
        "cross_entropy forward": lambda: fastce_torch.cross_entropy(logits, labels),
        "cross_entropy forward+backward": lambda: torch.autograd.grad(fastce_torch.cross_entropy(logits, labels),
                                                                      logits),
        "torch F.cross_entropy forward+backward": lambda: torch.autograd.grad(
            torch.nn.functional.cross_entropy(logits, labels), logits),
    }
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn):8.1f} us per call")


if __name__ == "__main__":
    main()
