"""CPU-only machines: the fastce kernels run *interpreted*, beside each package's reference and the plain framework
loss, checked against shared_tests' float64 reference and tolerances; the times are interpreter times."""

import importlib
import os
import statistics
import time
import warnings

import numpy as np

from shared_tests import reference, tolerances

from . import envinfo, fastce_loss, jax_setup
from .progress import aligned, load, note_failure, say

BANNER = ("CPU-only machine: no GPU benchmark was run. This is the interpreted correctness-and-timing demo "
          "(Triton interpreter / Pallas interpret mode); its times are not GPU performance.")  # fmt: skip
# (impl, backend) pairs; backend None = the plain framework loss.
TORCH_CASES = (("fastce_torch", "kernel"), ("fastce_torch", "reference"), ("torch_eager_fp32", None))
JAX_CASES = (("fastce_jax", "kernel"), ("fastce_jax", "reference"), ("xla", None))
HEADINGS = ("impl", "backend", "N", "V", "dtype", "fwd_ms", "fwdbwd_ms", "loss tol used", "grad tol used", "check")


def demo_cells(r) -> tuple:
    times = (f"{r['fwd_ms']:.1f}", f"{r['fwdbwd_ms']:.1f}", f"{r['loss_tol_used']:.2f}", f"{r['grad_tol_used']:.2f}")
    return (r["impl"], r["backend"], r["N"], r["V"], r["dtype"], *times, "ok" if r["ok"] else "MISMATCH")


def _tolerance_used(actual, expected, bound, what):
    """Largest |actual - expected| / tolerance (1 = at the limit), and the mismatch message when over it."""
    try:
        return tolerances.check(actual, expected, bound, what)[1], None
    except AssertionError as exc:
        return float("inf"), str(exc)


def _median_ms(fn, prepare, runs):
    fn(*prepare())  # untimed: first-call dispatch and tracing costs are not the steady state
    times = []
    for _ in range(runs):
        args = prepare()
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _torch_case(loss_fn, backend, shape, runs):
    """(loss, gradient as float64, the float64 reference, (fwd ms, fwd+bwd ms), the gradient tolerance's ulps)."""
    import torch

    from fastce_torch.core.launch import INTERPRETED

    from . import torch_impls

    def fresh():  # the same seeded values every time: the in-place backward overwrites them
        return torch_impls.make_inputs(shape, "cpu")

    logits, labels = fresh()
    ref = reference.expected(logits.detach().double().numpy(), labels.numpy(), "mean")
    loss = loss_fn(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    # detach: with the in-place backward the gradient *is* the logits tensor
    grad = grad.detach().double().numpy()
    fwd_ms = _median_ms(loss_fn, fresh, runs)
    fwdbwd_ms = _median_ms(lambda x, y: torch.autograd.grad(loss_fn(x, y), x), fresh, runs)
    # Triton's interpreter truncates to bfloat16 (tolerances.reference_ulps)
    ulps = tolerances.reference_ulps(shape.dtype, INTERPRETED and backend == "kernel")
    return float(loss.detach()), grad, ref, (fwd_ms, fwdbwd_ms), ulps


def _jax_case(loss_fn, backend, shape, runs):
    """_torch_case's tuple for a JAX loss, jit-compiled."""
    import jax

    from . import jax_impls

    logits, labels = jax_impls.make_inputs(shape)
    ref = reference.expected(np.asarray(logits.astype("float32"), np.float64), labels, "mean")
    fwd, fwdbwd = jax.jit(loss_fn), jax.jit(jax.value_and_grad(loss_fn))
    loss, grad = fwdbwd(logits, labels)
    times = tuple(_median_ms(lambda: jax.block_until_ready(f(logits, labels)), tuple, runs) for f in (fwd, fwdbwd))
    return float(loss), np.asarray(grad.astype("float32"), np.float64), ref, times, tolerances.ULPS


def _row(impl, backend, shape, loss, grad, ref, times, ulps):
    loss_used, loss_error = _tolerance_used(loss, ref.loss, tolerances.loss_bound(ref), "loss")
    grad_bound = tolerances.grad_bound(ref, grad, shape.dtype, ulps=ulps)
    grad_used, grad_error = _tolerance_used(grad, ref.grad, grad_bound, "grad")
    ok = loss_error is None and grad_error is None
    fwd_ms, fwdbwd_ms = times
    say(f"{impl:16s} {backend or '':9s} {shape}: tolerance used: loss {loss_used:.2f}, grad {grad_used:.2f} "
        f"{'ok' if ok else 'MISMATCH ' + (loss_error or grad_error)}; fwd {fwd_ms:.1f} ms, fwd+bwd {fwdbwd_ms:.1f} ms "
        "(interpreted/CPU)")  # fmt: skip
    row = {"impl": impl, "N": shape.N, "V": shape.V, "dtype": shape.dtype, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms}
    tolerance = {"loss_tol_used": loss_used, "grad_tol_used": grad_used, "ok": ok}
    return {**row, "peak_extra_bytes": 0, "backend": backend or "framework", **tolerance}


def _run_cases(cases, loader, run_case, shapes, impls, runs, rows, failures):
    for impl, backend in cases:
        if impl not in impls:
            continue
        name = f"{impl}[{backend}]"
        loss_fn = load(name, lambda: loader(impl, backend), failures)
        if loss_fn is None:
            continue
        for shape in shapes:
            try:
                rows.append(_row(impl, backend, shape, *run_case(loss_fn, backend, shape, runs)))
            except Exception as exc:  # noqa: BLE001
                note_failure(failures, f"{name} {shape}", name, shape, "measure", exc)


def run_cpu_demo(shapes, impls, runs=3) -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (kernels decorate at import)
    # The interpreter evaluates masked-off lanes too (e.g. log(0) of an empty partial); numpy warns, results are fine.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    jax_setup.configure(interpret_only=True)
    say(BANNER)
    rows, failures = [], []
    # (fastce_torch itself turns the interpreter on when torch sees no CUDA)
    for cases, run_case, framework in ((TORCH_CASES, _torch_case, "torch"), (JAX_CASES, _jax_case, "jax")):
        if any(impl in impls for impl, _ in cases):
            loaders = importlib.import_module(f"bench.{framework}_impls").LOADERS

            def loader(impl, backend, framework=framework, loaders=loaders):
                return fastce_loss(f"fastce_{framework}", backend) if backend else loaders[impl]()

            _run_cases(cases, loader, run_case, shapes, impls, runs, rows, failures)
    result = {"device": "cpu (interpreted demo)", "date": envinfo.today(), "commit": envinfo.git_commit(),
              "versions": envinfo.versions(), "copy_bandwidth_TBps": 0.0, "rows": rows, "mode": "cpu-demo"}  # fmt: skip
    return result | ({"failures": failures} if failures else {})


def demo_table(rows) -> str:
    return aligned([HEADINGS, *map(demo_cells, rows)])
