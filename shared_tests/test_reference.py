"""The float64 reference checked on its own, so that agreeing with it means something: its analytic gradient
against central finite differences of its own loss, its loss against closed forms and against
torch.nn.functional.cross_entropy in float64 (an implementation neither package uses), and its special cases."""

import math

import numpy as np
import pytest
import torch

from . import reference
from .reference import Options, cross_entropy

RNG_SEED = 1234


def problem(n, vocab, seed, std=2.0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, vocab)) * std, rng.integers(0, vocab, n)


OPTION_SETS = [
    Options(),
    Options(logit_softcapping=3.0),
    Options(logit_scaling=-0.7),
    Options(label_smoothing=0.3),
    Options(z_loss=0.05),
    Options(logit_softcapping=4.0, logit_scaling=1.3, label_smoothing=0.2, z_loss=0.02, ignore_index=2),
    Options(label_smoothing=1.0),
]


@pytest.mark.parametrize("opts", OPTION_SETS, ids=repr)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_matches_finite_differences(opts, reduction):
    x, y = problem(4, 7, seed=RNG_SEED)
    y[1] = opts.ignore_index if opts.ignore_index != -100 else -100
    upstream = np.random.default_rng(RNG_SEED + 1).standard_normal(4)

    def scalar(logits):
        out = cross_entropy(logits, y, reduction=reduction, upstream=upstream, opts=opts).loss
        return float(np.sum(out * upstream)) if reduction == "none" else float(out)

    grad = cross_entropy(x, y, reduction=reduction, upstream=upstream, opts=opts).grad
    h = 1e-6
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric[idx] = (scalar(plus) - scalar(minus)) / (2 * h)
    assert np.all(grad[1] == 0)  # the ignored row
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("opts", OPTION_SETS[:6], ids=repr)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_torch_functional_in_float64(opts, reduction):
    """F.cross_entropy knows label smoothing and ignore_index; scaling and softcapping are applied before it, the
    z-loss term added after (z-loss has no torch counterpart), all in float64 with autograd for the gradient."""
    x, y = problem(6, 11, seed=RNG_SEED + 2, std=3.0)
    y[2] = opts.ignore_index
    xt = torch.tensor(x, requires_grad=True)
    z = xt * opts.logit_scaling if opts.logit_scaling else xt
    if opts.logit_softcapping:
        z = opts.logit_softcapping * torch.tanh(z / opts.logit_softcapping)
    yt = torch.tensor(y)
    tokens = torch.nn.functional.cross_entropy(
        z, yt, ignore_index=opts.ignore_index, reduction="none", label_smoothing=opts.label_smoothing
    )
    kept = (yt != opts.ignore_index).double()
    tokens = tokens + opts.z_loss * torch.logsumexp(z, -1) ** 2 * kept
    expected = tokens.sum() / (kept.sum() if reduction == "mean" else 1.0)
    expected.backward()
    ref = cross_entropy(x, y, reduction=reduction, opts=opts)
    np.testing.assert_allclose(ref.loss, expected.item(), rtol=1e-13)
    np.testing.assert_allclose(ref.grad, xt.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_closed_form_for_equal_logits():
    """All logits equal c: p = 1/V, loss = log V (+ z_loss (c + log V)^2) whatever the smoothing, gradient
    (1/V (1 + 2 z_loss lse) - [j == y]) * upstream, here 1/N for "mean"."""
    n, vocab, c, zl = 3, 5, 1.5, 0.01
    x = np.full((n, vocab), c)
    y = np.array([0, 4, 2])
    ref = cross_entropy(x, y, opts=Options(label_smoothing=0.25, z_loss=zl))
    lse = c + math.log(vocab)
    assert ref.loss == pytest.approx(math.log(vocab) + zl * lse**2, rel=1e-14)
    expected = (np.full((n, vocab), (1 + 2 * zl * lse) / vocab) - 0.75 * np.eye(vocab)[y] - 0.25 / vocab) / n
    np.testing.assert_allclose(ref.grad, expected, rtol=1e-13, atol=1e-16)


def test_special_cases():
    vocab = 6
    x, _ = problem(6, vocab, seed=RNG_SEED + 3)
    x[0, 4:] = -np.inf  # -inf padding: finite loss, zero gradient there
    x[1, 2] = np.nan  # NaN: row 1 NaN
    x[2, 3] = np.inf  # +inf: row 2 NaN
    x[3, 1] = np.nan  # ignored row holding NaN: 0
    y = np.array([1, 0, 0, -100, vocab, -3])  # rows 4 and 5: out of range
    ref = cross_entropy(x, y, reduction="none")
    assert np.isfinite(ref.loss[0]) and np.all(ref.grad[0, 4:] == 0) and np.all(np.isfinite(ref.grad[0]))
    assert np.isnan(ref.loss[[1, 2, 4, 5]]).all() and np.isnan(ref.grad[[1, 2, 4, 5]]).all()
    assert ref.loss[3] == 0 and np.all(ref.grad[3] == 0)
    # Softcapping maps +inf to the cap: finite, with zero derivative at the +inf entry.
    capped = cross_entropy(x[2:3], y[2:3], reduction="none", opts=Options(logit_softcapping=5.0))
    assert np.isfinite(capped.loss).all() and capped.grad[0, 3] == 0
    # Label smoothing without softcapping: mean(z) = -inf, so -inf padding gives +inf (the gradient stays finite).
    smooth = cross_entropy(x[:1], y[:1], reduction="none", opts=Options(label_smoothing=0.1))
    assert smooth.loss[0] == np.inf and np.isfinite(smooth.grad).all()


def test_mean_denominators():
    x, y = problem(5, 4, seed=RNG_SEED + 4)
    y[:] = -100
    ref = cross_entropy(x, y)
    assert ref.loss == 0 and np.all(ref.grad == 0)  # all ignored: 0 / max(1, 0)
    y = np.array([1, -100, 9, 2, -100])  # the out-of-range label counts: 3 tokens
    ref = cross_entropy(x, y, reduction="none")
    mean = cross_entropy(x, y)
    assert np.isnan(mean.loss) and mean.upstream[0] == pytest.approx(1 / 3)
    items = cross_entropy(x, np.array([1, -100, 0, 2, -100]), n_items=2.5)
    plain = cross_entropy(x, np.array([1, -100, 0, 2, -100]), reduction="sum")
    assert items.loss == pytest.approx(plain.loss / 2.5, rel=1e-15)
    summed = cross_entropy(x, np.array([1, -100, 0, 2, -100]), reduction="sum", n_items=4)
    assert summed.loss == pytest.approx(plain.loss / 4, rel=1e-15)
    np.testing.assert_allclose(summed.grad, plain.grad / 4, rtol=1e-15)
    assert ref.loss.shape == (5,)


def test_labels_are_never_wrapped():
    x, _ = problem(2, 4, seed=RNG_SEED + 5)
    ref = cross_entropy(x, np.array([2**40 + 1, 1], dtype=np.int64), reduction="none")
    assert np.isnan(ref.loss[0]) and np.isfinite(ref.loss[1])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_outputs_from_first_principles(reduction):
    """reference.outputs against direct formulas: z_loss is the loss's z-loss share, entropy -sum p log p,
    accuracy argmax == label over kept rows, lse -inf where ignored; a bad label is NaN in z_loss and accuracy."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 13)) * 3
    y = rng.integers(0, 13, 9)
    y[1], y[4] = -100, -100
    x[5, :] = x[5, 0]  # a row of ties: argmax takes the first index
    y[5] = 0
    opts = Options(z_loss=0.25, logit_softcapping=5.0)
    out = reference.outputs(x, y, reduction=reduction, opts=opts)
    with_z = reference.cross_entropy(x, y, reduction=reduction, opts=opts)
    without_z = reference.cross_entropy(x, y, reduction=reduction, opts=Options(logit_softcapping=5.0))
    np.testing.assert_allclose(out.z_loss, with_z.loss - without_z.loss, rtol=1e-12, atol=1e-12)
    z = reference.transform(x, opts)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kept = y != -100
    entropy = np.where(kept, -(p * np.log(p)).sum(-1), 0.0)
    hits = np.where(kept, (z.argmax(-1) == y).astype(float), 0.0)
    assert hits[5] == 1.0
    if reduction == "none":
        np.testing.assert_allclose(out.entropy, entropy, rtol=1e-12)
        np.testing.assert_array_equal(out.accuracy, hits)
    else:
        den = kept.sum() if reduction == "mean" else 1
        np.testing.assert_allclose(out.entropy, entropy.sum() / den, rtol=1e-12)
        assert out.accuracy == hits.sum() / kept.sum()
    assert np.all(out.lse[~kept] == -np.inf) and np.all(np.isfinite(out.lse[kept]))
    y_bad = y.copy()
    y_bad[0] = 13
    bad = reference.outputs(x, y_bad, reduction="none", opts=opts)
    assert np.isnan(bad.z_loss[0]) and np.isnan(bad.accuracy[0])
    assert np.isfinite(bad.entropy[0]) and np.isfinite(bad.lse[0])
