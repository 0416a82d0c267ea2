"""The extra outputs (return_z_loss, return_lse, return_accuracy, return_entropy -> CrossEntropyOutput) of
fastce_jax.cross_entropy and linear_cross_entropy against the float64 reference, shared_tests/reference.py::outputs.

On CPU backend="kernel" runs the Pallas kernels in interpret mode; the forward kernel's tiles are made small
(fastce_jax.losses.cross_entropy.launch's CHUNK / FORWARD_BLOCK, read when a call is made) so that a row spans several
chunks of several tiles and the argmax / entropy partials are combined across both. The sharded tests re-run this module
in a subprocess with 4 CPU devices, as test_sharding.py does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastce_jax import CrossEntropyOutput, cross_entropy, linear_cross_entropy
from fastce_jax.losses.cross_entropy import launch
from shared_tests import reference, tolerances

from .checks import OPTION_SETS, as_float64
from .test_sharding import collectives

RTOL, FLOOR = tolerances.RTOL, tolerances.FLOOR
FIELDS = ("z_loss", "lse", "accuracy", "entropy")
ALL_RETURNS = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)
N_ROWS, VOCAB = 8, 300  # with the small tiles below: 3 chunks of 2 tiles, the last one partial


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(launch, "CHUNK", 128)
    monkeypatch.setattr(launch, "FORWARD_BLOCK", 64)
    assert launch.forward_config(VOCAB).n_chunks == 3


# ----------------------------------------------------------------------------------------------------------------
# Inputs and the comparison with the float64 reference.
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(seed, n=N_ROWS, v=VOCAB, *, ignore_index=-100, dtype=jnp.float32, pad=True, ties=True):
    """Random logits (never zeros) with ignored rows, rows whose label is their argmax (so accuracy is not all 0),
    -inf padding and exact ties (in different chunks and in one tile), and their labels (int32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, v)) * 2.0
    y = rng.integers(0, v, n)
    hits = rng.permutation(n)[: n // 2]
    y[hits] = np.argmax(x[hits], axis=-1)
    if ties:
        x[1, [10, 260]] = x[1].max() + 1.0  # a tie across chunks: argmax is 10
        y[1] = 10
        x[2, [70, 71]] = x[2].max() + 1.0  # a tie inside one tile, and the label on the second: a miss
        y[2] = 71
    if pad:
        x[3, v - 40 :] = -np.inf  # padded vocabulary
        x[4, :130] = -np.inf  # a whole chunk at -inf
        y[3], y[4] = np.argmax(x[3]), 200  # labels on finite logits
    y[[0, 5]] = ignore_index
    x = np.asarray(jnp.asarray(x.astype(np.float32), dtype).astype(jnp.float32))  # the values the kernels read
    return jnp.asarray(x, dtype), y.astype(np.int32)


def scales(x, y, opts):
    """Per-token magnitudes bounding the float32 error of (lse, z_loss, entropy): M_t = 1 + |lse| + max |z| (+
    softcap), as in reference.error_scales; z_loss's error is 2 |z_loss| |lse| times lse's (plus its own rounding);
    entropy = lse - sum_j p_j z_j, whose sum carries p's relative error eps * M_t times max |z|."""
    o = reference.Options(**opts)
    z = reference.transform(np.where((y == o.ignore_index)[:, None], 0.0, x.reshape(len(y), -1)), o)
    with np.errstate(invalid="ignore"):
        lse = reference.logsumexp_rows(z)
    finite_lse = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    zmax = np.where(np.isfinite(z), np.abs(z), 0.0).max(axis=-1)
    m = 1.0 + finite_lse + zmax + o.logit_softcapping
    return dict(lse=m, z_loss=abs(o.z_loss) * finite_lse * (2.0 * m + finite_lse), entropy=m * (1.0 + zmax))


def assert_outputs(out, x, y, opts, reduction="mean", n_items=None, asked=FIELDS, extra_scale=0.0):
    """Each asked-for output of ``out`` against reference.outputs on exactly the logits x (..., V) the kernels
    read; the others must be None. extra_scale: an absolute error per token to allow on top (linear's matmul)."""
    assert isinstance(out, CrossEntropyOutput), type(out)
    x64, y1 = as_float64(x).reshape(-1, x.shape[-1]), np.asarray(y).reshape(-1)
    ref = reference.outputs(x64, y1, reduction=reduction, n_items=n_items, opts=reference.Options(**opts))
    scale = scales(x64, y1, opts)
    den = reference.denominator(y1, reduction, n_items, opts.get("ignore_index", -100))
    for name in FIELDS:
        value = getattr(out, name)
        if name not in asked:
            assert value is None, name
            continue
        assert value.dtype == jnp.float32, (name, value.dtype)
        actual = np.asarray(value, np.float64)
        expected = np.asarray(getattr(ref, name)).reshape(-1) if name == "lse" else getattr(ref, name)
        if name == "accuracy":
            if reduction == "none":
                tolerances.check(actual.reshape(-1), expected.reshape(-1), 0.0, name)  # exactly 1, 0 or NaN
            else:
                tolerances.check(actual, expected, 2 * tolerances.EPS32 * abs(expected) + FLOOR, name)
            continue
        per_token = RTOL * scale[name] + extra_scale * (1.0 if name == "lse" else scale["lse"]) + FLOOR
        if name == "lse" or reduction == "none":
            tolerances.check(actual.reshape(-1), expected.reshape(-1), per_token, name)
        else:
            finite = np.where(np.isfinite(expected), np.abs(expected), 0.0)
            bound = np.sum(per_token) / den + RTOL * finite + FLOOR
            tolerances.check(actual, expected, bound, name)
    lse_shape = tuple(np.shape(y))
    if out.lse is not None:
        assert out.lse.shape == lse_shape
    if reduction == "none":
        for name in ("z_loss", "accuracy", "entropy"):
            if getattr(out, name) is not None:
                assert getattr(out, name).shape == lse_shape, name
    return ref


# ----------------------------------------------------------------------------------------------------------------
# cross_entropy.
# ----------------------------------------------------------------------------------------------------------------


# The jnp reference backend: every option with "none" and "mean"; "sum" and n_items with the plain and all-option
# sets. The kernels (here in several vocabulary chunks): the plain and all-option sets with each reduction; each
# option alone in one chunk is shared_tests/test_outputs.py's (both packages).
REDUCTIONS = ("none", "mean", "sum", "n_items")
CASES = [(n, r, "reference") for n in OPTION_SETS for r in ("none", "mean")] + [
    (n, r, "reference") for n in ("plain", "all") for r in ("sum", "n_items")
]
CASES += [(n, r, "kernel") for n in ("plain", "all") for r in REDUCTIONS]


@pytest.mark.parametrize(("name", "reduction", "backend"), CASES)
def test_outputs_match_reference(small_tiles, name, reduction, backend):
    opts = OPTION_SETS[name]
    x, y = make_inputs(seed=len(name) + len(reduction), ignore_index=opts.get("ignore_index", -100))
    n_items = 11.0 if reduction == "n_items" else None
    reduction = "mean" if reduction == "n_items" else reduction
    out = cross_entropy(x, y, reduction=reduction, n_items=n_items, backend=backend, **opts, **ALL_RETURNS)
    ref = assert_outputs(out, x, y, opts, reduction, n_items)
    plain = cross_entropy(x, y, reduction=reduction, n_items=n_items, backend=backend, **opts)
    np.testing.assert_allclose(np.asarray(out.loss), np.asarray(plain), rtol=1e-6)  # the loss as without them
    if reduction != "none":
        assert 0.0 < float(out.accuracy) < 1.0 and np.isfinite(ref.entropy)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_logits(small_tiles, dtype):
    opts = OPTION_SETS["all"]
    x, y = make_inputs(seed=3, dtype=dtype)
    assert_outputs(cross_entropy(x, y, backend="kernel", reduction="none", **opts, **ALL_RETURNS), x, y, opts, "none")


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("asked", [("z_loss",), ("lse",), ("accuracy",), ("entropy",), ("accuracy", "entropy")])
def test_each_output_alone(small_tiles, backend, asked):
    x, y = make_inputs(seed=4)
    out = cross_entropy(x, y, backend=backend, z_loss=1e-2, **{f"return_{a}": True for a in asked})
    assert_outputs(out, x, y, dict(z_loss=1e-2), asked=asked)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_bad_labels_and_nan_rows(small_tiles, backend):
    """An out-of-range label: NaN z_loss and accuracy, finite lse and entropy; a row holding NaN or +inf: NaN in
    all four; the other rows unaffected ("none"), and a reduced z_loss / accuracy NaN ("mean")."""
    x, y = make_inputs(seed=5)
    x = np.array(x)
    y[6], y[7] = VOCAB + 3, -7
    x[3, 17] = np.nan
    x[4, 200] = np.inf
    y[3], y[4] = 1, 2
    for reduction in ("none", "mean"):
        out = cross_entropy(jnp.asarray(x), y, backend=backend, reduction=reduction, z_loss=1e-2, **ALL_RETURNS)
        ref = assert_outputs(out, x, y, dict(z_loss=1e-2), reduction)
        if reduction == "none":
            assert np.isnan(ref.z_loss[[3, 4, 6, 7]]).all() and np.isfinite(ref.entropy[[6, 7]]).all()
            assert np.isnan(ref.entropy[[3, 4]]).all() and np.isnan(ref.accuracy[[3, 4, 6, 7]]).all()


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_all_ignored(small_tiles, backend, reduction):
    x, _ = make_inputs(seed=6)
    y = np.full(N_ROWS, -100, np.int32)
    out = cross_entropy(x, y, backend=backend, reduction=reduction, z_loss=1e-2, **ALL_RETURNS)
    assert_outputs(out, x, y, dict(z_loss=1e-2), reduction)
    assert np.all(np.asarray(out.lse) == -np.inf)
    for name in ("loss", "z_loss", "accuracy", "entropy"):
        assert np.all(np.asarray(getattr(out, name)) == 0.0), name


def test_default_returns_the_array(small_tiles):
    x, y = make_inputs(seed=7)
    loss = cross_entropy(x, y, backend="kernel")
    assert isinstance(loss, jax.Array) and loss.shape == ()
    flags = dict(return_z_loss=False, return_lse=False, return_accuracy=False, return_entropy=False)
    assert isinstance(cross_entropy(x, y, backend="kernel", **flags), jax.Array)


@pytest.mark.parametrize("bad", [1, 0, None, "yes", np.float32(1.0)])
@pytest.mark.parametrize("keyword", [f"return_{f}" for f in FIELDS])
def test_return_keywords_must_be_bools(keyword, bad):
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 10)), jnp.float32)
    y = np.array([1, 2], np.int32)
    for fn, args in ((cross_entropy, (x, y)), (linear_cross_entropy, (x, jnp.ones((3, 10)), y))):
        with pytest.raises(TypeError, match=keyword):
            fn(*args, **{keyword: bad})


