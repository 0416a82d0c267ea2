"""CPU-only machines: the fastce kernels run *interpreted*, beside each package's reference and the plain framework
loss, checked against shared_tests' float64 reference and tolerances; the times are interpreter times."""

import os
import statistics
import time
import warnings

import numpy as np

from shared_tests import reference, tolerances

from . import envinfo, jax_setup
from .progress import failure, load, say

BANNER = (
    "CPU-only machine: no GPU benchmark was run. This is the interpreted correctness-and-timing demo "
    "(Triton interpreter / Pallas interpret mode); its times are not GPU performance."
)
# (impl, backend) pairs; backend None = the plain framework loss.
TORCH_CASES = (("fastce_torch", "kernel"), ("fastce_torch", "reference"), ("torch_eager_fp32", None))
JAX_CASES = (("fastce_jax", "kernel"), ("fastce_jax", "reference"), ("xla", None))
# The demo table: (heading, the row's cell).
COLUMNS = {
    "impl": lambda r: r["impl"],
    "backend": lambda r: r["backend"],
    "N": lambda r: str(r["N"]),
    "V": lambda r: str(r["V"]),
    "dtype": lambda r: r["dtype"],
    "fwd_ms": lambda r: f"{r['fwd_ms']:.1f}",
    "fwdbwd_ms": lambda r: f"{r['fwdbwd_ms']:.1f}",
    "loss tol used": lambda r: f"{r['loss_tol_used']:.2f}",
    "grad tol used": lambda r: f"{r['grad_tol_used']:.2f}",
    "check": lambda r: "ok" if r["ok"] else "MISMATCH",
}


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

    from fastce_torch import kernels

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
    ulps = tolerances.reference_ulps(shape.dtype, kernels.INTERPRETED and backend == "kernel")
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
    say(
        f"{impl:16s} {backend or '':9s} {shape}: tolerance used: loss {loss_used:.2f}, grad {grad_used:.2f} "
        f"{'ok' if ok else 'MISMATCH ' + (loss_error or grad_error)}; fwd {fwd_ms:.1f} ms, fwd+bwd {fwdbwd_ms:.1f} ms "
        "(interpreted/CPU)"
    )
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
                failures.append(failure(name, shape, "measure", exc))
                say(f"{name} {shape}: FAILED {failures[-1]['error']}")


def run_cpu_demo(shapes, impls, runs=3) -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (kernels decorate at import)
    # The interpreter evaluates masked-off lanes too (e.g. log(0) of an empty partial); numpy warns, results are fine.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    jax_setup.configure(interpret_only=True)
    say(BANNER)
    rows, failures = [], []
    if any(impl in impls for impl, _ in TORCH_CASES):
        from . import torch_impls  # fastce_torch itself turns the interpreter on when torch sees no CUDA

        def loader(impl, backend):
            return torch_impls.fastce_torch_loss(backend) if backend else torch_impls.LOADERS[impl]()

        _run_cases(TORCH_CASES, loader, _torch_case, shapes, impls, runs, rows, failures)
    if any(impl in impls for impl, _ in JAX_CASES):
        from . import jax_impls

        def loader(impl, backend):
            return jax_impls.fastce_jax_loss(backend) if backend else jax_impls.LOADERS[impl]()

        _run_cases(JAX_CASES, loader, _jax_case, shapes, impls, runs, rows, failures)
    result = {
        "device": "cpu (interpreted demo)",
        "date": envinfo.today(),
        "commit": envinfo.git_commit(),
        "versions": envinfo.versions(),
        "copy_bandwidth_TBps": 0.0,
        "rows": rows,
        "mode": "cpu-demo",
    }
    if failures:
        result["failures"] = failures
    return result


def demo_table(rows) -> str:
    cells = [list(COLUMNS)] + [[cell(r) for cell in COLUMNS.values()] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)
