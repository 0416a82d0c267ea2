"""CPU-only machines: a small correctness-and-timing demo of the fastce kernels run *interpreted*
(fastce_torch under TRITON_INTERPRET=1, fastce_jax's Pallas kernels with interpret=True), next to each
package's pure-framework reference and the plain framework loss, all checked against a float64 NumPy truth.
The times are interpreter times: they say nothing about GPU performance.
"""

import os
import statistics
import time
import warnings

import numpy as np

from . import envinfo, jax_setup
from .progress import failure, say

BANNER = (
    "CPU-only machine: no GPU benchmark was run. This is the interpreted correctness-and-timing demo "
    "(Triton interpreter / Pallas interpret mode); its times are not GPU performance."
)
# (impl, backend) pairs; backend None = the plain framework loss.
TORCH_CASES = (("fastce_torch", "kernel"), ("fastce_torch", "reference"), ("torch_eager_fp32", None))
JAX_CASES = (("fastce_jax", "kernel"), ("fastce_jax", "reference"), ("xla", None))
# Relative error allowed against float64: the gradient is stored in the logits' dtype.
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-3}
LOSS_RTOL = 1e-4


def _truth(logits, labels):
    """float64 mean cross-entropy over kept tokens and its gradient, from the same (rounded) logits."""
    x = np.asarray(logits, dtype=np.float64)
    keep = labels != -100
    shifted = x - x.max(axis=1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1)) + x.max(axis=1)
    n = max(int(keep.sum()), 1)
    picked = x[np.arange(len(labels)), np.where(keep, labels, 0)]
    loss = float(np.where(keep, lse - picked, 0.0).sum() / n)
    grad = p.copy()
    grad[np.arange(len(labels)), np.where(keep, labels, 0)] -= 1.0
    grad[~keep] = 0.0
    return loss, grad / n


def _median_ms(fn, prepare, runs):
    fn(*prepare())  # untimed: first-call dispatch and tracing costs are not the steady state
    times = []
    for _ in range(runs):
        args = prepare()
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _check(impl, backend, shape, loss, grad, truth_loss, truth_grad, fwd_ms, fwdbwd_ms):
    loss_err = abs(loss - truth_loss) / max(1.0, abs(truth_loss))
    grad_err = float(np.max(np.abs(grad - truth_grad)) / np.max(np.abs(truth_grad)))
    ok = loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL[shape.dtype]
    say(
        f"{impl:16s} {backend or '':9s} {shape}: loss rel err {loss_err:.1e}, grad rel err {grad_err:.1e} "
        f"{'ok' if ok else 'MISMATCH'}; fwd {fwd_ms:.1f} ms, fwd+bwd {fwdbwd_ms:.1f} ms (interpreted/CPU)"
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
        "loss_rel_err": loss_err,
        "grad_rel_err": grad_err,
        "ok": ok,
    }
    return row


def _torch_cases(shapes, impls, runs, rows, failures):
    import torch  # fastce_torch itself turns the interpreter on when torch sees no CUDA

    from . import torch_impls

    for impl, backend in TORCH_CASES:
        if impl not in impls:
            continue
        try:
            loss_fn = torch_impls.fastce_torch_loss(backend) if impl == "fastce_torch" else torch_impls.LOADERS[impl]()
        except Exception as exc:  # noqa: BLE001
            failures.append(failure(f"{impl}[{backend}]", None, "load", exc))
            say(f"{impl}[{backend}]: skipped ({failures[-1]['error']})")
            continue
        for shape in shapes:

            def fresh():  # the same seeded values every time: the in-place backward overwrites them
                return torch_impls.make_inputs(shape, "cpu")

            try:
                logits, labels = fresh()
                truth_loss, truth_grad = _truth(logits.detach().float().numpy(), labels.numpy())
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
                        grad.detach().float().numpy(),
                        truth_loss,
                        truth_grad,
                        fwd_ms,
                        fwdbwd_ms,
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
        try:
            loss_fn = jax_impls.fastce_jax_loss(backend) if impl == "fastce_jax" else jax_impls.LOADERS[impl]()
        except Exception as exc:  # noqa: BLE001
            failures.append(failure(f"{impl}[{backend}]", None, "load", exc))
            say(f"{impl}[{backend}]: skipped ({failures[-1]['error']})")
            continue
        for shape in shapes:
            try:
                logits, labels = jax_impls.make_inputs(shape)
                truth_loss, truth_grad = _truth(np.asarray(logits.astype("float32")), np.asarray(labels))
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
                        np.asarray(grad.astype("float32")),
                        truth_loss,
                        truth_grad,
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
    header = ("impl", "backend", "N", "V", "dtype", "fwd_ms", "fwdbwd_ms", "loss rel err", "grad rel err", "check")
    cells = [header] + [
        (
            r["impl"],
            r["backend"],
            str(r["N"]),
            str(r["V"]),
            r["dtype"],
            f"{r['fwd_ms']:.1f}",
            f"{r['fwdbwd_ms']:.1f}",
            f"{r['loss_rel_err']:.1e}",
            f"{r['grad_rel_err']:.1e}",
            "ok" if r["ok"] else "MISMATCH",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)