def test_shift_keeps_the_scored_positions(small_tiles):
    x, y = make_inputs(seed=9)
    x3, y3 = x.reshape(2, 4, VOCAB), y.reshape(2, 4)
    for reduction in ("none", "mean"):
        out = cross_entropy(x3, y3, shift=1, backend="kernel", reduction=reduction, **ALL_RETURNS)
        assert_outputs(out, x3[:, :-1], y3[:, 1:], {}, reduction)


# ----------------------------------------------------------------------------------------------------------------
# Gradients, jit, vmap.
# ----------------------------------------------------------------------------------------------------------------


def z_loss_share_of_grad(x, y, opts, reduction, upstream=None):
    """(float64 d loss / dx, float64 d z_loss_output / dx, the reference Result): the z-loss output's gradient is
    the z-loss part of the loss's."""
    with_z = reference.expected(as_float64(x), y, reduction, upstream=upstream, **opts)
    without = reference.expected(as_float64(x), y, reduction, upstream=upstream, **dict(opts, z_loss=0.0))
    return with_z.grad, with_z.grad - without.grad, with_z


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", ["z_loss", "all"])
def test_z_loss_gradient(small_tiles, name, reduction, backend):
    opts = OPTION_SETS[name]
    x, y = make_inputs(seed=10)
    rng = np.random.default_rng(11)
    w_loss = rng.uniform(0.5, 2.0, y.shape).astype(np.float32) if reduction == "none" else np.float32(1.3)
    w_z = rng.uniform(0.5, 2.0, y.shape).astype(np.float32) if reduction == "none" else np.float32(-2.5)

    def f(a):
        out = cross_entropy(a, y, backend=backend, reduction=reduction, **opts, **ALL_RETURNS)
        return jnp.sum(out.loss * w_loss) + jnp.sum(out.z_loss * w_z)

    grad = jax.grad(f)(x)
    up_loss = None if reduction != "none" else w_loss
    g_loss, _, ref = z_loss_share_of_grad(x, y, opts, reduction, up_loss)
    up_z = None if reduction != "none" else w_z
    _, g_z, _ = z_loss_share_of_grad(x, y, opts, reduction, up_z)
    scalar = (lambda w: 1.0) if reduction == "none" else float
    expected = g_loss * scalar(w_loss) + g_z * scalar(w_z)
    bound = tolerances.grad_bound(ref, as_float64(grad), grad.dtype) * (1.0 + np.max(np.abs(w_z)))
    tolerances.check(as_float64(grad), expected, bound, "grad")
    assert np.abs(g_z).max() > 1e-4 * np.abs(g_loss).max()  # the z-loss share is really there


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_lse_and_accuracy_carry_no_gradient(small_tiles, backend):
    """lse and accuracy carry no gradient; the entropy does (issue 37: tests/test_rl.py checks it)."""
    x, y = make_inputs(seed=12)

    def f(a):
        out = cross_entropy(a, y, backend=backend, reduction="none", z_loss=1e-2, **ALL_RETURNS)
        lse = jnp.where(jnp.isfinite(out.lse), out.lse, 0.0)
        return jnp.sum(lse) + jnp.sum(out.accuracy)

    grad = jax.grad(f)(x)
    assert np.all(np.asarray(grad) == 0.0)


