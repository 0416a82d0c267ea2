"""fastce_jax.linear_cross_entropy against a float64 NumPy reference (the matmul in float64, then
np_cross_entropy's per-token loss and gradient, chained through the matmul by hand).

On CPU backend="kernel" runs the chunked path with the Pallas kernels in interpret mode, on tiny shapes, with
the chunk size forced small (the chunk_rows keyword) so that several chunks and the clamped, overlapping last chunk run.
With --gpu the same tests run the compiled kernels; the tests marked gpu add bf16 at a mid shape and the
compiled memory at the benchmark shapes.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fastce_jax
from fastce_jax import linear_cross_entropy
from shared_tests import reference as float64_reference

from .checks import OPTION_SETS, as_float64

# The chunk loop's module (its budget and the per-chunk matmul the tests count).
LCE = importlib.import_module("fastce_jax.linear.engine")

LOSS_TOL = dict(rtol=3e-5, atol=3e-5)
UPSTREAM = 1.7  # the tests differentiate UPSTREAM * loss, so the backward's scaling is checked too


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """The chunk matmuls follow JAX's default matmul precision, which on a GPU may be TF32 for float32 inputs;
    the float32-vs-float64 tolerances here are for float32 products."""
    with jax.default_matmul_precision("float32"):
        yield


ROWS = 8  # the chunk_rows the tests pass: several chunks on tiny shapes


def make_inputs(put, n, h, v, *, seed, dtype=jnp.float32, ignore_index=-100, n_ignored=3, lead=None):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n, h))
    weight = rng.standard_normal((v, h)) * (2.0 / np.sqrt(h))
    bias = rng.standard_normal(v) * 0.5
    labels = rng.integers(0, v, n)
    labels[rng.permutation(n)[:n_ignored]] = ignore_index
    shape = (n,) if lead is None else lead
    return (
        put(hidden.reshape(shape + (h,)), dtype),
        put(weight, dtype),
        put(bias, dtype),
        labels.reshape(shape),
    )


def reference(hidden, weight, labels, *, bias=None, reduction="mean", n_items=None, upstream=1.0, **opts):
    """float64 (loss, dhidden, dweight, dbias) of upstream * linear_cross_entropy (shared_tests/reference.py);
    upstream is a scalar, or the per-token cotangent (labels' shape) for reduction="none"."""
    exact = float64_reference.linear_cross_entropy(
        as_float64(hidden),
        as_float64(weight),
        np.asarray(labels),
        bias=None if bias is None else as_float64(bias),
        reduction=reduction,
        n_items=n_items,
        upstream=np.broadcast_to(np.asarray(upstream, np.float64), np.shape(labels)) if reduction == "none" else None,
        opts=float64_reference.Options(**opts),
    )
    scale = 1.0 if reduction == "none" else upstream
    grad_bias = None if exact.grad_bias is None else exact.grad_bias * scale
    return exact.logits.loss, exact.grad_hidden * scale, exact.grad_weight * scale, grad_bias


def assert_close(actual, expected, *, rtol, atol, what=""):
    """allclose that never lets NaN pass: NaN only exactly where the reference has NaN. The matmul products'
    rounding is outside tolerances.py's model (see shared_tests/test_linear_cross_entropy.py), hence rtol/atol."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    nan_e = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan_e), f"{what}: NaN pattern differs"
    np.testing.assert_allclose(actual[~nan_e], expected[~nan_e], rtol=rtol, atol=atol, equal_nan=False, err_msg=what)


def grad_tol(expected, rtol):
    finite = np.isfinite(expected)
    scale = np.abs(expected[finite]).max() if finite.any() else 1.0
    return dict(rtol=rtol, atol=rtol * 0.1 * scale)


def check(
    put,
    hidden,
    weight,
    labels,
    *,
    bias=None,
    reduction="mean",
    grad_rtol=2e-4,
    cotangent=None,
    chunk_rows=ROWS,
    **kwargs,
):
    """value_and_grad of UPSTREAM * loss (or sum(cotangent * loss) for "none") w.r.t. hidden, weight (and bias),
    against the float64 reference.  Returns the loss and gradients."""
    y = put(labels, jnp.int32)
    argnums = (0, 1) if bias is None else (0, 1, 2)

    def f(h, w, b):
        loss = linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, backend="kernel", chunk_rows=chunk_rows, **kwargs
        )
        if reduction == "none":
            return jnp.sum(loss * cotangent), loss
        return UPSTREAM * loss, loss

    (_, loss), grads = jax.value_and_grad(f, argnums=argnums, has_aux=True)(hidden, weight, bias)
    upstream = cotangent if reduction == "none" else UPSTREAM
    opts = {k: v for k, v in kwargs.items() if k not in ("n_items", "accumulate_in_float32", "skip_ignored_rows")}
    ref = reference(
        hidden, weight, labels, bias=bias, reduction=reduction, n_items=kwargs.get("n_items"), upstream=upstream, **opts
    )
    assert loss.dtype == jnp.float32 and loss.shape == np.shape(ref[0])
    assert_close(loss, ref[0], what="loss", **LOSS_TOL)
    for name, got, want, like in zip(("dhidden", "dweight", "dbias"), grads, ref[1:], (hidden, weight, bias)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert_close(got, want, what=name, **grad_tol(want, grad_rtol))
    return loss, grads


# ----------------------------------------------------------------------------
# Float32 against float64, several chunks.
# ----------------------------------------------------------------------------


# Each option alone (and in pairs) on the fused loss: shared_tests/test_linear_cross_entropy.py's cases (both
# packages); here none, every option at once and an ignored index inside the vocabulary, with each reduction.
@pytest.mark.parametrize("option_set", ["plain", "all", "ignore5"])
def test_options_and_reductions(put, option_set):
    opts = OPTION_SETS[option_set]
    seed = list(OPTION_SETS).index(option_set)
    hidden, weight, bias, labels = make_inputs(put, 21, 16, 67, seed=seed, ignore_index=opts.get("ignore_index", -100))
    if option_set == "ignore5":
        labels[4] = 5
    cotangent = put(np.random.default_rng(seed).uniform(0.5, 2.0, labels.shape), jnp.float32)
    for reduction in ("mean", "sum", "none"):
        check(
            put,
            hidden,
            weight,
            labels,
            bias=bias if seed % 2 else None,
            reduction=reduction,
            cotangent=cotangent,
            **opts,
        )


@pytest.mark.parametrize("rows", [1, 5, 8, 20, 40])
def test_chunk_sizes(put, rows):
    """One row per chunk, a last chunk overlapping the one before (40 = 8 * 5 and 40 = 7 * 5 + 5), one chunk."""
    hidden, weight, bias, labels = make_inputs(put, 40 if rows != 5 else 37, 16, 50, seed=rows)
    check(put, hidden, weight, labels, bias=bias, label_smoothing=0.05, chunk_rows=rows)


def test_n_items_int_and_traced(put):
    hidden, weight, bias, labels = make_inputs(put, 19, 16, 60, seed=11)
    for reduction in ("mean", "sum"):
        check(put, hidden, weight, labels, reduction=reduction, n_items=7)
    y = put(labels, jnp.int32)

    @jax.jit
    def step(h, w, n):
        return jax.value_and_grad(
            lambda h, w: linear_cross_entropy(h, w, y, n_items=n, backend="kernel", chunk_rows=ROWS),
            (0, 1),
        )(h, w)

    loss, (dh, dw) = step(hidden, weight, jnp.asarray(7, jnp.int32))
    ref = reference(hidden, weight, labels, n_items=7)
    assert_close(loss, ref[0], what="loss", **LOSS_TOL)
    assert_close(dh, ref[1], what="dhidden", **grad_tol(ref[1], 2e-4))
    assert_close(dw, ref[2], what="dweight", **grad_tol(ref[2], 2e-4))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(put, reduction):
    hidden, weight, bias, labels = make_inputs(put, 12, 16, 50, seed=3)
    labels[:] = -100
    y = put(labels, jnp.int32)

    def f(h, w, b):
        return jnp.sum(linear_cross_entropy(h, w, y, bias=b, reduction=reduction, backend="kernel", chunk_rows=ROWS))

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(hidden, weight, bias)
    assert float(loss) == 0.0
    for g in grads:
        assert np.array_equal(np.asarray(g), np.zeros(g.shape)), "all-ignored batch must have zero gradients"


def test_bad_label_is_nan(put):
    """A label outside [0, V): that token's loss and dhidden row are NaN, and so (through the sum over tokens)
    are dweight and dbias; the other tokens' dhidden rows are untouched."""
    hidden, weight, bias, labels = make_inputs(put, 18, 16, 50, seed=4)
    labels[9] = 50
    labels[2] = -7
    cotangent = put(np.ones(labels.shape), jnp.float32)
    loss, (dh, dw, db) = check(put, hidden, weight, labels, bias=bias, reduction="none", cotangent=cotangent)
    assert np.isnan(np.asarray(loss)[[2, 9]]).all() and np.isfinite(np.delete(np.asarray(loss), [2, 9])).all()
    assert np.isnan(np.asarray(dh)[[2, 9]]).all() and np.isfinite(np.delete(np.asarray(dh), [2, 9], axis=0)).all()
    assert np.isnan(np.asarray(dw)).all() and np.isnan(np.asarray(db)).all()
    mean = linear_cross_entropy(hidden, weight, put(labels, jnp.int32), backend="kernel", chunk_rows=ROWS)
    assert np.isnan(float(mean))


def test_int64_labels_beyond_int32_are_nan(put):
    """A NumPy int64 label of 2**32 + 3 must not wrap into the vocabulary as class 3."""
    hidden, weight, _, labels = make_inputs(put, 10, 16, 50, seed=5)
    labels = labels.astype(np.int64)
    labels[1] = 2**32 + 3
    losses = linear_cross_entropy(hidden, weight, labels, reduction="none", backend="kernel", chunk_rows=ROWS)
    assert np.isnan(np.asarray(losses)[1]) and np.isfinite(np.delete(np.asarray(losses), 1)).all()


def test_3d_hidden(put):
    hidden, weight, bias, labels = make_inputs(put, 24, 16, 60, seed=6, lead=(3, 8))
    check(put, hidden, weight, labels, bias=bias)
    cotangent = put(np.random.default_rng(6).uniform(0.5, 2, (3, 8)), jnp.float32)
    loss, _ = check(put, hidden, weight, labels, reduction="none", cotangent=cotangent, z_loss=1e-3)
    assert loss.shape == (3, 8)


def test_jit_and_vmap(put):
    """vmap over a batch of (hidden, labels) with a shared weight: each member's loss and gradients."""
    batch, n, dim, vocab = 3, 10, 16, 50
    rng = np.random.default_rng(7)
    hidden = put(rng.standard_normal((batch, n, dim)), jnp.float32)
    weight = put(rng.standard_normal((vocab, dim)) * 0.5, jnp.float32)
    labels = rng.integers(0, vocab, (batch, n))
    labels[0, 3] = -100
    labels[2, :4] = -100

    def one(h, w, y):
        return linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=ROWS, label_smoothing=0.1)

    run = jax.jit(jax.vmap(jax.value_and_grad(one, argnums=(0, 1)), in_axes=(0, None, 0)))
    loss, (dh, dw) = run(hidden, weight, put(labels, jnp.int32))
    for b in range(batch):
        ref = reference(hidden[b], weight, labels[b], label_smoothing=0.1)
        assert_close(loss[b], ref[0], what="loss", **LOSS_TOL)
        assert_close(dh[b], ref[1], what="dhidden", **grad_tol(ref[1], 2e-4))
        assert_close(dw[b], ref[2], what="dweight", **grad_tol(ref[2], 2e-4))


