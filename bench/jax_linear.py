"""The JAX rows of `python -m bench --linear` (import after bench.jax_setup.configure()): jit(value_and_grad) of
fastce_jax at each FASTCE_SETTINGS entry, xla_linear, matmul+fastce_jax and the three matmuls alone (the ceiling),
host-timed as bench/jax_measure.py; memory is the step's XLA temp size."""

from .linear_shapes import FASTCE_SETTINGS, LINEAR_SHAPES, accuracy_text, ignored_rows, rel_rms
from .linear_shapes import float32_reference as float32_reference_torch
from .shapes import IGNORE_INDEX

FASTCE_IMPLS = {f"fastce_jax_linear{suffix}": settings for suffix, settings in FASTCE_SETTINGS.items()}
# The default rows; fastce_jax_linear_skip is timed by `--ignored` runs (bench.linear_shapes.IGNORED_JAX_IMPLS).
LINEAR_IMPLS = (*(i for i in FASTCE_IMPLS if not i.endswith("_skip")), "xla_linear", "matmul+fastce_jax")


def make_inputs(shape, seed=0):
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(shape.dtype)
    kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(kh, (shape.N, shape.H), dtype)
    # Logits of unit scale, as a trained LM head gives roughly.
    weight = (jax.random.normal(kw, (shape.V, shape.H), jnp.float32) / shape.H**0.5).astype(dtype)
    labels = jax.random.randint(ky, (shape.N,), 0, shape.V, dtype=jnp.int32)
    return hidden, weight, jnp.where(ignored_rows(shape), IGNORE_INDEX, labels)


def float32_reference(hidden, weight, labels):
    """(d hidden, d weight) from the torch rows' float32 reference (linear_shapes), the arrays read through DLPack."""
    import torch

    hidden, weight, labels = (torch.from_dlpack(array) for array in (hidden, weight, labels))
    return float32_reference_torch(hidden, weight, labels.long())


def loss_fn(impl, backend="auto"):
    """(hidden, weight, labels) -> scalar loss."""
    import fastce_jax

    from .jax_impls import xla_loss

    if impl in FASTCE_IMPLS:
        settings = FASTCE_IMPLS[impl]
        return lambda h, w, y: fastce_jax.linear_cross_entropy(h, w, y, backend=backend, **settings)
    if impl == "xla_linear":
        xla_ce = xla_loss()
        return lambda h, w, y: xla_ce(h @ w.T, y)
    if impl == "matmul+fastce_jax":
        return lambda h, w, y: fastce_jax.cross_entropy(h @ w.T, y, backend=backend)
    raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(LINEAR_IMPLS)}")


def measure(impl, shape, inputs, batch_target_ms=50.0, backend="auto", reference=None) -> dict:
    import jax

    from .jax_measure import bench_ms, peak_extra_bytes

    fn = loss_fn(impl, backend)
    fwd = jax.jit(fn).lower(*inputs).compile()
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*inputs).compile()
    temp = peak_extra_bytes(step)
    loss, (dh, dw) = step(*inputs)
    # ok: finite, and (bf16 logits either way) within the logits' rounding of the float32 loss
    ok = bool(jax.numpy.isfinite(loss)) and all(
        bool(jax.numpy.isfinite(g[:4].astype("float32")).all()) for g in (dh, dw)
    )
    errors = {}
    if reference is not None:
        import torch

        ref_loss, ref_dh, ref_dw = map(torch.as_tensor, reference)
        ok = ok and abs(float(loss) - float(ref_loss)) <= 2e-3 * abs(float(ref_loss)) + 1e-3
        errors = {"grad_hidden_rel_rms": rel_rms(torch.from_dlpack(dh), ref_dh)}
        errors["grad_weight_rel_rms"] = rel_rms(torch.from_dlpack(dw), ref_dw)
    del dh, dw
    fwd_ms = bench_ms(lambda: fwd(*inputs), batch_target_ms)
    fwdbwd_ms = bench_ms(lambda: step(*inputs)[1][1], batch_target_ms)
    return {
        "fwd_ms": fwd_ms,
        "fwdbwd_ms": fwdbwd_ms,
        "TFLOPs": shape.flops / (fwdbwd_ms * 1e-3) / 1e12,
        "peak_extra_bytes": temp,
        "peak_extra_kind": "xla_temp_size",
        "loss": float(loss),
        "ok": ok,
        **errors,
    }


def measure_matmuls(shape, inputs, batch_target_ms=50.0) -> dict:
    """The step's three matmuls alone (logits, dh, dW) in the input dtype: the throughput ceiling."""
    import jax

    from .jax_measure import bench_ms

    hidden, weight, _ = inputs
    grad_logits = jax.random.normal(jax.random.key(1), (shape.N, shape.V), hidden.dtype)

    @jax.jit
    def three(h, w, g):
        return h @ w.T, g @ w, g.T @ h

    out = three(hidden, weight, grad_logits)
    del out
    ms = bench_ms(lambda: three(hidden, weight, grad_logits)[2], batch_target_ms)
    del grad_logits
    return {"fwdbwd_ms": ms, "TFLOPs": shape.flops / (ms * 1e-3) / 1e12}


def run(
    shapes=LINEAR_SHAPES, impls=LINEAR_IMPLS, batch_target_ms=50.0, backend="auto", say=None, accuracy=True
) -> dict:
    """Every implementation on every shape, failures recorded; with accuracy, gradient errors against float32."""
    import gc

    from . import progress
    from .progress import note_failure  # failures are said on progress.say's stderr

    say = say or progress.say
    rows, failures = [], []
    for shape in shapes:
        inputs = make_inputs(shape)
        base = {"N": shape.N, "H": shape.H, "V": shape.V, "dtype": shape.dtype}
        base["ignored"] = float(ignored_rows(shape).mean())
        matmul_tflops = None
        try:
            m = measure_matmuls(shape, inputs, batch_target_ms)
            matmul_tflops = m["TFLOPs"]
            rows.append({"impl": "matmul", **base, **m})
            say(f"matmul {shape}: {m['fwdbwd_ms']:.2f} ms, {m['TFLOPs']:.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001
            note_failure(failures, f"matmul {shape}", "matmul", None, "measure", exc, **base)
        reference = None
        if accuracy:
            try:
                reference = float32_reference(*inputs)
            except Exception as exc:  # noqa: BLE001 - the timings do not depend on it
                note_failure(failures, f"float32 reference {shape}", "float32_reference", None, "measure", exc, **base)
        for impl in impls:
            try:
                r = measure(impl, shape, inputs, batch_target_ms, backend, reference)
            except Exception as exc:  # noqa: BLE001
                note_failure(failures, f"{impl} {shape}", impl, None, "measure", exc, **base)
                continue
            if matmul_tflops:
                r["of_matmul"] = r["TFLOPs"] / matmul_tflops
            rows.append({"impl": impl, **base, **r})
            of_matmul = f" ({r['of_matmul']:.0%} of matmul)" if matmul_tflops else ""
            memory = f"temp {r['peak_extra_bytes'] / 2**20:.0f} MiB, loss {r['loss']:.5f}{accuracy_text(r)}"
            say(f"{impl} {shape}: {r['fwdbwd_ms']:.2f} ms, {r['TFLOPs']:.0f} TFLOP/s{of_matmul}, {memory}")
            gc.collect()
        del inputs, reference
        gc.collect()
    return {"rows": rows, "failures": failures}
