"""The JAX rows of `python -m bench --linear` (import after bench.jax_setup.configure()): jit(value_and_grad) of
fastce_jax at each FASTCE_SETTINGS entry, xla_linear, matmul+fastce_jax and the three matmuls alone
(jax_three_matmuls), host-timed as bench/jax_measure.py; memory is the step's XLA temp size (it holds no gradients,
so it is also the extra beyond them). bench.linear adds the throughput columns."""

from . import linear_shapes

FASTCE_IMPLS = {f"fastce_jax_linear{suffix}": settings for suffix, settings in linear_shapes.FASTCE_SETTINGS.items()}
# The default rows; fastce_jax_linear_skip is timed by `--ignored` runs (bench.linear_shapes.IGNORED_JAX_IMPLS).
LINEAR_IMPLS = (*(i for i in FASTCE_IMPLS if not i.endswith("_skip")), "xla_linear", "matmul+fastce_jax")


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


def measure(fn, inputs, batch_target_ms=50.0, reference=None) -> dict:
    """jit(fn) and jit(value_and_grad(fn)) of fn(hidden, weight, labels) -> loss, and its gradients' errors against
    reference (the torch float32 (loss, d hidden, d weight)); bench.tools.rl_step's JAX rows are measured here too."""
    import jax

    from .jax_measure import bench_ms, peak_extra_bytes

    fwd = jax.jit(fn).lower(*inputs).compile()
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*inputs).compile()
    temp = peak_extra_bytes(step)
    loss, (dh, dw) = step(*inputs)
    # ok: finite, and (bf16 logits either way) within the logits' rounding of the float32 loss
    finite = lambda x: bool(jax.numpy.isfinite(x.astype("float32")).all())
    ok = finite(loss) and finite(dh[:4]) and finite(dw[:4])
    errors = {}
    if reference is not None:
        import torch

        ref_loss, ref_dh, ref_dw = map(torch.as_tensor, reference)
        ok = ok and abs(float(loss) - float(ref_loss)) <= 2e-3 * abs(float(ref_loss)) + 1e-3
        errors = {"grad_hidden_rel_rms": linear_shapes.rel_rms(torch.from_dlpack(dh), ref_dh)}
        errors["grad_weight_rel_rms"] = linear_shapes.rel_rms(torch.from_dlpack(dw), ref_dw)
    del dh, dw
    fwd_ms = bench_ms(lambda: fwd(*inputs), batch_target_ms)
    fwdbwd_ms = bench_ms(lambda: step(*inputs)[1][1], batch_target_ms)
    row = {"fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms, "peak_extra_bytes": temp, "extra_beyond_grads_bytes": temp}
    return row | {"peak_extra_kind": "xla_temp_size", "loss": float(loss), "ok": ok, **errors}


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
    return {"fwdbwd_ms": ms, "peak_extra_bytes": 0, "extra_beyond_grads_bytes": 0}


def run(shapes=linear_shapes.LINEAR_SHAPES, impls=LINEAR_IMPLS, batch_target_ms=50.0, backend="auto", say=None,
        accuracy=True) -> dict:  # fmt: skip
    """Every implementation on every shape, failures recorded; with accuracy, gradient errors against float32."""
    import gc

    import jax

    from . import progress
    from .progress import note_failure  # failures are said on progress.say's stderr

    say = say or progress.say
    rows, failures = [], []
    for shape in shapes:
        torch_inputs = linear_shapes.make_inputs(shape, "cuda" if jax.default_backend() == "gpu" else "cpu")
        inputs = linear_shapes.to_jax(*torch_inputs)  # the torch rows' values
        base = {"N": shape.N, "H": shape.H, "V": shape.V, "dtype": shape.dtype}
        base["ignored"] = float(linear_shapes.ignored_rows(shape).mean())
        try:
            rows.append({"impl": "jax_three_matmuls", **base, **measure_matmuls(shape, inputs, batch_target_ms)})
            say(f"jax_three_matmuls {shape}: {rows[-1]['fwdbwd_ms']:.2f} ms")
        except Exception as exc:  # noqa: BLE001
            note_failure(failures, f"matmul {shape}", "jax_three_matmuls", None, "measure", exc, **base)
        reference = None
        if accuracy:
            try:
                reference = linear_shapes.float32_reference(*torch_inputs)
            except Exception as exc:  # noqa: BLE001 - the timings do not depend on it
                note_failure(failures, f"float32 reference {shape}", "float32_reference", None, "measure", exc, **base)
        for impl in impls:
            try:
                r = measure(loss_fn(impl, backend), inputs, batch_target_ms, reference)
            except Exception as exc:  # noqa: BLE001
                note_failure(failures, f"{impl} {shape}", impl, None, "measure", exc, **base)
                continue
            rows.append({"impl": impl, **base, **r})
            memory = f"temp {r['peak_extra_bytes'] / 2**20:.0f} MiB, loss {r['loss']:.5f}"
            say(f"{impl} {shape}: {r['fwdbwd_ms']:.2f} ms, {memory}{linear_shapes.accuracy_text(r)}")
            gc.collect()
        del inputs, torch_inputs, reference
        gc.collect()
    return {"rows": rows, "failures": failures}