def test_float32_weight_grad_accumulator(put):
    """accumulate_in_float32=True (the opt-in float32 accumulator) gives the same float32 gradients."""
    hidden, weight, bias, labels = make_inputs(put, 30, 16, 50, seed=8)
    check(put, hidden, weight, labels, bias=bias, z_loss=1e-3, accumulate_in_float32=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(put, dtype):
    """bf16/f16 inputs: logits rounded to the dtype before the loss, gradients in the dtype.  The reference
    sees the rounded inputs, not the rounded logits, so the tolerance is the dtype's."""
    hidden, weight, bias, labels = make_inputs(put, 24, 32, 70, seed=9, dtype=jnp.dtype(dtype))
    rtol = 3e-2 if dtype == "bfloat16" else 4e-3
    y = put(labels, jnp.int32)
    loss, grads = jax.value_and_grad(
        lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, backend="kernel", chunk_rows=ROWS),
        argnums=(0, 1, 2),
    )(hidden, weight, bias)
    ref = reference(hidden, weight, labels, bias=bias)
    assert_close(loss, ref[0], what="loss", rtol=rtol, atol=rtol)
    for name, got, want in zip(("dhidden", "dweight", "dbias"), grads, ref[1:]):
        assert got.dtype == jnp.dtype(dtype)
        assert_close(got, want, what=name, **grad_tol(want, 4 * rtol))


