"""Timing and memory of one PyTorch implementation on one shape (the twin of bench/jax_measure.py), and the
device copy bandwidth.

Timed closures (nothing else runs inside them; inputs are made once, outside):
  fwd    = loss_fn(logits, labels)                                   (grad mode on: the training forward,
                                                                      including whatever it saves for backward)
  fwdbwd = torch.autograd.grad(loss_fn(logits, labels), logits)      (gradient w.r.t. the non-leaf logits)
Implementations that write the gradient into the logits buffer (fastce_torch, Liger) leave gradient values
there; those are finite, so the next iteration's work is unchanged and the buffer is not refilled.
  fwdbwd_graph = the same fwdbwd captured once in a torch.cuda.CUDAGraph (after warm-up on a side stream, as
                 torch's CUDA-graph docs prescribe) and replayed: the device time alone, no Python, no autograd
                 engine, no launch overhead. Beside fwdbwd it separates kernel time from call time. None, with the
                 reason in fwdbwd_graph_error, where the implementation cannot be captured (a host synchronisation
                 such as .item(), or a compiler's own graph handling).
Times are triton.testing.do_bench medians (CUDA events; do_bench zeroes a 256 MB buffer between iterations
to flush the L2, outside the timed region). The logits are >= 256 MiB, far above the 60 MB L2.
"""

import torch
import triton.testing

from .progress import error_text
from .torch_impls import make_inputs


def bench_ms(fn, warmup_ms, rep_ms) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def peak_extra_bytes(fn) -> int:
    """torch.cuda.max_memory_allocated during one call, above what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return int(peak)


def graph_ms(fn, warmup_ms, rep_ms) -> float:
    """do_bench median of replaying fn captured in a CUDA graph. fn runs three times on a side stream first (Triton
    compiles and loads its kernels, the caching allocator settles); the graph and its private memory pool are
    released before returning."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_out = fn()
        ms = bench_ms(graph.replay, warmup_ms, rep_ms)
        del static_out
    finally:
        torch.cuda.synchronize()
        graph.reset()
        del graph
        torch.cuda.empty_cache()
    return ms


def graph_entry(fn, warmup_ms, rep_ms) -> dict:
    """{"fwdbwd_graph_ms": ms} or, where fn cannot be captured, {"fwdbwd_graph_ms": None, "fwdbwd_graph_error": why}."""
    try:
        return {"fwdbwd_graph_ms": graph_ms(fn, warmup_ms, rep_ms)}
    except Exception as exc:  # noqa: BLE001 - an uncapturable implementation is a result, not a failure
        return {"fwdbwd_graph_ms": None, "fwdbwd_graph_error": error_text(exc)}


def _closures(loss_fn, logits, labels):
    def fwd():
        return loss_fn(logits, labels)

    def fwdbwd():
        return torch.autograd.grad(loss_fn(logits, labels), logits)

    return fwd, fwdbwd


def measure(loss_fn, shape, warmup_ms=100, rep_ms=500, device="cuda") -> dict:
    """Eager fwd and fwd+bwd times, peak memory and loss. device is "cuda" in real runs; the tests run it on the CPU
    with bench_ms and peak_extra_bytes stubbed."""
    logits, labels = make_inputs(shape, device)
    fwd, fwdbwd = _closures(loss_fn, logits, labels)
    try:
        # On the pristine values (the same seed for every implementation, so the losses must agree).
        loss = float(fwd().detach())
        # Untimed calls: torch.compile compiles, Triton kernels JIT and autotune here.
        for _ in range(2):
            fwdbwd()
        peak = peak_extra_bytes(fwdbwd)
        row = {
            "fwd_ms": bench_ms(fwd, warmup_ms, rep_ms),
            "fwdbwd_ms": bench_ms(fwdbwd, warmup_ms, rep_ms),
            "peak_extra_bytes": peak,
            "loss": loss,
        }
    finally:
        del logits, labels
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def measure_graph(loss_fn, shape, warmup_ms=100, rep_ms=500, device="cuda") -> dict:
    """graph_entry of fwd+bwd on fresh inputs (eager calls first, as in measure: compilation and autotuning happen
    outside the capture). The runner calls it after every eager and JAX row: a failed capture can leave the caching
    allocator holding memory for the rest of the process (seen on the H200: one failed capture, then 128 GiB held
    and later rows out of memory), which must not reach the other measurements."""
    logits, labels = make_inputs(shape, device)
    _, fwdbwd = _closures(loss_fn, logits, labels)
    try:
        for _ in range(2):
            fwdbwd()
        return graph_entry(fwdbwd, warmup_ms, rep_ms)
    finally:
        del logits, labels
        if device == "cuda":
            torch.cuda.empty_cache()


def copy_bandwidth_TBps(nbytes=2 << 30) -> float:
    """Device-to-device copy of `nbytes`; bandwidth counts bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), 100, 500)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12