def test_jit_vmap_and_eager_agree(small_tiles):
    x, y = make_inputs(seed=13)
    xb, yb = x.reshape(2, 4, VOCAB), y.reshape(2, 4)

    def f(a, b):
        return cross_entropy(a, b, backend="kernel", reduction="mean", z_loss=1e-2, **ALL_RETURNS)

    eager = [f(xb[i], yb[i]) for i in range(2)]
    jitted = jax.jit(f)(xb[0], yb[0])
    batched = jax.vmap(f)(xb, yb)
    for name in CrossEntropyOutput._fields:
        np.testing.assert_array_equal(np.asarray(getattr(jitted, name)), np.asarray(getattr(eager[0], name)))
        np.testing.assert_allclose(
            np.asarray(getattr(batched, name)), np.stack([np.asarray(getattr(e, name)) for e in eager]), rtol=1e-6
        )
    # grad under vmap: the z_loss output's gradient per example
    grads = jax.vmap(jax.grad(lambda a, b: f(a, b).z_loss))(xb, yb)
    for i in range(2):
        np.testing.assert_allclose(grads[i], jax.grad(lambda a: f(a, yb[i]).z_loss)(xb[i]), rtol=1e-5, atol=1e-9)


def test_eager_cache_keys_include_the_flags(small_tiles):
    x, y = make_inputs(seed=14)
    a = cross_entropy(x, y, backend="kernel", return_accuracy=True)
    b = cross_entropy(x, y, backend="kernel", return_entropy=True)
    c = cross_entropy(x, y, backend="kernel")
    assert a.entropy is None and a.accuracy is not None and b.accuracy is None and b.entropy is not None
    assert isinstance(c, jax.Array)