def test_mixed_dtypes_keep_each_gradient_dtype(put):
    hidden, weight, bias, labels = make_inputs(put, 12, 16, 50, seed=10)
    hidden16 = hidden.astype(jnp.bfloat16)
    y = put(labels, jnp.int32)
    grads = jax.grad(
        lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, backend="kernel", chunk_rows=ROWS),
        argnums=(0, 1, 2),
    )(hidden16, weight, bias)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.float32, jnp.float32]


# ----------------------------------------------------------------------------
# Backends, arguments, memory.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_order_equals_the_reference(put, reduction):
    """Grad of grad (a gradient penalty through hidden, differentiated with respect to hidden, weight and bias) and a
    Hessian-vector product (jvp of grad) through the chunked kernels, several chunks, equal the reference backend's."""
    hidden, weight, bias, labels = make_inputs(put, 12, 8, 30, seed=21)
    y = put(labels, jnp.int32)
    kw = dict(logit_softcapping=4.0, z_loss=1e-3, label_smoothing=0.1, reduction=reduction)
    directions = tuple(
        put(np.random.default_rng(22).standard_normal(t.shape), jnp.float32) for t in (hidden, weight, bias)
    )

    def second_order(backend):
        def loss(h, w, b):
            return jnp.sum(linear_cross_entropy(h, w, y, bias=b, backend=backend, chunk_rows=5, **kw))

        grad = jax.grad(loss, argnums=(0, 1, 2))
        penalty = jax.grad(lambda h, w, b: jnp.sum(grad(h, w, b)[0] ** 2), argnums=(0, 1, 2))(hidden, weight, bias)
        hvp = jax.jvp(grad, (hidden, weight, bias), directions)[1]
        return (*penalty, *hvp)

    for got, want in zip(second_order("kernel"), second_order("reference")):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 1e-4
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5 * scale)


