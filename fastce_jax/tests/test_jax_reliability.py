"""Reliability (issue 7), as in fastce_torch/tests/test_reliability.py:
precision near p = 1, batch invariance, determinism and V = 2**20."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import cross_entropy

from .np_reference import assert_close, np_cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _loss_and_grad(x, y, **options):
    """Per-token losses and d(sum of losses)/dx through the kernels."""

    def total(a):
        losses = cross_entropy(a, y, reduction="none", backend="kernel", **options)
        return jnp.sum(jnp.where(jnp.isnan(losses), 0.0, losses)), losses

    (_, losses), grad = jax.value_and_grad(total, has_aux=True)(x)
    return np.asarray(losses), np.asarray(grad.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("margin", [12.0, 15.0, 19.0])  # 1 - p_y ~5e-3 .. ~1e-6
def test_confident_label_gradient_keeps_bf16_precision(margin, device):
    """p_y - 1 is computed in float32 and rounded once to bf16: relative bf16
    precision while 1 - p_y >= ~1e-4, absolute error ~1e-6 below that."""
    rng = np.random.default_rng(int(margin))
    n, v = 4, 5000
    x = rng.standard_normal((n, v)) * 0.5
    y = rng.integers(0, v, n)
    x[np.arange(n), y] = x.max() + margin + np.arange(n)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    _, grad = _loss_and_grad(
        jax.device_put(jnp.asarray(x, jnp.bfloat16), device), jax.device_put(jnp.asarray(y, jnp.int32), device)
    )
    _, ref = np_cross_entropy(x, y)
    at_label, expected = grad[np.arange(n), y], ref[np.arange(n), y]
    assert (expected < 0).all() and (expected > -0.1).all()
    assert (at_label <= 0).all() and (at_label[expected < -1e-6] < 0).all()
    bound = np.maximum(1.6e-2 * np.abs(expected), 2e-6)
    assert (np.abs(at_label - expected) <= bound).all(), (at_label, expected)


def test_batch_invariance(device):
    """A row's loss and gradient are bit-identical whatever else is in the batch."""
    rng = np.random.default_rng(21)
    v = 70000
    x = jax.device_put(jnp.asarray(rng.standard_normal((9, v)), jnp.bfloat16), device)
    y = rng.integers(0, v, 9).astype(np.int32)
    y[4] = -100
    full_loss, full_grad = _loss_and_grad(x, jax.device_put(y, device))
    for rows in ([2], [7, 2, 5], list(range(9))[::-1]):
        loss, grad = _loss_and_grad(x[np.array(rows)], jax.device_put(y[rows], device))
        np.testing.assert_array_equal(loss, full_loss[rows])
        np.testing.assert_array_equal(grad, full_grad[rows])


@pytest.mark.gpu
def test_bitwise_deterministic(device):
    n, v = 2048, 256000
    kx, ky = jax.random.split(jax.random.key(22))
    x = jax.device_put(jax.random.normal(kx, (n, v), jnp.bfloat16), device)
    y = jax.random.randint(ky, (n,), 0, v, jnp.int32).at[::7].set(-100)
    step = jax.jit(jax.value_and_grad(lambda a: cross_entropy(a, y, label_smoothing=0.1, z_loss=1e-4)))
    results = [step(x) for _ in range(3)]
    for loss, grad in results[1:]:
        assert np.asarray(loss) == np.asarray(results[0][0])
        assert bool(jnp.array_equal(grad, results[0][1]))


@pytest.mark.gpu
def test_vocabulary_of_2_pow_20(device):
    n, v = 64, 2**20
    kx, ky = jax.random.split(jax.random.key(23))
    x = jax.device_put(jax.random.normal(kx, (n, v), jnp.bfloat16), device)
    y = np.array(jax.random.randint(ky, (n,), 0, v, jnp.int32))
    y[3] = -100
    loss, grad = _loss_and_grad(x, jax.device_put(y, device), logit_softcapping=30.0, z_loss=1e-4)
    rows = np.array([0, 3, 31, 63])
    x_rows = np.asarray(x[rows].astype(jnp.float32), np.float64)
    ref_loss, ref_grad = np_cross_entropy(x_rows, y[rows], logit_softcapping=30.0, z_loss=1e-4)
    assert_close(loss[rows], ref_loss, rtol=2e-5, atol=2e-5, what="loss")
    assert_close(grad[rows], ref_grad, rtol=1.6e-2, atol=1.6e-4 * np.abs(ref_grad).max(), what="grad")