# ----------------------------------------------------------------------------------------------------------------
# linear_cross_entropy: several chunks of rows (chunk_rows=), the outputs collected per chunk.
# ----------------------------------------------------------------------------------------------------------------


def linear_inputs(seed, n=10, h=16, v=VOCAB, ignore_index=-100):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    weight = (rng.standard_normal((v, h)) * (2.0 / np.sqrt(h))).astype(np.float32)
    logits = hidden.astype(np.float64) @ weight.T.astype(np.float64)
    y = rng.integers(0, v, n)
    y[: n // 2] = np.argmax(logits[: n // 2], axis=-1)
    y[[1, 6]] = ignore_index
    return jnp.asarray(hidden), jnp.asarray(weight), y.astype(np.int32), logits


@pytest.fixture
def float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


# Each option alone on the reference backend; the kernels with the plain and all-option sets, every reduction.
LINEAR_CASES = [(n, "mean", "reference") for n in ("smoothing", "softcap", "scaling", "ignore5")] + [
    (n, r, backend) for n in ("plain", "all") for r in REDUCTIONS for backend in ("kernel", "reference")
]


@pytest.mark.parametrize(("name", "reduction", "backend"), LINEAR_CASES)
def test_linear_outputs_match_reference(small_tiles, float32_matmuls, name, reduction, backend):
    opts = OPTION_SETS[name]
    hidden, weight, y, logits = linear_inputs(seed=20 + len(name), ignore_index=opts.get("ignore_index", -100))
    n_items = 7 if reduction == "n_items" else None
    reduction = "mean" if reduction == "n_items" else reduction
    kw = dict(reduction=reduction, n_items=n_items, backend=backend, chunk_rows=3, **opts)
    out = linear_cross_entropy(hidden, weight, y, **kw, **ALL_RETURNS)
    # The float32 matmul's error on the logits (|h| |w| eps32 per product) reaches lse and entropy directly.
    matmul = 8 * tolerances.EPS32 * (np.abs(as_float64(hidden)) @ np.abs(as_float64(weight)).T).max(axis=-1)
    assert_outputs(out, logits, y, opts, reduction, n_items, extra_scale=matmul)
    np.testing.assert_allclose(
        np.asarray(out.loss), np.asarray(linear_cross_entropy(hidden, weight, y, **kw)), rtol=1e-6
    )


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_z_loss_gradient(small_tiles, float32_matmuls, reduction):
    """The z_loss output's gradient through the chunks (mean: the backward's recomputing pass), against
    cross_entropy's on the same logits (whose gradient test_z_loss_gradient checks against float64)."""
    hidden, weight, y, _ = linear_inputs(seed=30)
    opts = dict(z_loss=1e-2, label_smoothing=0.1)
    w = np.linspace(0.5, 2.0, len(y)).astype(np.float32) if reduction == "none" else np.float32(1.0)

    def lin(hd, wt, z_weight):
        out = linear_cross_entropy(
            hd, wt, y, reduction=reduction, backend="kernel", chunk_rows=3, **opts, **ALL_RETURNS
        )
        return jnp.sum(out.loss * w) + z_weight * jnp.sum(out.z_loss * w)

    def plain(hd, wt, z_weight):
        out = cross_entropy(hd @ wt.T, y, reduction=reduction, backend="reference", **opts, **ALL_RETURNS)
        return jnp.sum(out.loss * w) + z_weight * jnp.sum(out.z_loss * w)

    for z_weight in (0.0, 3.0):  # 0: the reduced path skips the recomputing pass
        got = jax.grad(lin, (0, 1))(hidden, weight, z_weight)
        want = jax.grad(plain, (0, 1))(hidden, weight, z_weight)
        for g, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-4, atol=2e-6)
    z_only = jax.grad(lambda hd: lin(hd, weight, 1.0) - lin(hd, weight, 0.0))(hidden)
    assert np.abs(np.asarray(z_only)).max() > 1e-4


