"""The float64 distillation reference (reference_distill.py) checked on its own, so that agreeing with it means
something: its analytic gradients (student, and the teacher's used for tolerances) against central finite
differences of its own loss; its loss and student gradient against float64 torch autograd of TRL's
`generalized_jsd_loss` formula, written here from its definition (GKDTrainer: log_softmax of logits / T; beta 0 ->
F.kl_div(student, teacher) = KL(teacher || student), beta 1 -> KL(student || teacher), otherwise the mixture
log((1 - beta) p_s + beta p_t) and beta KL(teacher || m) + (1 - beta) KL(student || m); masked rows dropped;
"batchmean" = sum / number of kept rows); and its special cases and symmetries."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from .reference_distill import jsd, linear_jsd

BETAS = [0.0, 0.3, 0.5, 1.0]
OPTIONS = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.6, student_softcapping=3.0),
    dict(teacher_softcapping=2.5, student_softcapping=4.0, temperature=0.9),
]


def problem(n, vocab_s, vocab_t=None, seed=0, std=2.0):
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, vocab_s)) * std
    xt = rng.standard_normal((n, vocab_t or vocab_s)) * std + 0.5
    return xs, xt, rng


def trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature, reduction):
    """TRL's generalized JSD in torch, from its definition (float64 tensors in, autograd through it)."""
    ls = F.log_softmax(student_logits / temperature, dim=-1)
    lt = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        per_element = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        per_element = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=ls.dtype)
        mixture = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, lt, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, ls, reduction="none", log_target=True)
        per_element = beta * kl_teacher + (1 - beta) * kl_student
    per_row = per_element.sum(dim=-1)
    mask = torch.ones_like(per_row, dtype=torch.bool) if labels is None else labels != -100
    if reduction == "none":
        return torch.where(mask, per_row, 0.0)
    kept = per_row[mask]
    return kept.sum() / (mask.sum().clamp_min(1) if reduction == "mean" else 1)


