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


# --- temperature, token weights, the entropy's gradient, log_probs and linear_log_probs ------------------------------

RL_OPTIONS = [
    Options(temperature=0.7),
    Options(temperature=1.9, logit_softcapping=4.0, logit_scaling=1.3),
    Options(temperature=0.5, logit_scaling=-0.8, ignore_index=2),
]


def finite_differences(scalar, x, h=1e-6):
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric[idx] = (scalar(plus) - scalar(minus)) / (2 * h)
    return numeric


def torch_transform(x, opts):
    """z = softcap(scale x) / T in differentiable float64 torch: an implementation written apart from the reference."""
    z = x * opts.logit_scaling if opts.logit_scaling else x
    if opts.logit_softcapping:
        z = opts.logit_softcapping * torch.tanh(z / opts.logit_softcapping)
    return z / opts.temperature


def test_temperature_divides_the_transformed_logits_literally():
    x, _ = problem(3, 5, seed=RNG_SEED + 10)
    opts = Options(logit_softcapping=3.0, logit_scaling=1.5, temperature=0.6)
    np.testing.assert_array_equal(reference.transform(x, opts), 3.0 * np.tanh(1.5 * x / 3.0) / 0.6)
    # The packages' folding, softcap_c(s x) / T == softcap_{c/T}((s/T) x), holds in exact arithmetic.
    folded = Options(logit_softcapping=3.0 / 0.6, logit_scaling=1.5 / 0.6)
    np.testing.assert_allclose(reference.transform(x, folded), reference.transform(x, opts), rtol=1e-14)
    assert Options(temperature=0.6).as_kwargs()["temperature"] == 0.6 and "temperature" not in Options().as_kwargs()


@pytest.mark.parametrize("opts", RL_OPTIONS + [Options(label_smoothing=0.2, z_loss=0.05, temperature=0.8)], ids=repr)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_weights_gradient_matches_finite_differences(opts, reduction):
    x, y = problem(5, 6, seed=RNG_SEED + 11)
    y[1] = opts.ignore_index
    rng = np.random.default_rng(RNG_SEED + 12)
    weights = rng.standard_normal(5) * 2  # negative ones too (advantages)
    weights[1] = np.nan  # an ignored token's weight takes no part, even NaN
    upstream = rng.standard_normal(5)

    def run(logits):
        return cross_entropy(logits, y, reduction=reduction, upstream=upstream, opts=opts, token_weights=weights)

    def scalar(logits):
        out = run(logits).loss
        return float(np.sum(out * upstream)) if reduction == "none" else float(out)

    ref = run(x)
    np.testing.assert_allclose(ref.grad, finite_differences(scalar, x), rtol=1e-6, atol=1e-8)
    plain = cross_entropy(x, y, reduction="none", opts=opts)
    weighted = np.where(y == opts.ignore_index, 0.0, np.nan_to_num(weights) * plain.loss)
    den = {"none": 1.0, "sum": 1.0, "mean": float(np.sum(y != opts.ignore_index))}[reduction]
    expected = weighted if reduction == "none" else np.sum(weighted) / den  # never divided by the weights' sum
    np.testing.assert_allclose(ref.loss, expected, rtol=1e-14)


def test_token_weights_nan_and_z_loss_output():
    x, y = problem(4, 5, seed=RNG_SEED + 13)
    opts = Options(z_loss=0.1)
    weights = np.array([2.0, np.nan, -1.0, 0.0])
    ref = cross_entropy(x, y, reduction="none", opts=opts, token_weights=weights)
    assert np.isnan(ref.loss[1]) and np.isnan(ref.grad[1]).all() and ref.loss[3] == 0 and np.all(ref.grad[3] == 0)
    out = reference.outputs(x, y, reduction="none", opts=opts, token_weights=weights)
    plain = reference.outputs(x, y, reduction="none", opts=opts)
    np.testing.assert_allclose(out.z_loss, weights * plain.z_loss, rtol=1e-15)
    np.testing.assert_array_equal(out.entropy, plain.entropy)  # only the loss's z-loss term is weighted


@pytest.mark.parametrize("opts", RL_OPTIONS + [Options(logit_softcapping=2.0)], ids=repr)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_entropy_gradient_matches_finite_differences(opts, reduction):
    x, y = problem(4, 7, seed=RNG_SEED + 14)
    y[2] = opts.ignore_index
    y[3] = 7  # out of range: the entropy does not depend on the label
    upstream = np.random.default_rng(RNG_SEED + 15).standard_normal(4)

    def scalar(logits):
        out = reference.outputs(logits, y, reduction=reduction, opts=opts).entropy
        return float(np.sum(out * upstream)) if reduction == "none" else float(out)

    grad = reference.entropy_grad(x, y, reduction=reduction, upstream=upstream, opts=opts)[0]
    assert np.all(grad[2] == 0) and np.isfinite(grad).all()
    np.testing.assert_allclose(grad, finite_differences(scalar, x), rtol=1e-6, atol=1e-8)


def test_entropy_gradient_with_negative_infinity_padding_and_a_nan_row():
    x, y = problem(3, 6, seed=RNG_SEED + 16)
    x[0, 4:] = -np.inf
    x[1, 2] = np.nan
    grad = reference.entropy_grad(x, y, opts=Options(temperature=0.7))[0]
    assert np.all(grad[0, 4:] == 0) and np.isfinite(grad[0]).all() and np.isnan(grad[1]).all()
    assert np.isfinite(grad[2]).all()


