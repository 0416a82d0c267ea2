"""`python -m bench --linear [--quick] [--ignored 0,0.5,0.9]`: fused linear + cross-entropy forward+backward
(hidden and weight gradients) against matmul + CE, torch.compile, Liger, Cut Cross-Entropy and torch's own; columns
and method in bench/METHOD.md and NOTES.md. `--quick`: one shape, fastce_torch only, plus a float32 check."""

import gc
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import fastce_torch

from . import linear_shapes, torch_measure  # (modules: the CPU tests stub the timers)
from .progress import Unavailable, failure, load, note_failure, optional, say
from .report import linear_table
from .shapes import IGNORE_INDEX

MiB = 1 << 20
DEVICE = "cuda"  # the CPU tests of this module set "cpu" (with the CUDA timers stubbed)
# The card's peak: a square bf16 matmul measured in the same run (each row's of_peak).
PEAK_MATMUL = (8192, 8192, 8192)


# --- implementations: each (hidden, weight, labels) -> mean loss ----------------------------------------------


def fastce_linear(settings):
    """fastce_torch.linear_cross_entropy called with `settings` (a FASTCE_SETTINGS entry) as keywords."""
    return lambda hidden, weight, labels: fastce_torch.linear_cross_entropy(hidden, weight, labels, **settings)


def matmul_fastce():
    return lambda hidden, weight, labels: fastce_torch.cross_entropy(hidden @ weight.t(), labels)


def torch_compile_upcast():
    loss_fn = lambda h, w, labels: F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX)
    return torch.compile(loss_fn, dynamic=False)


def liger():
    module = "liger_kernel.transformers.fused_linear_cross_entropy"
    loss = optional(module, "LigerFusedLinearCrossEntropyLoss", "liger-kernel")(ignore_index=IGNORE_INDEX)
    return lambda hidden, weight, labels: loss(weight, hidden, labels)


def torch_linear_cross_entropy():
    """torch.nn.functional.linear_cross_entropy's chunked path, where the installed torch has it."""
    if not hasattr(F, "linear_cross_entropy"):
        raise Unavailable(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
    # Without the options class (an older signature) the function's own default path is what is measured.
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    chunked = {"options": options()} if options else {}
    return lambda h, w, labels: F.linear_cross_entropy(h, w, labels, ignore_index=IGNORE_INDEX, **chunked)


def cut_cross_entropy():
    linear_cross_entropy = optional("cut_cross_entropy", "linear_cross_entropy", "cut-cross-entropy")
    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX)


LOADERS = {f"fastce_torch_linear{s}": partial(fastce_linear, kw) for s, kw in linear_shapes.FASTCE_SETTINGS.items()}
LOADERS |= {"matmul+fastce_torch": matmul_fastce, "torch_compile": torch_compile_upcast, "liger_flce": liger,
            "cut_cross_entropy": cut_cross_entropy, "torch_linear_ce": torch_linear_cross_entropy}  # fmt: skip


# --- measurement ----------------------------------------------------------------------------------------------


def make_inputs(shape, seed=0):
    return linear_shapes.make_inputs(shape, DEVICE, seed)


def _matmul_tflops(a, b):
    """TFLOP/s of a plain a @ b (cuBLAS), do_bench median."""
    out = torch.empty(a.shape[0], b.shape[1], device=DEVICE, dtype=a.dtype)
    with torch.no_grad():
        ms = torch_measure.bench_ms(lambda: torch.matmul(a, b, out=out), 100, 500)
    del out
    torch.cuda.empty_cache()
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / (ms * 1e-3) / 1e12


def matmul_tflops(shape):
    """hidden @ weight.T on this shape: the throughput the fused rows are compared with."""
    hidden, weight, _ = make_inputs(shape)
    return _matmul_tflops(hidden.detach(), weight.detach().t())


def peak_matmul_tflops(dims=None):
    """An (M, K) @ (K, N) matmul, PEAK_MATMUL by default: the card's peak as this run measures it."""
    m, k, n = dims or PEAK_MATMUL
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    return _matmul_tflops(a, torch.randn(k, n, device=DEVICE, generator=gen).to(torch.bfloat16))


