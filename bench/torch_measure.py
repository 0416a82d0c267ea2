"""Timing and memory of one PyTorch implementation on one shape (do_bench medians; bench/METHOD.md), and the
device copy bandwidth."""

import contextlib
import time

import torch
import triton.testing

from .progress import error_text
from .torch_impls import make_inputs, make_leaf_inputs

GRAPH_WARMUP_CALLS = 3


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


def prime_capture() -> None:
    """Capture and replay a one-kernel graph, so that the process's first capture is not an implementation's."""
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    graph.reset()


def graph_ms(fn, warmup_ms, rep_ms, stream=None, time_replays=None) -> float:
    """do_bench median (or time_replays(replay) -> ms) of replaying fn captured in a CUDA graph, after warm-up calls
    on the same side stream; the graph and its memory pool are released before returning."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            static_out = fn()
        ms = time_replays(graph.replay) if time_replays else bench_ms(graph.replay, warmup_ms, rep_ms)
        del static_out
    finally:
        torch.cuda.synchronize()
        graph.reset()
        del graph
        torch.cuda.empty_cache()
    return ms


def graph_entry(fn, warmup_ms, rep_ms, stream=None, time_replays=None) -> dict:
    """{"fwdbwd_graph_ms": ms} or, where fn cannot be captured, {"fwdbwd_graph_ms": None, "fwdbwd_graph_error": why}."""
    try:
        return {"fwdbwd_graph_ms": graph_ms(fn, warmup_ms, rep_ms, stream, time_replays)}
    except Exception as exc:  # noqa: BLE001 - an uncapturable implementation is a result, not a failure
        return {"fwdbwd_graph_ms": None, "fwdbwd_graph_error": error_text(exc)}


def _closures(loss_fn, logits, labels):
    def fwd():
        return loss_fn(logits, labels)

    def fwdbwd():
        return torch.autograd.grad(loss_fn(logits, labels), logits)

    return fwd, fwdbwd


def measure(loss_fn, shape, warmup_ms=100, rep_ms=500, device="cuda") -> dict:
    """Eager fwd and fwd+bwd times (non-leaf, then leaf logits), peak memory and loss (the tests use device "cpu")."""
    logits, labels = make_inputs(shape, device)
    fwd, fwdbwd = _closures(loss_fn, logits, labels)
    try:
        # On the pristine values (the same seed for every implementation, so the losses must agree).
        loss = float(fwd().detach())
        # Untimed calls: torch.compile compiles, Triton kernels JIT and autotune here.
        for _ in range(2):
            fwdbwd()
        peak = peak_extra_bytes(fwdbwd)
        row = {"fwd_ms": bench_ms(fwd, warmup_ms, rep_ms), "fwdbwd_ms": bench_ms(fwdbwd, warmup_ms, rep_ms),
               "peak_extra_bytes": peak, "loss": loss}  # fmt: skip
    finally:
        del logits, labels, fwd, fwdbwd
        torch.cuda.empty_cache()
    row.update(measure_leaf(loss_fn, shape, warmup_ms, rep_ms, device))
    return row


def measure_leaf(loss_fn, shape, warmup_ms=100, rep_ms=500, device="cuda") -> dict:
    """fwdbwd_leaf_ms and peak_extra_leaf_bytes (the fresh .grad included), or fwdbwd_leaf_ms None and the error."""
    try:
        logits, labels = make_leaf_inputs(shape, device)

        def fwdbwd_leaf():
            logits.grad = None  # optimizer.zero_grad(set_to_none=True): no accumulation into an old gradient
            loss_fn(logits, labels).backward()
            return logits.grad

        try:
            for _ in range(2):
                fwdbwd_leaf()
            logits.grad = None
            peak = peak_extra_bytes(fwdbwd_leaf)
            return {"fwdbwd_leaf_ms": bench_ms(fwdbwd_leaf, warmup_ms, rep_ms), "peak_extra_leaf_bytes": peak}
        finally:
            logits.grad = None
            del logits, labels, fwdbwd_leaf
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - e.g. an OOM of the extra gradient: the row keeps its other columns
        return {"fwdbwd_leaf_ms": None, "fwdbwd_leaf_error": error_text(exc)}


def measure_graph(loss_fn, shape, warmup_ms=100, rep_ms=500, device="cuda", inputs=None, time_replays=None) -> dict:
    """graph_entry of fwd+bwd on fresh inputs (inputs() or make_inputs): inputs, eager calls, warm-up and capture
    all on one side stream, so the backward's stream sync stays inside the capture."""
    side = torch.cuda.Stream() if device == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    on_side = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    with on_side:
        logits, labels = inputs() if inputs else make_inputs(shape, device)
        _, fwdbwd = _closures(loss_fn, logits, labels)
        for _ in range(2):
            fwdbwd()
    try:
        return graph_entry(fwdbwd, warmup_ms, rep_ms, side, time_replays)
    finally:
        del logits, labels, fwdbwd
        torch.cuda.empty_cache()


def timed(fn, cuda=True):
    """(fn(), its time in ms): CUDA events on the GPU (all the device work fn queues), perf_counter elsewhere."""
    if not cuda:
        start = time.perf_counter()
        return fn(), (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def copy_bandwidth_TBps(nbytes=2 << 30, time_ms=None) -> float:
    """Device-to-device copy of `nbytes` (timed by do_bench or time_ms(copy)); bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = (time_ms or (lambda copy: bench_ms(copy, 100, 500)))(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12