def test_linear_lse_and_accuracy_carry_no_gradient(small_tiles):
    """lse and accuracy carry no gradient; the entropy does (issue 37: tests/test_linear_rl.py checks it)."""
    hidden, weight, y, _ = linear_inputs(seed=31)

    def f(hd, wt):
        out = linear_cross_entropy(hd, wt, y, reduction="sum", backend="kernel", chunk_rows=4, **ALL_RETURNS)
        return jnp.sum(jnp.where(jnp.isfinite(out.lse), out.lse, 0.0)) + out.accuracy

    for g in jax.grad(f, (0, 1))(hidden, weight):
        assert np.all(np.asarray(g) == 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Sharded logits (custom_partitioning): rows, vocabulary, both.
# ----------------------------------------------------------------------------------------------------------------


SHARDED_LAYOUTS = {"rows": P("d", None), "vocab": P(None, "d"), "2d": P("r", "v"), "vocab2": P(None, ("v", "r"))}


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("layout", list(SHARDED_LAYOUTS))
def test_sharded_layout(use_gpu, layout, reduction):
    devices = jax.devices("gpu" if use_gpu else "cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 devices (run through test_sharding.py::test_sharded_suite_on_4_cpu_devices)")
    if layout in ("rows", "vocab"):
        mesh = Mesh(np.array(devices[:4]), ("d",))
    else:
        mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("r", "v"))
    spec = SHARDED_LAYOUTS[layout]
    opts = OPTION_SETS["all"]
    # 4 vocabulary shards of 64 columns: the tie across shards (columns 10 and 260) and a whole -inf shard.
    x, y = make_inputs(seed=40, v=300)
    x, y = x[:, :256], y.copy()
    y[1] = 10
    x = x.at[1, 200].set(x[1, 10])
    y = np.where(y >= 256, 3, y).astype(np.int32)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    ys = jax.device_put(y, NamedSharding(mesh, P(spec[0])))

    def f(a, b):
        return cross_entropy(a, b, backend="kernel", reduction=reduction, **opts, **ALL_RETURNS)

    out = jax.jit(f)(xs, ys)
    assert_outputs(out, x, y, opts, reduction)
    # O(N) communication: a pmax of 2N, a psum of 4N, a pmin of N values; nothing near the logits' size.
    found = collectives(jax.jit(f).lower(xs, ys).compile().as_text())
    assert all(size <= 4 * N_ROWS for _, size in found), found
    if spec[-1] is not None:
        assert any(op == "all-reduce" and size > 1 for op, size in found), found

    def loss_plus_z_loss(a, b, backend):
        out = cross_entropy(a, b, backend=backend, reduction=reduction, **opts, **ALL_RETURNS)
        return jnp.sum(out.loss) + jnp.sum(out.z_loss)

    grad = jax.jit(jax.grad(loss_plus_z_loss), static_argnums=2)(xs, ys, "kernel")
    want = jax.grad(loss_plus_z_loss)(x, y, "reference")
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-7)
