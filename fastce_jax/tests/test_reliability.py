"""Reliability, as in fastce_torch/tests/test_reliability.py:
precision near p = 1, batch invariance, determinism and V = 2**20."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import cross_entropy

from .checks import as_float64, assert_grad, assert_loss, expected

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _loss_and_grad(x, y, **options):
    """Per-token losses and d(sum of losses)/dx through the kernels."""

    def total(a):
        losses = cross_entropy(a, y, reduction="none", backend="kernel", **options)
        return jnp.sum(jnp.where(jnp.isnan(losses), 0.0, losses)), losses

    (_, losses), grad = jax.value_and_grad(total, has_aux=True)(x)
    return losses, grad


@pytest.mark.parametrize("margin", [12.0, 15.0, 19.0])  # 1 - p_y ~5e-3 .. ~1e-6
def test_confident_label_gradient_keeps_bf16_precision(margin, device):
    """p_y - 1 is computed in float32 and rounded once to bf16: relative bf16
    precision while 1 - p_y >= ~1e-4, absolute error ~1e-6 below that."""
    rng = np.random.default_rng(int(margin))
    n, v = 4, 5000
    x = rng.standard_normal((n, v)) * 0.5
    y = rng.integers(0, v, n)
    x[np.arange(n), y] = x.max() + margin + np.arange(n)
    x = jax.device_put(jnp.asarray(x, jnp.bfloat16), device)
    _, grad = _loss_and_grad(x, jax.device_put(jnp.asarray(y, jnp.int32), device))
    ref = expected(x, y)
    assert_grad(grad, ref)
    # At the label the claim is stronger than the general tolerance (which allows RTOL * (1 + |lse| + max|z|)):
    at_label, exact = as_float64(grad)[np.arange(n), y], ref.grad[np.arange(n), y]
    assert (exact < 0).all() and (exact > -0.1).all()
    assert (at_label <= 0).all() and (at_label[exact < -1e-6] < 0).all()
    bound = np.maximum(1.6e-2 * np.abs(exact), 2e-6)
    assert (np.abs(at_label - exact) <= bound).all(), (at_label, exact)


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
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(full_loss)[rows])
        np.testing.assert_array_equal(as_float64(grad), as_float64(full_grad)[rows])


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
    ref = expected(x[rows], y[rows], logit_softcapping=30.0, z_loss=1e-4)
    assert_loss(loss[rows], ref)
    assert_grad(grad[rows], ref)