def torch_log_probs(x, y, opts, shift):
    """log_probs and entropy by float64 torch autograd (log_softmax + gather), for checking the reference."""
    if shift:
        x, y = x[..., : y.shape[-1] - shift, :], y[..., shift:]
    logp = torch.log_softmax(torch_transform(x, opts), dim=-1)
    ignored = y == opts.ignore_index
    picked = torch.gather(logp, -1, torch.where(ignored, 0, y)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(ignored, 0.0, picked), torch.where(ignored, 0.0, entropy)


@pytest.mark.parametrize("shift", [0, 1, 2])
@pytest.mark.parametrize("opts", RL_OPTIONS, ids=repr)
def test_log_probs_match_torch_autograd_in_float64(opts, shift):
    rng = np.random.default_rng(RNG_SEED + 17)
    x = rng.standard_normal((2, 5, 9)) * 3
    y = rng.integers(0, 9, (2, 5))
    y[0, 3] = opts.ignore_index
    kept = y[..., shift:].shape
    g, h = rng.standard_normal(kept), rng.standard_normal(kept)
    ref = reference.log_probs(x, y, opts=opts, shift=shift, upstream_logprobs=g, upstream_entropy=h)
    xt = torch.tensor(x, requires_grad=True)
    logprobs, entropy = torch_log_probs(xt, torch.tensor(y), opts, shift)
    (logprobs * torch.tensor(g) + entropy * torch.tensor(h)).sum().backward()
    np.testing.assert_allclose(ref.logprobs, logprobs.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ref.entropy, entropy.detach().numpy(), rtol=1e-11, atol=1e-13)  # sum p log p
    np.testing.assert_allclose(ref.grad, xt.grad.numpy(), rtol=1e-12, atol=1e-14)
    assert ref.logprobs.shape == kept and not np.signbit(ref.logprobs[y[..., shift:] == opts.ignore_index]).any()
    if shift:
        assert np.all(ref.grad[..., -shift:, :] == 0)


def test_log_probs_of_a_bad_token_are_nan():
    x, _ = problem(3, 4, seed=RNG_SEED + 18)
    ref = reference.log_probs(x, np.array([1, 4, -100]), upstream_entropy=np.ones(3))
    assert np.isnan(ref.logprobs[1]) and np.isfinite(ref.entropy[1]) and ref.logprobs[2] == 0
    assert np.isnan(ref.grad[1]).all() and np.all(ref.grad[2] == 0)


def test_linear_log_probs_match_torch_autograd_in_float64():
    rng = np.random.default_rng(RNG_SEED + 19)
    hidden, weight, bias = rng.standard_normal((2, 4, 6)), rng.standard_normal((11, 6)), rng.standard_normal(11)
    y = rng.integers(0, 11, (2, 4))
    y[1, 1] = -100
    opts = Options(temperature=0.7, logit_softcapping=5.0)
    g, h = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    ref = reference.linear_log_probs(
        hidden, weight, y, bias=bias, opts=opts, shift=1, upstream_logprobs=g, upstream_entropy=h
    )
    leaves = [torch.tensor(a, requires_grad=True) for a in (hidden, weight, bias)]
    logprobs, entropy = torch_log_probs(leaves[0] @ leaves[1].T + leaves[2], torch.tensor(y), opts, 1)
    (logprobs * torch.tensor(g) + entropy * torch.tensor(h)).sum().backward()
    np.testing.assert_allclose(ref.logits.logprobs, logprobs.detach().numpy(), rtol=1e-13)
    for got, leaf in zip((ref.grad_hidden, ref.grad_weight, ref.grad_bias), leaves):
        np.testing.assert_allclose(got, leaf.grad.numpy(), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_differentiated_outputs_match_finite_differences(reduction):
    """reference.differentiated: the gradient of <g, loss> + <g_z, z_loss> + <g_h, entropy> (class and token
    weights, shift, n_items, every option) against central differences of its own outputs, which are `outputs`'."""
    rng = np.random.default_rng(RNG_SEED + 20)
    x, y = rng.standard_normal((2, 4, 6)) * 2, rng.integers(0, 6, (2, 4))
    y[0, 2] = -100
    opts = Options(logit_softcapping=4.0, logit_scaling=1.3, label_smoothing=0.2, z_loss=0.05, temperature=0.7)
    keywords = dict(reduction=reduction, opts=opts, weight=rng.uniform(0.5, 2.0, 6), shift=1,
                    token_weights=rng.standard_normal((2, 4)), n_items=5 if reduction == "sum" else None)  # fmt: skip
    upstream = [rng.standard_normal((2, 3)) if reduction == "none" else c for c in (1.3, 0.7, -0.4)]

    def scalar(logits):
        out = reference.differentiated(logits, y, upstream=upstream, **keywords)
        values = (out.loss.loss, out.z_loss, out.entropy.loss)
        return float(sum(np.sum(g * v) for g, v in zip(upstream, values)))

    ref = reference.differentiated(x, y, upstream=upstream, **keywords)
    assert np.all(ref.loss.grad[:, -1] == 0)  # the shifted-out position
    np.testing.assert_allclose(ref.loss.grad, finite_differences(scalar, x), rtol=1e-6, atol=1e-8)
    unshifted = {k: v for k, v in keywords.items() if k not in ("shift", "token_weights")}
    out = reference.outputs(x[:, :-1], y[:, 1:], token_weights=keywords["token_weights"][:, 1:], **unshifted)
    np.testing.assert_array_equal(ref.z_loss, out.z_loss)
    np.testing.assert_array_equal(ref.entropy.loss, out.entropy)