def gradient_errors(loss_fn, inputs, reference):
    """One forward + backward of loss_fn: its loss and gradients against float32_reference's."""
    hidden, weight, *rest = inputs  # rest: the labels, and for the distillation tool the teacher's inputs
    ref_loss, ref_gh, ref_gw = reference
    loss = loss_fn(hidden, weight, *rest)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    errors = {"loss_rel": abs(float(loss.detach()) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30),
              "grad_hidden_rel_rms": linear_shapes.rel_rms(grad_hidden, ref_gh),
              "grad_weight_rel_rms": linear_shapes.rel_rms(grad_weight, ref_gw)}  # fmt: skip
    del loss, grad_hidden, grad_weight
    return errors


def measure(loss_fn, shape, quick=False, inputs=None, reference=None):
    hidden, weight, *rest = inputs or make_inputs(shape)  # gradients of the first two inputs (as gradient_errors)
    fwdbwd = lambda: torch.autograd.grad(loss_fn(hidden, weight, *rest), (hidden, weight))
    try:
        with torch.no_grad():
            loss = float(loss_fn(hidden, weight, *rest))
        for _ in range(2):
            fwdbwd()  # compile, JIT, cuBLAS workspaces
        peak = torch_measure.peak_extra_bytes(fwdbwd)
        ms = torch_measure.bench_ms(fwdbwd, 50 if quick else 200, 300 if quick else 1500)
        errors = {} if reference is None else gradient_errors(loss_fn, (hidden, weight, *rest), reference)
    finally:
        del hidden, weight, rest
        gc.collect()
        torch.cuda.empty_cache()
    extra = peak - (shape.N + shape.V) * shape.H * 2  # beyond the two bf16 gradients
    return {"fwdbwd_ms": ms, "peak_extra_bytes": peak, "extra_beyond_grads_bytes": extra, "loss": loss, **errors}


def check_fastce(rows):
    """The quick run's check: fastce_torch_linear's errors against float32_reference, and whether they are ok."""
    row = next((r for r in rows if r["impl"] == "fastce_torch_linear" and "loss_rel" in r), {})
    check = {k: row.get(k, float("nan")) for k in ("loss_rel", "grad_hidden_rel_rms", "grad_weight_rel_rms")}
    # bf16 logits and gradients: one rounding each is ~2e-3 rms relative; the weight gradient adds one rounding per
    # chunk (see fastce_torch/linear/chunks.py). A wrong formula is off by far more.
    limits = (1e-3, 1e-2, 2e-2)
    return check | {"ok": all(error < limit for error, limit in zip(check.values(), limits))}


def table_row(impl, shape, measured, matmul_tflops, peak_tflops):
    """A row of the table: the measured figures and the throughput columns (measured keys win: the JAX rows say
    which fraction of their labels was ignored)."""
    tflops = shape.flops / (measured["fwdbwd_ms"] * 1e-3) / 1e12
    row = {"impl": impl, "N": shape.N, "H": shape.H, "V": shape.V, "dtype": shape.dtype}
    row |= {"ignored": float(linear_shapes.ignored_rows(shape).mean()), **measured}
    row.update(effective_TFLOPs=tflops, of_matmul=tflops / matmul_tflops, of_peak=tflops / peak_tflops)
    return row


def _add_jax_rows(shapes, matmul, peak, rows, failures, impls=None):
    """bench.jax_linear's rows with this table's throughput columns (of_matmul against the torch matmul)."""
    try:
        from . import jax_linear
        from .jax_measure import has_gpu

        if not has_gpu():
            raise Unavailable("jax sees no GPU")
        result = jax_linear.run(shapes=tuple(shapes), say=say, **({} if impls is None else {"impls": impls}))
    except Exception as exc:  # noqa: BLE001 - jax missing or broken must not lose the torch rows
        failures.append(failure("jax", None, "load", exc))
        say(f"JAX rows skipped: {failures[-1]['error']}")
        return
    for r in result["rows"]:
        shape = linear_shapes.LinearShape(r["N"], r["H"], r["V"], r["dtype"])  # dense: the matmul's key
        rows.append(table_row(r.pop("impl"), shape, r, matmul[str(shape)], peak))
    failures.extend(result["failures"])


def _say_row(r):
    say(f"{r['impl']:28s} N={r['N']} H={r['H']} V={r['V']} ({r.get('ignored', 0):.0%} ignored): {r['fwdbwd_ms']:.2f} "
        f"ms, {r['effective_TFLOPs']:.0f} TFLOP/s ({r['of_matmul']:.0%} of matmul, {r['of_peak']:.0%} of peak), peak "
        f"extra {r['peak_extra_bytes'] / MiB:.0f} MiB ({r['extra_beyond_grads_bytes'] / MiB:.0f} beyond the "
        f"gradients), loss {r['loss']:.5f}{linear_shapes.accuracy_text(r)}")  # fmt: skip


