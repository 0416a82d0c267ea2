"""fastce_jax.linear_cross_entropy against the repository's float64 reference (shared_tests/reference.py): the
logits hidden @ weight.T + bias in float64, the contract's loss and dL/dlogits from reference.cross_entropy, and
the chain rule through the matmul by hand (dhidden = G W, dweight = G^T hidden, dbias = sum_t G).

JAX only, for the JAX side of issue 14 (the torch twin's shared test compares both packages); the chunk size is
forced small so that several chunks, the clamped last one included, run.  Without --gpu the kernels run in Pallas
interpret mode on CPU arrays.
"""

import importlib

import numpy as np
import pytest

from . import reference

jax = pytest.importorskip("jax")
jnp = jax.numpy
fastce_jax = pytest.importorskip("fastce_jax")
LCE = importlib.import_module("fastce_jax.linear_cross_entropy")

CASES = {
    "mean": (dict(), "mean", None),
    "sum-bias": (dict(), "sum", None),
    "none-bias-smoothing": (dict(label_smoothing=0.1), "none", None),
    "mean-n_items-zloss": (dict(z_loss=1e-3), "mean", 9),
    "softcap-scaling": (dict(logit_softcapping=5.0, logit_scaling=0.8), "mean", None),
    "ignore7-sum-n_items": (dict(ignore_index=7), "sum", 4),
}


def linear_reference(hidden, weight, bias, labels, *, reduction, n_items, upstream, opts):
    h = np.asarray(hidden, np.float64)
    w = np.asarray(weight, np.float64)
    logits = h @ w.T + (0.0 if bias is None else np.asarray(bias, np.float64))
    ref = reference.cross_entropy(
        logits,
        labels,
        reduction=reduction,
        n_items=n_items,
        upstream=upstream if reduction == "none" else None,
        opts=reference.Options(**opts),
    )
    g = ref.grad if reduction == "none" else ref.grad * upstream
    return ref.loss, g @ w, g.T @ h, g.sum(0)


@pytest.mark.parametrize("case", list(CASES))
def test_linear_cross_entropy_jax_vs_reference(case, monkeypatch):
    opts, reduction, n_items = CASES[case]
    monkeypatch.setattr(LCE, "CHUNK_ROWS", 8)
    rng = np.random.default_rng(list(CASES).index(case))
    n, dim, vocab = 21, 16, 67
    hidden = rng.standard_normal((n, dim)).astype(np.float32)
    weight = (rng.standard_normal((vocab, dim)) * 0.5).astype(np.float32)
    bias = (rng.standard_normal(vocab) * 0.5).astype(np.float32) if "bias" in case else None
    labels = rng.integers(0, vocab, n)
    labels[[2, 11]] = opts.get("ignore_index", -100)
    upstream = rng.uniform(0.5, 2.0, n) if reduction == "none" else 1.3
    y = jnp.asarray(labels, jnp.int32)

    def objective(h, w, b):
        loss = fastce_jax.linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, n_items=n_items, backend="kernel", **opts
        )
        return (jnp.sum(loss * jnp.asarray(upstream, jnp.float32)) if reduction == "none" else upstream * loss), loss

    with jax.default_matmul_precision("float32"):
        (_, loss), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
            jnp.asarray(hidden), jnp.asarray(weight), None if bias is None else jnp.asarray(bias)
        )
    want = linear_reference(
        hidden, weight, bias, labels, reduction=reduction, n_items=n_items, upstream=upstream, opts=opts
    )
    np.testing.assert_allclose(np.asarray(loss), want[0], rtol=3e-5, atol=3e-5)
    for name, got, expected in zip(("dhidden", "dweight", "dbias"), grads, want[1:]):
        if bias is None and name == "dbias":
            assert got is None
            continue
        assert not np.isnan(np.asarray(got)).any(), name
        np.testing.assert_allclose(
            np.asarray(got), expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max(), err_msg=name
        )
