"""CPU-only machines: a small correctness-and-timing demo of the fastce kernels run *interpreted*
(fastce_torch under TRITON_INTERPRET=1, fastce_jax's Pallas kernels with interpret=True), next to each
package's pure-framework reference and the plain framework loss, all checked against the repository's float64
reference with its tolerance model (shared_tests/reference.py, shared_tests/tolerances.py: run from the repository
root). The times are interpreter times: they say nothing about GPU performance.
"""

import os
import statistics
import time
import warnings

import numpy as np

from shared_tests import reference, tolerances

from . import envinfo, jax_setup
from .progress import failure, say

BANNER = (
    "CPU-only machine: no GPU benchmark was run. This is the interpreted correctness-and-timing demo "
    "(Triton interpreter / Pallas interpret mode); its times are not GPU performance."
)
# (impl, backend) pairs; backend None = the plain framework loss.
TORCH_CASES = (("fastce_torch", "kernel"), ("fastce_torch", "reference"), ("torch_eager_fp32", None))
JAX_CASES = (("fastce_jax", "kernel"), ("fastce_jax", "reference"), ("xla", None))


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


def _check(impl, backend, shape, loss, grad, ref, fwd_ms, fwdbwd_ms, ulps=tolerances.ULPS):
    loss_used, loss_error = _tolerance_used(loss, ref.loss, tolerances.loss_bound(ref), "loss")
    grad_bound = tolerances.grad_bound(ref, grad, shape.dtype, ulps=ulps)
    grad_used, grad_error = _tolerance_used(grad, ref.grad, grad_bound, "grad")
    ok = loss_error is None and grad_error is None
    say(
        f"{impl:16s} {backend or '':9s} {shape}: tolerance used: loss {loss_used:.2f}, grad {grad_used:.2f} "
        f"{'ok' if ok else 'MISMATCH ' + (loss_error or grad_error)}; fwd {fwd_ms:.1f} ms, fwd+bwd {fwdbwd_ms:.1f} ms "
        "(interpreted/CPU)"
    )
    row = {
        "impl": impl,
        "N": shape.N,
        "V": shape.V,
        "dtype": shape.dtype,
        "fwd_ms": fwd_ms,
        "fwdbwd_ms": fwdbwd_ms,
        "peak_extra_bytes": 0,
        "backend": backend or "framework",
        "loss_tol_used": loss_used,
        "grad_tol_used": grad_used,
        "ok": ok,
    }
    return row


def _load(impl, backend, loaders, fastce_loader, failures):
    """The implementation's loss function, or None (the failure recorded) when it does not load."""
    try:
        return fastce_loader(backend) if impl.startswith("fastce") else loaders[impl]()
    except Exception as exc:  # noqa: BLE001
        failures.append(failure(f"{impl}[{backend}]", None, "load", exc))
        say(f"{impl}[{backend}]: skipped ({failures[-1]['error']})")
        return None


def _torch_cases(shapes, impls, runs, rows, failures):
    import torch  # fastce_torch itself turns the interpreter on when torch sees no CUDA

    from fastce_torch import kernels

    from . import torch_impls

    for impl, backend in TORCH_CASES:
        if impl not in impls:
            continue
        loss_fn = _load(impl, backend, torch_impls.LOADERS, torch_impls.fastce_torch_loss, failures)
        if loss_fn is None:
            continue
        for shape in shapes:

            def fresh():  # the same seeded values every time: the in-place backward overwrites them
                return torch_impls.make_inputs(shape, "cpu")

            try:
                logits, labels = fresh()
                ref = reference.expected(logits.detach().double().numpy(), labels.numpy(), "mean")
                loss = loss_fn(logits, labels)
                (grad,) = torch.autograd.grad(loss, logits)
                fwd_ms = _median_ms(loss_fn, fresh, runs)
                fwdbwd_ms = _median_ms(lambda x, y: torch.autograd.grad(loss_fn(x, y), x), fresh, runs)
                # detach: with the in-place backward the gradient *is* the logits tensor
                rows.append(
                    _check(
                        impl,
                        backend,
                        shape,
                        float(loss.detach()),
                        grad.detach().double().numpy(),
                        ref,
                        fwd_ms,
                        fwdbwd_ms,
                        # Triton's interpreter truncates to bfloat16 (tolerances.reference_ulps)
                        tolerances.reference_ulps(shape.dtype, kernels.INTERPRETED and backend == "kernel"),
                    )
                )
            except Exception as exc:  # noqa: BLE001
                failures.append(failure(f"{impl}[{backend}]", shape, "measure", exc))
                say(f"{impl}[{backend}] {shape}: FAILED {failures[-1]['error']}")


def _jax_cases(shapes, impls, runs, rows, failures):
    import jax

    from . import jax_impls

    for impl, backend in JAX_CASES:
        if impl not in impls:
            continue
        loss_fn = _load(impl, backend, jax_impls.LOADERS, jax_impls.fastce_jax_loss, failures)
        if loss_fn is None:
            continue
        for shape in shapes:
            try:
                logits, labels = jax_impls.make_inputs(shape)
                ref = reference.expected(np.asarray(logits.astype("float32"), np.float64), labels, "mean")
                fwd = jax.jit(loss_fn)
                fwdbwd = jax.jit(jax.value_and_grad(loss_fn))
                loss, grad = fwdbwd(logits, labels)
                jax.block_until_ready(fwd(logits, labels))

                def timed(fn):
                    return _median_ms(lambda: jax.block_until_ready(fn(logits, labels)), tuple, runs)

                rows.append(
                    _check(
                        impl,
                        backend,
                        shape,
                        float(loss),
                        np.asarray(grad.astype("float32"), np.float64),
                        ref,
                        timed(fwd),
                        timed(fwdbwd),
                    )
                )
            except Exception as exc:  # noqa: BLE001
                failures.append(failure(f"{impl}[{backend}]", shape, "measure", exc))
                say(f"{impl}[{backend}] {shape}: FAILED {failures[-1]['error']}")


def run_cpu_demo(shapes, impls, runs=3) -> dict:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (kernels decorate at import)
    # The interpreter evaluates masked-off lanes too (e.g. log(0) of an empty partial); numpy warns, results are fine.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    jax_setup.configure(interpret_only=True)
    say(BANNER)
    rows, failures = [], []
    _torch_cases(shapes, impls, runs, rows, failures)
    _jax_cases(shapes, impls, runs, rows, failures)
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
    header = ("impl", "backend", "N", "V", "dtype", "fwd_ms", "fwdbwd_ms", "loss tol used", "grad tol used", "check")
    cells = [header] + [
        (
            r["impl"],
            r["backend"],
            str(r["N"]),
            str(r["V"]),
            r["dtype"],
            f"{r['fwd_ms']:.1f}",
            f"{r['fwdbwd_ms']:.1f}",
            f"{r['loss_tol_used']:.2f}",
            f"{r['grad_tol_used']:.2f}",
            "ok" if r["ok"] else "MISMATCH",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)