def test_reference_backend_matches(put):
    hidden, weight, bias, labels = make_inputs(put, 16, 16, 50, seed=12)
    y = put(labels, jnp.int32)
    kw = dict(bias=bias, logit_softcapping=5.0, label_smoothing=0.1)
    got = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, y, backend="reference", **kw), argnums=(0, 1))(
        hidden, weight
    )
    ref = reference(hidden, weight, labels, bias=bias, logit_softcapping=5.0, label_smoothing=0.1)
    assert_close(got[0], ref[0], what="loss", **LOSS_TOL)
    assert_close(got[1][1], ref[2], what="dweight", **grad_tol(ref[2], 2e-4))


def test_auto_backend_picks_kernels_only_on_gpu(put, use_gpu):
    hidden, weight, _, labels = make_inputs(put, 16, 16, 50, seed=13)
    y = put(labels, jnp.int32)
    for backend, kernels in (("auto", use_gpu), ("kernel", True), ("reference", False)):
        jaxpr = str(jax.make_jaxpr(lambda h, w: linear_cross_entropy(h, w, y, backend=backend))(hidden, weight))
        assert ("pallas_call" in jaxpr) == kernels, backend


def test_validate_labels(put):
    hidden, weight, _, labels = make_inputs(put, 8, 16, 50, seed=14)
    labels[6] = 50
    with pytest.raises(ValueError, match=r"labels\[6\] = 50"):
        linear_cross_entropy(hidden, weight, labels, validate_labels=True)


def test_bad_arguments(put):
    hidden, weight, bias, labels = make_inputs(put, 8, 16, 50, seed=15)
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_cross_entropy(hidden, weight, labels, bias=bias[:-1])
    with pytest.raises(TypeError, match="hidden must be float32"):
        linear_cross_entropy(hidden.astype(jnp.int32), weight, labels)
    with pytest.raises(ValueError, match="labels must have hidden.s leading shape"):
        linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="n_items"):
        linear_cross_entropy(hidden, weight, labels, n_items=0)
    with pytest.raises(TypeError, match="return_z_loss must be a bool"):
        linear_cross_entropy(hidden, weight, labels, return_z_loss=1)


