"""The backward kernel's entropy-gradient variant (launch.backward(..., g_entropy=, mz=)) against float64: alone,
with the lse cotangent (a differentiated z_loss output), with class weights, and in vocab-parallel form (global lse
and mz, this shard's columns); and the default kernels unchanged by it. The kernels run where the inputs are (JAX's
default device): compiled on a GPU (pytest --gpu), in interpret mode on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax.core.options import Options
from fastce_jax.losses.cross_entropy import launch

from .checks import assert_grad, expected
from .rl_checks import mean_z, with_entropy_gradient, with_lse_gradient

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcapping=7.0, logit_scaling=1.3),
    "softcap_temperature": dict(logit_softcapping=5.0 / 0.7, logit_scaling=1.0 / 0.7),
}


def inputs(n, v, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, v)) * 2.0, DTYPES[dtype])
    y = rng.integers(0, v, n).astype(np.int32)
    y[1] = -100
    x = x.at[2, :7].set(-jnp.inf)  # padding-like -inf columns contribute 0 (not 0 * inf)
    g = rng.uniform(-1.5, 1.5, n)
    g_h = rng.uniform(-2.0, 2.0, n)
    return x, y, g, g_h


def interpreted(x):
    """Interpret mode unless x is on a GPU (as test_kernels.py decides)."""
    return all(d.platform != "gpu" for d in x.devices())


def statistics(x, y, options):
    """lse and mz (float32, as the forward kernels give them) of the float64 values."""
    ref = expected(x, y, **options)
    mz = mean_z(x, y, **options)
    lse = np.where(y == options.get("ignore_index", -100), -np.inf, ref.lse)
    return jnp.asarray(lse, jnp.float32), jnp.asarray(mz, jnp.float32)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("with_lse", [False, True], ids=["", "g_lse"])
def test_entropy_gradient_variant(dtype, name, with_lse):
    opts = OPTIONS[name]
    x, y, g, g_h = inputs(6, 300, dtype, seed=len(name) + with_lse)
    lse, mz = statistics(x, y, opts)
    g_lse = np.linspace(-1.0, 1.0, len(y)) if with_lse else None
    dx = launch.backward(
        x, jnp.asarray(y), lse, jnp.asarray(g, jnp.float32), Options(**opts), inplace=False,
        interpret=interpreted(x), g_entropy=jnp.asarray(g_h, jnp.float32), mz=mz,
        **({"g_lse": jnp.asarray(g_lse, jnp.float32)} if with_lse else {}),
    )  # fmt: skip
    assert dx.dtype == x.dtype and dx.shape == x.shape
    ref = with_entropy_gradient(expected(x, y, upstream=g, **opts), x, y, g_h, **opts)
    if with_lse:
        ref = with_lse_gradient(ref, x, y, g_lse, **opts)
    assert_grad(dx, ref)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_entropy_gradient_with_class_weights(smoothing):
    opts = dict(label_smoothing=smoothing, logit_scaling=0.8)
    x, y, g, g_h = inputs(5, 200, "float32", seed=7)
    w = np.random.default_rng(3).uniform(-0.5, 2.0, 200)
    lse, mz = statistics(x, y, opts)
    dx = launch.backward(
        x, jnp.asarray(y), lse, jnp.asarray(g, jnp.float32), Options(**opts), inplace=True,
        interpret=interpreted(x), weight=jnp.asarray(w, jnp.float32), g_entropy=jnp.asarray(g_h, jnp.float32), mz=mz,
    )  # fmt: skip
    ref = with_entropy_gradient(expected(x, y, upstream=g, weight=w, **opts), x, y, g_h, **opts)
    assert_grad(dx, ref)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_entropy_gradient_vocab_parallel(dtype):
    """Two vocabulary shards, each given the global lse and mz: their gradients are the full one's columns."""
    opts = OPTIONS["all"]
    x, y, g, g_h = inputs(6, 300, dtype, seed=11)
    lse, mz = statistics(x, y, opts)
    ref = with_entropy_gradient(expected(x, y, upstream=g, **opts), x, y, g_h, **opts)
    parts = []
    for start, stop in [(0, 128), (128, 300)]:
        parts.append(
            launch.backward(
                x[:, start:stop],
                jnp.asarray(y),
                lse,
                jnp.asarray(g, jnp.float32),
                Options(**opts),
                inplace=False,
                interpret=interpreted(x),
                vocab_start=start,
                vocab_total=300,
                g_entropy=jnp.asarray(g_h, jnp.float32),
                mz=mz,
            )  # fmt: skip
        )
    assert_grad(jnp.concatenate(parts, axis=1), ref)


def test_entropy_arguments_go_together():
    x, y, g, g_h = inputs(3, 50, "float32", seed=1)
    with pytest.raises(ValueError, match="g_entropy and mz"):
        launch.backward(
            x, jnp.asarray(y), jnp.zeros(3), jnp.ones(3), Options(), inplace=False, interpret=True,
            g_entropy=jnp.ones(3),
        )  # fmt: skip


def test_default_backward_lowering_unchanged():
    """The entropy variant is a separate kernel: with it the backward's Triton IR differs, without it the default's
    is what it was (test_lowering.py pins the default kernels against the return_* variants)."""
    from .test_lowering import triton_modules

    options = Options(**OPTIONS["all"])

    def lower(entropy):
        def f(x, y, lse, g):
            kw = {"g_entropy": g, "mz": lse} if entropy else {}
            return launch.backward(x, y, lse, g, options, inplace=True, interpret=False, **kw)

        shapes = [((8, 50257), jnp.bfloat16), ((8,), jnp.int32), ((8,), jnp.float32), ((8,), jnp.float32)]
        traced = jax.jit(f).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
        return triton_modules(traced.lower(lowering_platforms=("cuda",)))["fastce_backward"]

    assert lower(True) != lower(False)


@pytest.mark.parametrize("layout", ["vocab_parallel", "weighted"])
def test_entropy_variant_lowers_with_every_option(layout):
    """The entropy variant combined with the lse cotangent and vocab-parallel mode, or with class weights and
    smoothing, lowers to Triton (the compiled path the GPU runs)."""
    from .test_lowering import triton_modules

    options = Options(**OPTIONS["all"])

    def f(x, y, lse, g, start):
        kw = dict(g_entropy=g, mz=lse, g_lse=g)
        if layout == "vocab_parallel":
            kw.update(vocab_start=start, vocab_total=2 * x.shape[1])
        else:
            kw.update(weight=jnp.linspace(0.5, 1.5, x.shape[1]))
        return launch.backward(x, y, lse, g, options, inplace=True, interpret=False, **kw)

    shapes = [((8, 64128), jnp.bfloat16), ((8,), jnp.int32), ((8,), jnp.float32), ((8,), jnp.float32), ((), jnp.int32)]
    traced = jax.jit(f).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    assert list(triton_modules(traced.lower(lowering_platforms=("cuda",)))) == ["fastce_backward"]
