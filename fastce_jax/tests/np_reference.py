"""Float64 NumPy reference of the loss contract (CONTRACT.md): per-token
losses and dL/dlogits, written from the formulas, independent of fastce_jax."""

import numpy as np


def np_cross_entropy(
    x, y, *, ignore_index=-100, logit_scaling=0.0, logit_softcapping=0.0, label_smoothing=0.0, z_loss=0.0
):
    """x (N, V) float, y (N,) int -> (loss (N,), dloss_t/dx (N, V)), float64."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y).astype(np.int64)
    n, v = x.shape
    eps = label_smoothing
    with np.errstate(all="ignore"):
        z = x * logit_scaling if logit_scaling != 0 else x.copy()
        dzdx = np.full_like(x, logit_scaling if logit_scaling != 0 else 1.0)
        if logit_softcapping > 0:
            t = np.tanh(z / logit_softcapping)
            z = logit_softcapping * t
            dzdx = dzdx * (1.0 - t * t)
        m = z.max(axis=1, keepdims=True)
        m = np.where(m == -np.inf, 0.0, m)
        e = np.exp(z - m)
        s = e.sum(axis=1, keepdims=True)
        lse = (m + np.log(s))[:, 0]
        p = e / s
        ok = (y >= 0) & (y < v)
        ign = y == ignore_index
        ys = np.where(ok, y, 0)
        z_y = z[np.arange(n), ys]
        loss = np.zeros(n)
        if eps != 1:
            loss += (1 - eps) * (lse - z_y)
        if eps != 0:
            loss += eps * (lse - z.mean(axis=1))
        if z_loss != 0:
            loss += z_loss * lse**2
        loss = np.where(ok, loss, np.nan)
        loss = np.where(ign, 0.0, loss)
        onehot = np.zeros_like(x)
        onehot[np.arange(n), ys] = 1.0
        d = p * (1 + 2 * z_loss * lse)[:, None] - (1 - eps) * onehot - eps / v
        d = d * dzdx
        d = np.where(ok[:, None], d, np.nan)
        d = np.where(ign[:, None], 0.0, d)
    return loss, d


def assert_close(actual, expected, *, rtol, atol, what=""):
    """allclose that never lets NaN pass: NaN is only accepted exactly where
    the reference is NaN (which the caller asserts separately when intended)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    nan_e = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan_e), (
        f"{what}: NaN pattern differs ({np.isnan(actual).sum()} NaN, expected {nan_e.sum()})"
    )
    np.testing.assert_allclose(actual[~nan_e], expected[~nan_e], rtol=rtol, atol=atol, equal_nan=False, err_msg=what)