def test_empty_batch(put):
    hidden = put(np.zeros((0, 16)), jnp.float32)
    weight = put(np.random.default_rng(16).standard_normal((50, 16)), jnp.float32)
    labels = np.zeros((0,), np.int32)
    assert float(linear_cross_entropy(hidden, weight, labels, backend="kernel", chunk_rows=ROWS)) == 0.0
    assert linear_cross_entropy(hidden, weight, labels, reduction="none", backend="kernel", chunk_rows=ROWS).shape == (
        0,
    )


def compiled_temp_bytes(n, dim, vocab, dtype, **settings):
    """XLA's scratch for jit(value_and_grad) w.r.t. hidden and weight (inputs and outputs not counted)."""
    hidden = jax.ShapeDtypeStruct((n, dim), dtype)
    weight = jax.ShapeDtypeStruct((vocab, dim), dtype)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32)
    fn = jax.value_and_grad(
        lambda h, w, y: linear_cross_entropy(h, w, y, backend="kernel", **settings),
        argnums=(0, 1),
    )
    return jax.jit(fn).lower(hidden, weight, labels).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_does_not_grow_with_rows():
    """CPU (interpret mode keeps a few copies of each chunk): the scratch is a function of the chunk, not of N,
    and far below one (N, V) array of logits."""
    dim, vocab = 32, 4096
    small, large = (compiled_temp_bytes(n, dim, vocab, jnp.float32, chunk_rows=64) for n in (512, 2048))
    assert large - small <= 64 * 2048, (small, large)  # a few float32 vectors of N
    assert large < 2048 * vocab * 4 / 4, large


@pytest.mark.gpu
@pytest.mark.parametrize("f32_weight_grad", [True, False])
@pytest.mark.parametrize("n, dim, vocab", [(8192, 4096, 128256), (8192, 2304, 256000), (32768, 4096, 128256)])
def test_gpu_compiled_memory(capsys, n, dim, vocab, f32_weight_grad):
    """bf16 on the GPU: the scratch is one chunk of logits (DEFAULT_WORKSPACE_BYTES), the float32 weight-gradient
    carry when enabled, and a little more; never the (N, V) logits."""
    temp = compiled_temp_bytes(n, dim, vocab, jnp.bfloat16, accumulate_in_float32=f32_weight_grad)
    logits_bytes = n * vocab * 2
    carry = vocab * dim * 4 if f32_weight_grad else 0
    budget = carry + LCE.DEFAULT_WORKSPACE_BYTES + (256 << 20)
    with capsys.disabled():
        print(
            f"\n[fastce_jax linear] {n}x{dim}x{vocab} bf16 f32_weight_grad={f32_weight_grad}: temp "
            f"{temp / 2**20:.0f} MiB (budget {budget / 2**20:.0f}, logits {logits_bytes / 2**20:.0f})"
        )
    assert temp <= budget
    if carry + LCE.DEFAULT_WORKSPACE_BYTES < logits_bytes:
        assert temp < logits_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_bf16_mid_shape(put, with_bias):
    """bf16 against float64 at a mid shape, chunked by the budget (64 MiB here: 7 chunks of 640 rows, the last
    one clamped), as users call it (backend "auto", jit)."""
    n, dim, vocab = 4000, 512, 50257
    rng = np.random.default_rng(20)
    hidden = put(rng.standard_normal((n, dim)), jnp.bfloat16)
    weight = put(rng.standard_normal((vocab, dim)) * (2.0 / np.sqrt(dim)), jnp.bfloat16)
    bias = put(rng.standard_normal(vocab) * 0.5, jnp.bfloat16) if with_bias else None
    labels = rng.integers(0, vocab, n)
    labels[::7] = -100
    y = put(labels, jnp.int32)
    rows = LCE.rows_per_chunk(n, vocab, 2, workspace_bytes=64 << 20)
    fn = jax.jit(
        jax.value_and_grad(
            lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, logit_softcapping=30.0, workspace_bytes=64 << 20),
            argnums=(0, 1, 2),
        )
    )
    loss, grads = fn(hidden, weight, bias)
    ref = reference(hidden, weight, labels, bias=bias, logit_softcapping=30.0)
    # The logits are rounded to bf16 before the loss (as with any bf16 matmul), the reference's are not.
    assert_close(loss, ref[0], what="loss", rtol=1e-2, atol=1e-2)
    for name, got, want in zip(("dhidden", "dweight", "dbias"), grads, ref[1:]):
        if want is None or got is None:
            continue
        assert got.dtype == jnp.bfloat16
        assert_close(got, want, what=name, **grad_tol(want, 5e-2))
    assert rows == 640