def run_linear(quick=False, impls=None, shapes=None, with_jax=None, accuracy=True, ignored=None):
    """Every implementation on every shape (one float32 reference per shape unless `accuracy` is False; quick checks
    fastce_torch's errors); with `ignored` fractions each shape at each of them, IGNORED_IMPLS unless impls says
    otherwise."""
    import dataclasses

    from . import envinfo

    shapes = shapes or ((linear_shapes.QUICK_SHAPE,) if quick else linear_shapes.LINEAR_SHAPES)
    with_jax = (not quick and DEVICE == "cuda") if with_jax is None else with_jax
    if ignored:
        shapes = tuple(dataclasses.replace(s, ignored=f) for s in shapes for f in ignored)
        impls = impls or (list(linear_shapes.IGNORED_IMPLS[:2]) if quick else list(linear_shapes.IGNORED_IMPLS))
    # The _skip rows belong to --ignored runs (the standard table keeps its length and time budget).
    impls = impls or (["fastce_torch_linear", "fastce_torch_linear_1GiB", "matmul+fastce_torch"] if quick
                      else [i for i in LOADERS if not i.endswith("_skip")])  # fmt: skip
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    rows, failures = [], []
    peak = peak_matmul_tflops()
    say(f"bf16 matmul {'x'.join(map(str, PEAK_MATMUL))} (the peak): {peak:.0f} TFLOP/s")
    matmul = {}
    for shape in dict.fromkeys(s.dense for s in shapes):
        matmul[str(shape)] = matmul_tflops(shape)
        say(f"bf16 matmul {shape}: {matmul[str(shape)]:.0f} TFLOP/s")
    loaded = {impl: load(impl, LOADERS[impl], failures) for impl in impls}
    loaded = {impl: loss_fn for impl, loss_fn in loaded.items() if loss_fn is not None}
    for shape in shapes:
        inputs = make_inputs(shape)
        reference = linear_shapes.float32_reference(*inputs) if accuracy else None
        for impl, loss_fn in loaded.items():
            try:
                measured = measure(loss_fn, shape, quick=quick, inputs=inputs, reference=reference)
            except Exception as exc:  # noqa: BLE001 - OOM is a result too
                note_failure(failures, f"{impl} {shape}", impl, None, "measure", exc, shape=str(shape))
                continue  # measure freed what it made
            rows.append(table_row(impl, shape, measured, matmul[str(shape.dense)], peak))
            _say_row(rows[-1])
        del inputs, reference
        gc.collect()
        torch.cuda.empty_cache()
    if with_jax:
        _add_jax_rows(shapes, matmul, peak, rows, failures, linear_shapes.IGNORED_JAX_IMPLS if ignored else None)
    result = {"mode": "linear", "device": device, "date": envinfo.today(), "commit": envinfo.git_commit(),
              "torch": torch.__version__, "peak_matmul": {"shape": list(PEAK_MATMUL), "TFLOPs": peak},
              "matmul_TFLOPs": matmul, "rows": rows}  # fmt: skip
    if "torch_linear_ce" in impls and "torch_linear_ce" not in loaded:
        result["note"] = f"no torch_linear_ce row: torch {torch.__version__} has no F.linear_cross_entropy"
    if failures:
        result["failures"] = failures
    if quick:
        result["check"] = check_fastce(rows)
        say(f"fastce_torch.linear_cross_entropy vs float32 at {shapes[0]}: {result['check']}")
    return result


def main_linear(quick, json_path=None, shapes=None, ignored=None) -> int:
    result = run_linear(quick=quick, shapes=shapes, ignored=ignored)
    print(f"\n{result['device']}, commit {result['commit']}\n")
    print(linear_table(result))
    for f in result.get("failures", []):
        print(f"not measured: {f['impl']} {f.get('shape', '')} ({f['stage']}): {f['error']}")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    bad = [f for f in result.get("failures", []) if f["impl"].startswith("fastce") and f["stage"] != "unavailable"]
    if quick and not result["check"]["ok"]:
        print(f"FAILED fastce_torch.linear_cross_entropy check: {result['check']}", file=sys.stderr)
        return 1
    return 1 if bad else 0
