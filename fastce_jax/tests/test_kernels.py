"""fastce_jax kernels (backend="kernel") against the repository's float64 reference (shared_tests/reference.py)
and its tolerance model (shared_tests/tolerances.py).

On CPU the Pallas kernels run in interpret mode; with --gpu the same tests run
the compiled Triton kernels on JAX GPU arrays.  Inputs are fresh random normals
(never zeros); NaN never passes a comparison unless it is the expected value.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import cross_entropy, cross_entropy_reference
from fastce_jax.core.options import Options
from fastce_jax.losses.cross_entropy import launch

from .checks import OPTION_SETS, as_float64, assert_grad, assert_loss, expected

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_inputs(put, n, v, dtype, seed, ignore_index=-100, n_ignored=2, scale=2.0):
    rng = np.random.default_rng(seed)
    x = put(rng.standard_normal((n, v)) * scale, DTYPES[dtype])
    y = rng.integers(0, v, n)
    y[rng.permutation(n)[:n_ignored]] = ignore_index
    return x, y


def check_vjp(put, x, y, dtype, opts, seed=0, **ce_kwargs):
    """reduction="none" with a random per-token cotangent: loss and grad."""
    labels = put(y, jnp.int32)
    w = np.random.default_rng(seed + 1).uniform(0.5, 2.0, y.shape)

    def f(logits):
        return cross_entropy(logits, labels, reduction="none", backend="kernel", **opts, **ce_kwargs)

    loss, vjp = jax.vjp(f, x)
    (g,) = vjp(put(w, jnp.float32))
    assert loss.dtype == jnp.float32 and g.dtype == x.dtype
    ref = expected(x, y, upstream=w, **opts)
    assert_loss(loss, ref)
    assert_grad(g, ref)
    return loss, g


# Every option set in float32, the half dtypes with none and all of them: each option alone in every dtype is the
# shared table's (shared_tests/cases.py, both packages' kernels against the float64 reference).
OPTIONS_AND_DTYPES = [(name, "float32") for name in OPTION_SETS] + [
    (name, dtype) for name in ("plain", "all") for dtype in DTYPES if dtype != "float32"
]


@pytest.mark.parametrize("option_set, dtype", OPTIONS_AND_DTYPES)
def test_options_and_dtypes(put, dtype, option_set):
    opts = OPTION_SETS[option_set]
    x, y = make_inputs(
        put, 8, 1000, dtype, seed=list(OPTION_SETS).index(option_set), ignore_index=opts.get("ignore_index", -100)
    )
    if option_set == "ignore5":
        y[3] = 5
    check_vjp(put, x, y, dtype, opts)


@pytest.mark.parametrize(
    "v,dtype",
    [
        (32000, "bfloat16"),
        (50257, "float32"),
        (70000, "float16"),
        # More chunks of the layouts above (the interpreter's time grows with N * V): with --gpu.
        pytest.param(128256, "bfloat16", marks=pytest.mark.gpu),
        pytest.param(256000, "bfloat16", marks=pytest.mark.gpu),
        (262147, "float32"),
    ],
)
def test_vocab_sizes(put, v, dtype):
    opts = dict(label_smoothing=0.1, z_loss=1e-4)
    x, y = make_inputs(put, 2, v, dtype, seed=v, n_ignored=0)
    y[1] = v - 1  # the very last column, in the last (partial) tile
    check_vjp(put, x, y, dtype, opts)


@pytest.mark.parametrize("width", [65536, 32768])
def test_wide_chunks(put, width):
    # Wider chunks than the default, passed to the launchers as a config: 16 tiles, 5 chunks and a 3-column last
    # chunk (65536), or 9 chunks (32768).
    v = 262147
    config = launch.forward_config(v)._replace(chunk=width, n_chunks=-(-v // width))
    x, y = make_inputs(put, 2, v, "bfloat16", seed=width, n_ignored=0)
    y[0] = v - 2
    opts = dict(label_smoothing=0.05)
    options, labels = Options(**opts), put(y, jnp.int32)
    interpret = all(d.platform != "gpu" for d in x.devices())
    w = np.random.default_rng(1).uniform(0.5, 2.0, y.shape)
    loss, lse = launch.forward(x, labels, options, interpret=interpret, config=config)
    g = launch.backward(x, labels, lse, put(w, jnp.float32), options, inplace=False, interpret=interpret)
    ref = expected(x, y, upstream=w, **opts)
    assert_loss(loss, ref)
    assert_grad(g, ref)


@pytest.mark.parametrize("v", [1, 2, 7, 4097])
def test_small_and_odd_vocab(put, v):
    x, y = make_inputs(put, 3, v, "float32", seed=v, n_ignored=1)
    check_vjp(put, x, y, "float32", dict(label_smoothing=0.1, z_loss=1e-3))


@pytest.mark.parametrize("reduction,n_items", [("mean", None), ("sum", None), ("mean", 7), ("mean", 2.5)])
def test_reductions(put, reduction, n_items):
    x, y = make_inputs(put, 12, 1000, "float32", seed=3, n_ignored=4)
    labels = put(y, jnp.int32)
    loss, g = jax.value_and_grad(
        lambda a: cross_entropy(a, labels, reduction=reduction, n_items=n_items, backend="kernel")
    )(x)
    ref = expected(x, y, reduction=reduction, n_items=n_items)
    assert_loss(loss, ref)
    assert_grad(g, ref)


def test_traced_n_items_under_jit(put):
    x, y = make_inputs(put, 10, 1000, "bfloat16", seed=4)
    labels = put(y, jnp.int32)

    @jax.jit
    def step(logits, n):
        return jax.value_and_grad(lambda a: cross_entropy(a, labels, n_items=n, backend="kernel"))(logits)

    for n in (3, 11):
        loss, g = step(x, put(np.int32(n)))
        ref = expected(x, y, reduction="mean", n_items=n)
        assert_loss(loss, ref)
        assert_grad(g, ref)


def test_all_ignored(put):
    x, y = make_inputs(put, 4, 1000, "bfloat16", seed=5, n_ignored=4)
    x = x.at[1, 7].set(jnp.nan)  # an ignored row's NaN must not leak
    labels = put(y, jnp.int32)
    for reduction in ("mean", "sum"):
        loss, g = jax.value_and_grad(lambda a: cross_entropy(a, labels, reduction=reduction, backend="kernel"))(x)
        assert float(loss) == 0.0
        assert not np.any(np.asarray(g, np.float32))  # exactly zero, no NaN


def test_3d_input(put):
    rng = np.random.default_rng(6)
    x = put(rng.standard_normal((2, 3, 1000)), jnp.bfloat16)
    y = rng.integers(0, 1000, (2, 3))
    y[1, 2] = -100
    labels = put(y, jnp.int32)
    none = cross_entropy(x, labels, reduction="none", backend="kernel")
    assert none.shape == (2, 3)
    loss, g = jax.value_and_grad(lambda a: cross_entropy(a, labels, backend="kernel"))(x)
    assert g.shape == x.shape and g.dtype == jnp.bfloat16
    assert_loss(none, expected(x, y), what="none")
    ref = expected(x, y, reduction="mean")
    assert_loss(loss, ref, what="mean")
    assert_grad(g, ref)


def test_vmap(put):
    rng = np.random.default_rng(7)
    x = put(rng.standard_normal((3, 4, 500)), jnp.float32)
    y = rng.integers(0, 500, (3, 4))
    y[0, 1] = -100
    labels = put(y, jnp.int32)
    f = lambda a, b: cross_entropy(a, b, label_smoothing=0.1, backend="kernel")
    loss, g = jax.vmap(jax.value_and_grad(f))(x, labels)
    for b in range(3):
        ref = expected(x[b], y[b], reduction="mean", label_smoothing=0.1)
        assert_loss(loss[b], ref)
        assert_grad(g[b], ref)
    # vmap inside jit(grad) too: the same kernels on the same values, so the same bits
    g2 = jax.jit(jax.grad(lambda a: jax.vmap(f)(a, labels).sum()))(x)
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grad_under_jit(put, dtype):
    x, y = make_inputs(put, 6, 3000, dtype, seed=8)
    labels = put(y, jnp.int32)
    opts = dict(logit_softcapping=10.0, z_loss=1e-3)
    step = jax.jit(jax.value_and_grad(lambda a: cross_entropy(a, labels, backend="kernel", **opts)))
    loss, g = step(x)
    assert loss.dtype == jnp.float32 and g.dtype == x.dtype
    ref = expected(x, y, reduction="mean", **opts)
    assert_loss(loss, ref)
    assert_grad(g, ref)


@pytest.mark.parametrize("label_dtype", ["int32", "int64", "int16"])
def test_label_dtypes(put, label_dtype):
    with jax.enable_x64(label_dtype == "int64"):
        x, y = make_inputs(put, 5, 1000, "float32", seed=9)
        if label_dtype == "int64":
            y = y.astype(np.int64)
            y[2] = 2**32 + 1  # must not wrap to 1: out of range -> NaN
        labels = jax.device_put(y.astype(label_dtype), x.devices().pop())
        assert labels.dtype == np.dtype(label_dtype)
        loss = cross_entropy(x, labels, reduction="none", backend="kernel")
        assert_loss(loss, expected(x, y))
        if label_dtype == "int64":
            assert np.isnan(np.asarray(loss)[2])


def test_out_of_range_labels(put):
    x, y = make_inputs(put, 6, 1000, "float32", seed=10, n_ignored=1)
    y[1], y[3], y[4] = 1000, -1, 10**6
    loss, g = check_vjp(put, x, y, "float32", {})
    loss, g = np.asarray(loss), np.asarray(g)
    bad = np.zeros(6, bool)
    bad[[1, 3, 4]] = True
    assert np.isnan(loss[bad]).all() and np.isfinite(loss[~bad]).all()
    assert np.isnan(g[bad]).all() and np.isfinite(g[~bad]).all()
    mean = cross_entropy(x, put(y, jnp.int32), backend="kernel")
    assert np.isnan(float(mean))


@pytest.mark.parametrize("option_set", ["plain", "z_loss", "softcap", "scaling", "smoothing"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_neg_inf_logits(put, option_set, dtype):
    rng = np.random.default_rng(11)
    v = 5000
    x = rng.standard_normal((3, v))
    x[0, :4096] = -np.inf  # a whole leading chunk/tile of -inf
    x[1, rng.random(v) < 0.3] = -np.inf
    x[2, 3000:] = -np.inf  # vocabulary padding
    y = np.array([4500, int(np.flatnonzero(np.isfinite(x[1]))[0]), 17])
    x = put(x, DTYPES[dtype])
    opts = OPTION_SETS[option_set]
    loss, g = check_vjp(put, x, y, dtype, opts)
    loss, g = np.asarray(loss), np.asarray(g, np.float32)
    if option_set == "smoothing":  # the mean of z is -inf: the true loss is inf
        assert np.all(loss == np.inf)
    else:
        assert np.isfinite(loss).all()
        assert np.all(g[~np.isfinite(as_float64(x))] == 0.0)


def test_nonfinite_rows_isolated(put):
    x, y = make_inputs(put, 6, 2000, "float32", seed=12, n_ignored=0)
    y[5] = -100
    x = x.at[1, 1500].set(jnp.nan).at[3, 10].set(jnp.inf).at[5, 3].set(jnp.nan)
    loss, g = check_vjp(put, x, y, "float32", {})
    loss, g = np.asarray(loss), np.asarray(g)
    bad = np.array([False, True, False, True, False, False])
    assert np.isnan(loss[bad]).all() and np.isfinite(loss[~bad]).all()
    assert np.isnan(g[bad]).all() and np.isfinite(g[~bad]).all()
    assert loss[5] == 0.0 and not g[5].any()  # ignored NaN row: 0, zero grad


def test_inplace_backward_off_matches(put):
    x, y = make_inputs(put, 4, 1000, "bfloat16", seed=13)
    before = np.asarray(x, np.float32).copy()
    labels = put(y, jnp.int32)
    grads = [
        jax.grad(lambda a: cross_entropy(a, labels, backend="kernel", inplace_backward=flag))(x)
        for flag in (True, False)
    ]
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32), np.asarray(grads[1], np.float32))
    # The caller's logits are never modified (XLA copies a live input).
    np.testing.assert_array_equal(np.asarray(x, np.float32), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_backend(put, dtype):
    opts = OPTION_SETS["all"]
    x, y = make_inputs(put, 8, 1000, dtype, seed=14)
    y[2] = 1000  # out of range: NaN loss and a NaN gradient row
    labels = put(y, jnp.int32)
    w = put(np.random.default_rng(0).uniform(0.5, 2, 8), jnp.float32)
    for fn in (cross_entropy_reference, lambda *a, **k: cross_entropy(*a, backend="reference", **k)):
        loss, vjp = jax.vjp(lambda a: fn(a, labels, reduction="none", **opts), x)
        (g,) = vjp(w)
        ref = expected(x, y, upstream=w, **opts)
        assert_loss(loss, ref)
        assert_grad(g, ref)


def test_auto_backend(put, use_gpu):
    x, y = make_inputs(put, 2, 100, "float32", seed=15)
    labels = put(y, jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda a: cross_entropy(a, labels))(x))
    assert ("pallas_call" in jaxpr) == use_gpu
    jaxpr = str(jax.make_jaxpr(lambda a: cross_entropy(a, labels, backend="kernel"))(x))
    assert "pallas_call" in jaxpr
    jaxpr = str(jax.make_jaxpr(lambda a: cross_entropy(a, labels, backend="reference"))(x))
    assert "pallas_call" not in jaxpr


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis is in the test extra; keep the rest running
    given = None

if given is not None:

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(
        v=st.sampled_from([3, 100, 1000, 4100]),
        dtype=st.sampled_from(list(DTYPES)),
        smoothing=st.sampled_from([0.0, 0.3, 1.0]),
        z_loss=st.sampled_from([0.0, 1e-2]),
        softcap=st.sampled_from([0.0, 2.5]),
        scaling=st.sampled_from([0.0, -0.7, 2.0]),
        seed=st.integers(0, 2**16),
    )
    def test_random_option_combinations(device, v, dtype, smoothing, z_loss, softcap, scaling, seed):
        # `device` is session-scoped, which @given accepts.
        def put(a, d=None):
            return jax.device_put(np.asarray(a) if d is None else jnp.asarray(a, d), device)

        opts = dict(label_smoothing=smoothing, z_loss=z_loss, logit_softcapping=softcap, logit_scaling=scaling)
        x, y = make_inputs(put, 4, v, dtype, seed=seed, n_ignored=1)
        check_vjp(put, x, y, dtype, opts, seed=seed)