# ----------------------------------------------------------------------------
# skip_ignored_rows: the kept rows first, chunks without one skipped on the device.
# ----------------------------------------------------------------------------

IGNORED = {
    "none": lambda i: i < 0,
    "half-interleaved": lambda i: i % 2 == 1,
    "ninety-clustered": lambda i: (i < 20) | (i >= 24),
    "all": lambda i: i >= 0,
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_skip_ignored_rows_runs_only_chunks_with_kept_rows(put, reduction, chunks_run):
    """40 rows in 5 chunks of 8: with the keyword only the chunks holding kept rows run (forward; "none" also in
    the backward), and the loss and gradients are the default loop's and the reference's (d hidden exactly 0 on
    ignored rows). Every ignored-row pattern in one test: the same programs, compiled once."""
    hidden, weight, bias, base_labels = make_inputs(put, 40, 16, 50, seed=30, n_ignored=0)
    cotangent = put(np.random.default_rng(30).uniform(0.5, 2.0, base_labels.shape), jnp.float32)
    for pattern, ignored in IGNORED.items():
        labels = base_labels.copy()
        labels[ignored(np.arange(40))] = -100
        n_kept = int((labels != -100).sum())
        results = {}
        for skip in (False, True):
            chunks_run.clear()
            results[skip] = check(
                put, hidden, weight, labels, bias=bias, reduction=reduction, cotangent=cotangent, skip_ignored_rows=skip
            )
            passes = 2 if reduction == "none" else 1
            assert len(chunks_run) == passes * (-(-n_kept // ROWS) if skip else 5), (pattern, skip, len(chunks_run))
        (loss, grads), (loss0, grads0) = results[True], results[False]
        np.testing.assert_allclose(np.asarray(loss), np.asarray(loss0), rtol=1e-6, atol=1e-7, err_msg=pattern)
        for got, want in zip(grads, grads0):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7, err_msg=pattern)
        assert not np.asarray(grads[0])[labels == -100].any(), pattern


def test_skip_ignored_rows_outputs_shift_jit_and_vmap(put):
    """Extra outputs in the original order and shift=1 under jit; vmap over sequences with their own ignored rows
    (batched labels: the cond runs both branches, the result is the same)."""
    hidden, weight, _, labels = make_inputs(put, 24, 16, 50, seed=31, n_ignored=0, lead=(2, 12))
    labels[0, :7] = -100
    labels[1, 2::2] = -100
    y = put(labels, jnp.int32)
    outputs = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)
    kw = dict(backend="kernel", chunk_rows=3, shift=1, z_loss=1e-2, label_smoothing=0.1, **outputs)

    def run(skip, reduction):
        def f(h, w):
            out = linear_cross_entropy(h, w, y, reduction=reduction, skip_ignored_rows=skip, **kw)
            return jnp.sum(out.loss) + jnp.sum(out.z_loss), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, weight)

    for reduction in ("mean", "none"):
        (_, got), grads = run(True, reduction)
        (_, want), grads0 = run(False, reduction)
        for name in got._fields:
            np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), rtol=1e-6)
        np.testing.assert_array_equal(np.isneginf(np.asarray(got.lse)), labels[:, 1:] == -100)
        for a, b in zip(grads, grads0):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)

    def one(skip):
        def f(h, w, y):
            return linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=3, skip_ignored_rows=skip)

        return jax.jit(jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(0, None, 0)))(hidden, weight, y)

    for a, b in zip(jax.tree.leaves(one(True)), jax.tree.leaves(one(False))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_skip_ignored_rows_second_order(put):
    """Grad of grad and a Hessian-vector product through the skipping loop (its gather, scatter and cond) equal the
    reference backend's."""
    hidden, weight, bias, labels = make_inputs(put, 12, 8, 30, seed=32, n_ignored=7)
    y = put(labels, jnp.int32)
    directions = tuple(put(np.random.default_rng(33).standard_normal(t.shape), jnp.float32) for t in (hidden, weight))

    def second_order(backend):
        def loss(h, w):
            kw = dict(backend=backend, z_loss=1e-3, reduction="sum")
            if backend == "kernel":
                kw.update(chunk_rows=2, skip_ignored_rows=True)
            return linear_cross_entropy(h, w, y, bias=bias, **kw)

        grad = jax.grad(loss, argnums=(0, 1))
        penalty = jax.grad(lambda h, w: jnp.sum(grad(h, w)[0] ** 2), argnums=(0, 1))(hidden, weight)
        return (*penalty, *jax.jvp(grad, (hidden, weight), directions)[1])

    for got, want in zip(second_order("kernel"), second_order("reference")):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5 * scale)


