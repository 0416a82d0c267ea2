"""shift=k in fastce_jax under the transforms (the values against the float64 reference are in
shared_tests/test_shift.py): jit, grad and vmap each equal the sliced call, for both functions, and host (NumPy)
labels stay concrete for validate_labels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import cross_entropy, linear_cross_entropy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

V = 29


def inputs(put, batch=3, seq=5, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, seq, V)).astype(np.float32) * 2
    labels = rng.integers(0, V, (batch, seq)).astype(np.int32)
    labels[0, 1] = -100
    return put(logits), put(labels)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [1, 2])
def test_jit_and_grad_equal_the_sliced_call(put, reduction, shift):
    x, y = inputs(put)

    def shifted(a):
        return cross_entropy(a, y, shift=shift, reduction=reduction, backend="kernel", label_smoothing=0.1)

    def sliced(a):
        return cross_entropy(a[:, :-shift], y[:, shift:], reduction=reduction, backend="kernel", label_smoothing=0.1)

    got, want = jax.jit(shifted)(x), sliced(x)
    assert got.shape == want.shape
    close(got, want)
    total = lambda f: lambda a: jnp.sum(f(a) * jnp.arange(1.0, 1.0 + f(a).size).reshape(f(a).shape))
    g_got, g_want = jax.jit(jax.grad(total(shifted)))(x), jax.grad(total(sliced))(x)
    assert g_got.shape == x.shape and not np.asarray(g_got[:, -shift:]).any()
    close(g_got, g_want)


def test_vmap_over_sequences(put):
    x, y = inputs(put)

    def per_sequence(a, b):  # a (T, V), b (T,): the shift is along each sequence
        return cross_entropy(a, b, shift=1, reduction="sum", backend="kernel", z_loss=1e-3)

    got = jax.jit(jax.vmap(jax.value_and_grad(per_sequence)))(x, y)
    want = jax.vmap(
        jax.value_and_grad(
            lambda a, b: jnp.sum(cross_entropy(a[:-1], b[1:], reduction="none", backend="kernel", z_loss=1e-3))
        )
    )(x, y)
    close(got[0], want[0])
    close(got[1], want[1])


def test_linear_under_jit_and_grad(put):
    x, y = inputs(put)
    rng = np.random.default_rng(1)
    hidden, weight = put(rng.standard_normal((3, 5, 8)).astype(np.float32)), put(rng.standard_normal((V, 8)))
    weight = weight.astype(jnp.float32)

    def shifted(h, w):
        return linear_cross_entropy(h, w, y, shift=2, backend="kernel")

    def sliced(h, w):
        return linear_cross_entropy(h[:, :-2], w, y[:, 2:], backend="kernel")

    got = jax.jit(jax.value_and_grad(shifted, argnums=(0, 1)))(hidden, weight)
    want = jax.value_and_grad(sliced, argnums=(0, 1))(hidden, weight)
    close(got[0], want[0])
    assert not np.asarray(got[1][0][:, -2:]).any()
    close(got[1][0][:, :-2], want[1][0][:, :-2])
    close(got[1][1], want[1][1])


def test_host_labels_and_validate_labels(put):
    x, _ = inputs(put)
    labels = np.zeros((3, 5), np.int64)
    labels[1, 0] = V  # out of range, but dropped by the shift
    loss = cross_entropy(x, labels, shift=1, validate_labels=True, backend="kernel")
    close(loss, cross_entropy(x[:, :-1], labels[:, 1:], backend="kernel"))
    labels[2, 3] = V + 4  # kept: named at its position in labels[..., 1:], as the sliced call names it
    with pytest.raises(ValueError, match=r"labels\[2, 2\]"):
        cross_entropy(x, labels, shift=1, validate_labels=True)


def test_ignore_index_that_the_labels_cannot_hold_raises(put):
    x, y = inputs(put)
    with pytest.raises(ValueError, match="shift pads the labels"):
        cross_entropy(x, y, shift=1, ignore_index=2**40)