def softcapped(x, cap):
    return cap * torch.tanh(x / cap) if cap else x


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradients_match_finite_differences(beta, opts, reduction):
    xs, xt, rng = problem(4, 7, vocab_t=9, seed=11)
    labels = np.array([3, -100, 0, 6])
    upstream = rng.standard_normal(4) if reduction == "none" else 1.3

    def scalar(student, teacher):
        out = jsd(student, teacher, labels, beta=beta, reduction=reduction, **opts).loss
        return float(np.sum(out * upstream)) if reduction == "none" else float(out) * upstream

    result = jsd(xs, xt, labels, beta=beta, reduction=reduction, upstream=upstream, **opts)
    h = 1e-6
    for x, analytic in ((xs, result.grad), (xt, result.teacher_grad)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            args = (plus, xt) if x is xs else (xs, plus)
            args_minus = (minus, xt) if x is xs else (xs, minus)
            numeric[idx] = (scalar(*args) - scalar(*args_minus)) / (2 * h)
        # d / d teacher's columns past V_s: 0 (never read); the reference returns the first V_s columns only.
        np.testing.assert_allclose(numeric[:, 7:], 0.0, atol=1e-12)
        np.testing.assert_allclose(analytic, numeric[:, :7], rtol=1e-6, atol=1e-9)
    assert np.all(result.grad[1] == 0) and result.token_loss[1] == 0  # the ignored row


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_trl_formula_in_float64(beta, opts, reduction):
    """Loss, student gradient and the teacher's d loss / d logits against torch autograd of TRL's formula, the
    soft-capping applied to each model's logits before it (as TRL's chunked distillation loss does)."""
    xs, xt, rng = problem(6, 11, seed=23, std=3.0)
    labels = np.array([4, -100, 0, 10, -100, 2])
    temperature = opts.get("temperature", 1.0)
    student = torch.tensor(xs, requires_grad=True)
    teacher = torch.tensor(xt, requires_grad=True)
    s = softcapped(student, opts.get("student_softcapping", 0.0))
    t = softcapped(teacher, opts.get("teacher_softcapping", 0.0))
    expected = trl_generalized_jsd(s, t, torch.tensor(labels), beta, temperature, reduction)
    upstream = rng.standard_normal(6) if reduction == "none" else None
    (expected * (torch.tensor(upstream) if upstream is not None else 1.0)).sum().backward()
    ref = jsd(xs, xt, labels, beta=beta, reduction=reduction, upstream=upstream, **opts)
    np.testing.assert_allclose(ref.loss, expected.detach().numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ref.grad, student.grad.numpy(), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(ref.teacher_grad, teacher.grad.numpy(), rtol=1e-11, atol=1e-15)


def test_linear_jsd_matches_torch_autograd():
    """linear_jsd: the logits through both heads (a padded teacher head: V_t > V_s, its first V_s rows used), the
    student's hidden, weight and bias gradients against float64 autograd of the same composition."""
    rng = np.random.default_rng(5)
    n, hs, ht, vs, vt = 5, 6, 4, 9, 12
    arrays = [rng.standard_normal(shape) for shape in ((n, hs), (vs, hs), (vs,), (n, ht), (vt, ht), (vt,))]
    labels = np.array([1, -100, 3, 3, 8])
    opts = dict(beta=0.3, temperature=0.8, student_softcapping=5.0, teacher_softcapping=3.0)
    h_s, w_s, b_s, h_t, w_t, b_t = (torch.tensor(a, requires_grad=True) for a in arrays)

    def trl(reduction):
        s_logits = softcapped(h_s @ w_s.T + b_s, 5.0)
        t_logits = softcapped((h_t @ w_t.T + b_t)[:, :vs], 3.0)
        return trl_generalized_jsd(s_logits, t_logits, torch.tensor(labels), 0.3, 0.8, reduction)

    expected = trl("mean")
    expected.backward()
    ref = linear_jsd(*arrays[:2], *arrays[3:5], labels, student_bias=arrays[2], teacher_bias=arrays[5], **opts)
    loss, d_hidden, d_weight, d_bias = ref
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-13)
    for got, leaf in ((d_hidden, h_s), (d_weight, w_s), (d_bias, b_s)):
        np.testing.assert_allclose(got, leaf.grad.numpy(), rtol=1e-11, atol=1e-15)
    # "none" with an upstream: the same chain rule, per row.
    upstream = rng.standard_normal(n)
    per_row = linear_jsd(
        *arrays[:2],
        *arrays[3:5],
        labels,
        student_bias=arrays[2],
        teacher_bias=arrays[5],
        reduction="none",
        upstream=upstream,
        **opts,
    )
    g = torch.tensor(upstream)
    for leaf in (h_s, w_s, b_s):
        leaf.grad = None
    (trl("none") * g).sum().backward()
    np.testing.assert_allclose(per_row.grad_hidden, h_s.grad.numpy(), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(per_row.grad_weight, w_s.grad.numpy(), rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(per_row.grad_bias, b_s.grad.numpy(), rtol=1e-11, atol=1e-15)
    assert linear_jsd(*arrays[:2], *arrays[3:5], **opts).grad_bias is None  # no bias, no bias gradient


@pytest.mark.parametrize("beta", BETAS)
def test_identities(beta):
    """Equal distributions: loss 0 and gradient 0 at every beta (a constant shift of the logits changes nothing).
    Swapping the models: jsd(s, t, beta) == jsd(t, s, 1 - beta) (the mixture and both KLs swap). beta = 0.5 is the
    Jensen-Shannon divergence: at most log 2. Labels = None counts every row."""
    xs, xt, _ = problem(5, 13, seed=31)
    same = jsd(xs, xs + 1.25, beta=beta, reduction="none")
    np.testing.assert_allclose(same.loss, 0.0, atol=1e-14)
    np.testing.assert_allclose(same.grad, 0.0, atol=1e-15)
    forward = jsd(xs, xt, beta=beta, reduction="none").loss
    swapped = jsd(xt, xs, beta=1.0 - beta, reduction="none").loss
    np.testing.assert_allclose(forward, swapped, rtol=1e-13)
    assert np.all(forward > 0)
    if beta == 0.5:
        assert np.all(forward <= math.log(2))
    # labels=None is every row counted: the mean is the mean of the rows.
    np.testing.assert_allclose(jsd(xs, xt, beta=beta).loss, forward.mean(), rtol=1e-14)


def test_special_rows():
    vocab = 6
    xs, xt, _ = problem(7, vocab, vocab_t=vocab + 3, seed=41)
    xs[0, 4:] = xt[0, 4:] = -np.inf  # both -inf in the same columns: finite, gradient 0 there
    xs[1, 2] = np.nan  # a NaN in the student: row NaN
    xt[2, 3] = np.nan  # a NaN in the teacher: row NaN
    xs[3, 1] = np.nan  # an ignored row holding NaN: 0
    xs[4, 0] = -np.inf  # the student -inf where the teacher is finite
    xt[5, vocab:] = np.nan  # the teacher's columns past V_s are never read
    xs[6, 5] = np.inf  # +inf without softcapping: NaN
    labels = np.array([0, 0, 0, -100, 0, 0, 0])
    for beta in BETAS:
        ref = jsd(xs, xt, labels, beta=beta, reduction="none")
        assert np.isfinite(ref.loss[0]) and np.all(ref.grad[0, 4:] == 0) and np.all(np.isfinite(ref.grad[0]))
        for row in (1, 2, 6):
            assert np.isnan(ref.loss[row]) and np.isnan(ref.grad[row]).all(), (beta, row)
        assert ref.loss[3] == 0 and np.all(ref.grad[3] == 0)
        assert np.isfinite(ref.loss[5]) and np.isfinite(ref.grad[5]).all()
        # Student -inf, teacher mass there: forward KL is +inf; the reverse KL and the mixture stay finite.
        assert (ref.loss[4] == np.inf) if beta == 0 else np.isfinite(ref.loss[4])
        # Its gradient there: -p_t for the forward KL (p_s - p_t), 0 otherwise (every term carries p_s).
        assert (ref.grad[4, 0] < 0) if beta == 0 else (ref.grad[4, 0] == 0)
        assert np.isfinite(ref.grad[4]).all()
        # The "mean" over counted rows is NaN (NaN rows), but the other rows' gradients are untouched.
        mean = jsd(xs, xt, labels, beta=beta)
        assert np.isnan(mean.loss) and np.isfinite(mean.grad[[0, 3, 5]]).all()
    # With soft-capping the +inf maps to the cap: finite, derivative 0 there.
    capped = jsd(xs[6:], xt[6:], beta=0.5, reduction="none", student_softcapping=4.0)
    assert np.isfinite(capped.loss).all() and capped.grad[0, 5] == 0


def test_padded_teacher_and_reductions():
    """V_t > V_s: exactly the jsd of the teacher's first V_s columns; "mean" divides by the counted rows, an
    all-ignored batch gives 0 with a zero gradient; the leading shape is kept for "none"."""
    xs, xt, _ = problem(6, 10, vocab_t=16, seed=51)
    labels = np.array([[2, -100, 4], [1, 1, -100]])
    a = jsd(xs.reshape(2, 3, 10), xt.reshape(2, 3, 16), labels, beta=0.3, reduction="none")
    b = jsd(xs.reshape(2, 3, 10), xt[:, :10].reshape(2, 3, 10), labels, beta=0.3, reduction="none")
    assert a.loss.shape == (2, 3) and a.grad.shape == (2, 3, 10)
    np.testing.assert_array_equal(a.loss, b.loss)
    np.testing.assert_array_equal(a.grad, b.grad)
    mean = jsd(xs.reshape(2, 3, 10), xt.reshape(2, 3, 16), labels, beta=0.3)
    np.testing.assert_allclose(mean.loss, a.loss.sum() / 4, rtol=1e-14)
    np.testing.assert_allclose(mean.grad * 4, a.grad, rtol=1e-14)
    every = jsd(xs, xt, np.full(6, 7), beta=0.3, ignore_index=7)
    assert every.loss == 0 and np.all(every.grad == 0)
