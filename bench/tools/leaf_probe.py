"""Where a leaf `.backward()` call of fastce_torch's cross_entropy loses its time at a short-kernel shape:
`PYTHONPATH=. python -m bench.tools.leaf_probe [--shape 512x256000]` (a GPU; with TRITON_INTERPRET=1 on a CPU it
only runs the variants at a tiny shape and checks their gradients).

RESULTS.md at 21d618a: at N=512, V=256000 bf16 the non-leaf call (autograd.grad on lm_head-like logits, gradient
in place) takes 0.204 ms, the leaf call (`logits.grad = None; loss.backward()`, as Unsloth's users call a loss)
0.432 ms, torch.compile 0.388 either way; the CUDA graph of the work 0.204 ms. So the leaf call is host-bound
and something in its path costs ~0.2 ms of host time more than the non-leaf one, where the overhead tool's tiny
(64 x 1000) calls differ by only 26-170 us from run to run. The variants below separate the candidates:
  nonleaf           autograd.grad(loss, logits), logits an intermediate (the bench's fwd+bwd column)
  nonleaf, copy     the same with inplace_backward=False: a new gradient buffer, as a leaf gets
  leaf, grad        autograd.grad(loss, leaf): a leaf, no AccumulateGrad node
  leaf, backward    leaf.grad = None; loss.backward() (the bench's leaf column)
  leaf, accumulate  loss.backward() into an existing .grad (gradient accumulation: one more add pass)
and F.cross_entropy's nonleaf and leaf calls beside them. For each: the do_bench median (ms) and the host's own
time per call (wall time of n calls enqueued back to back, the GPU queue not waited on, so the larger of host time
and device time), then a torch.profiler table of one leaf call (CPU ops and the CUDA runtime calls).
"""

import argparse
import time

import torch
import triton.testing

import fastce_torch
from fastce_torch import kernels


def variants(logits_source, labels, inplace=True):
    """{name: step()} over fresh tensors made from logits_source (V columns, requires no grad)."""
    leaf = logits_source.clone().requires_grad_()
    base = logits_source.clone().requires_grad_()
    accumulating = logits_source.clone().requires_grad_()

    def nonleaf(inplace_backward=True):
        logits = base * 1  # an intermediate, as lm_head's output is
        loss = fastce_torch.cross_entropy(logits, labels, inplace_backward=inplace_backward)
        return torch.autograd.grad(loss, logits)[0]

    def leaf_backward():
        leaf.grad = None
        fastce_torch.cross_entropy(leaf, labels).backward()
        return leaf.grad

    def leaf_accumulate():
        fastce_torch.cross_entropy(accumulating, labels).backward()
        return accumulating.grad

    def torch_nonleaf():
        logits = base * 1
        return torch.autograd.grad(torch.nn.functional.cross_entropy(logits.float(), labels), logits)[0]

    def torch_leaf():
        leaf.grad = None
        torch.nn.functional.cross_entropy(leaf.float(), labels).backward()
        return leaf.grad

    return {
        "nonleaf": nonleaf,
        "nonleaf, copy": lambda: nonleaf(False),
        "leaf, grad": lambda: torch.autograd.grad(fastce_torch.cross_entropy(leaf, labels), leaf)[0],
        "leaf, backward": leaf_backward,
        "leaf, accumulate": leaf_accumulate,
        "F.cross_entropy nonleaf": torch_nonleaf,
        "F.cross_entropy leaf": torch_leaf,
    }


def host_us(step, n):
    """Wall time per call of n calls enqueued back to back (synchronised only before and after)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def check(shape=(16, 300), dtype=torch.float32, device="cpu"):
    """Every fastce variant's gradient equals the non-leaf call's (the accumulating one after its first call);
    returns the names checked."""
    generator = torch.Generator().manual_seed(0)
    source = (torch.randn(*shape, generator=generator) * 2).to(device, dtype)
    labels = torch.randint(0, shape[1], (shape[0],), generator=generator).to(device)
    steps = variants(source, labels)
    expected = steps["nonleaf"]().clone()
    for name, step in steps.items():
        if name.startswith("F."):
            continue
        got = step()
        assert torch.isfinite(got).all() and torch.equal(got, expected), name
    return [name for name in steps if not name.startswith("F.")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="512x256000")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: checked", ", ".join(check()), "at 16 x 300 (equal gradients)")
        return
    print("checked", ", ".join(check(device="cuda")), "at 16 x 300 on cuda (equal gradients)")
    n_rows, vocab = (int(x) for x in args.shape.split("x"))
    source = torch.randn(n_rows, vocab, device="cuda").to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n_rows,), device="cuda")
    print(f"{n_rows} x {vocab} bf16, launch cache {'on' if kernels.launch_cache_enabled() else 'off'}:")
    print(f"{'variant':26s} {'do_bench ms':>11s} {'host us/call':>13s}")
    for name, step in variants(source, labels).items():
        median = triton.testing.do_bench(step, warmup=100, rep=500, return_mode="median")
        print(f"{name:26s} {median:11.3f} {host_us(step, args.calls):13.1f}")
    step = variants(source, labels)["leaf, backward"]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as trace:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print("--- torch.profiler, 20 leaf .backward() calls, by self CPU time ---")
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