def test_skip_ignored_rows_must_be_a_bool(put):
    hidden, weight, _, labels = make_inputs(put, 8, 16, 50, seed=34)
    with pytest.raises(TypeError, match="skip_ignored_rows must be a bool"):
        linear_cross_entropy(hidden, weight, labels, backend="kernel", skip_ignored_rows=1)


def test_skip_ignored_rows_sharded(use_gpu):
    """Rows sharded over 4 devices (data parallel) under jit: the same loss and gradients as without the keyword."""
    devices = jax.devices("gpu" if use_gpu else "cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 devices (run through test_sharding.py::test_sharded_suite_on_4_cpu_devices)")
    mesh = Mesh(np.array(devices[:4]), ("d",))
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), devices[0])  # noqa: E731
    hidden, weight, _, labels = make_inputs(put, 32, 16, 50, seed=35, n_ignored=0)
    labels[:20] = -100
    hidden = jax.device_put(hidden, NamedSharding(mesh, P("d", None)))
    weight = jax.device_put(weight, NamedSharding(mesh, P()))
    y = jax.device_put(jnp.asarray(labels, jnp.int32), NamedSharding(mesh, P("d")))

    def run(skip):
        def f(h, w):
            return linear_cross_entropy(h, w, y, backend="kernel", chunk_rows=8, skip_ignored_rows=skip)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, weight)

    for a, b in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_skip_ignored_rows_compiled_memory():
    """The skipping loop's scratch is the default loop's plus O(N) (the row order): its cond and scatters keep the
    gradient carries in place, no extra copy of d weight (V x H) or d hidden (N x H)."""
    dim, vocab = 64, 4096
    for n in (512, 2048):
        default = compiled_temp_bytes(n, dim, vocab, jnp.float32, chunk_rows=64)
        skipping = compiled_temp_bytes(n, dim, vocab, jnp.float32, chunk_rows=64, skip_ignored_rows=True)
        assert skipping - default <= 8 * n, (n, default, skipping)


@pytest.mark.gpu
@pytest.mark.parametrize("n, dim, vocab", [(8192, 4096, 128256), (32768, 4096, 128256)])
def test_gpu_skip_ignored_rows_compiled_memory(capsys, n, dim, vocab):
    default = compiled_temp_bytes(n, dim, vocab, jnp.bfloat16)
    skipping = compiled_temp_bytes(n, dim, vocab, jnp.bfloat16, skip_ignored_rows=True)
    with capsys.disabled():
        print(f"\n[fastce_jax linear skip] {n}x{dim}x{vocab}: temp {skipping / 2**20:.0f} MiB ({default / 2**20:.0f})")
    assert skipping - default <= 16 * n + (1 << 20)


def test_class_weight_rows_sharded(use_gpu):
    """With several devices the chunk loop is partitioned, which has no rule for class weights: a weighted call must
    still weigh (it runs the loop unpartitioned), rows sharded or not."""
    devices = jax.devices("gpu" if use_gpu else "cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 devices (run through test_sharding.py::test_sharded_suite_on_4_cpu_devices)")
    mesh = Mesh(np.array(devices[:4]), ("d",))
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), devices[0])  # noqa: E731
    hidden, weight, _, labels = make_inputs(put, 32, 16, 50, seed=36)
    class_weight = jnp.asarray(np.random.default_rng(37).uniform(0.2, 3.0, 50), jnp.float32)
    y = jnp.asarray(labels, jnp.int32)
    expected = fastce_jax.cross_entropy(
        jnp.asarray(hidden, jnp.float32) @ jnp.asarray(weight, jnp.float32).T, y, weight=class_weight,
        backend="reference",
    )  # fmt: skip
    sharded = jax.device_put(hidden, NamedSharding(mesh, P("d", None)))
    for h in (hidden, sharded):
        with jax.default_matmul_precision("float32"):
            got = jax.jit(lambda a: linear_cross_entropy(a, weight, y, class_weight=class_weight, backend="kernel"))(h)
        np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)
