"""Float64 NumPy reference of the distillation losses `jsd` and `linear_jsd` (issue 38; CONTRACT.md, section
"Distillation"): the loss AND its analytic gradient with respect to the student's logits (closed form, not autodiff).

With z_s = softcap_s(student_logits), z_t = softcap_t(teacher_logits[..., :V_s]) (softcap c: c tanh(x / c), 0 = off),
u = z / T, ls = log_softmax(u_s), lt = log_softmax(u_t), p = exp(l), per row:
  beta == 0:  loss = sum_j p_t (lt - ls)                    KL(p_t || p_s), forward KL
  beta == 1:  loss = sum_j p_s (ls - lt)                    KL(p_s || p_t), reverse KL
  otherwise:  lm = log((1 - beta) p_s + beta p_t),  KLt = sum_j p_t (lt - lm),  KLs = sum_j p_s (ls - lm),
              loss = beta KLt + (1 - beta) KLs              TRL's generalized JSD
Terms whose probability is 0 (a -inf logit) contribute 0. d loss / d u_s:
  beta == 0:  p_s - p_t
  beta == 1:  p_s (ls - lt - loss)
  otherwise:  (1 - beta) p_s (ls - lm - KLs)
then / T, times the softcap factor 1 - tanh(x / c)^2, times the row's upstream. The teacher gets no gradient (the
packages treat it as a constant); its d loss / d u_t is returned here all the same (`teacher_grad`): it bounds how
far rounding errors in the teacher's logits move the loss (linear_jsd's tolerance), and test_reference_distill.py
checks it too. Rows whose label is ignore_index: loss 0, gradient 0, never read. A row holding NaN (or a +inf that
no softcap maps to a finite value) in either input: loss NaN and every gradient element of the row NaN.

test_reference_distill.py checks all of it against central finite differences and against float64 torch autograd
of TRL's generalized_jsd_loss formula (written there from its definition). NumPy only: it imports neither package.
Package tests: `from shared_tests.reference_distill import jsd as jsd_reference`; `loss, grad = jsd_reference(...)`
and `loss, d_hidden, d_weight, d_bias = linear_jsd(...)` unpack, and the results carry the error magnitudes that
tolerances.loss_bound / grad_bound turn into tolerances (the same field names as reference.Result).
"""

import math
from dataclasses import dataclass

import numpy as np

from .reference import chain_through_head, head_logits, logsumexp_rows


@dataclass
class JsdResult:
    reduction: str  # "mean", "sum" or "none"
    token_loss: np.ndarray  # (N,) per row: 0 where ignored, NaN for a NaN row
    loss: np.ndarray  # 0-d for "mean" / "sum", the leading shape for "none"
    grad: np.ndarray  # (..., V_s) d loss / d student_logits, upstream included
    teacher_grad: np.ndarray  # (..., V_s) d loss / d teacher_logits[..., :V_s] (no package returns it)
    upstream: np.ndarray  # (N,) d loss / d token_loss_t: 1 / count, 1, or the caller's cotangent
    counted: np.ndarray  # (N,) bool: rows that are not ignored
    lse_s: np.ndarray  # (N,) logsumexp of u_s (the kernels' saved statistics)
    lse_t: np.ndarray  # (N,) logsumexp of u_t
    loss_scale: np.ndarray  # (N,) the magnitude that bounds a float32 row loss's error (see error_scales)
    grad_scale: np.ndarray  # (..., V_s) the magnitude that bounds a float32 gradient element's error
    grad_terms: np.ndarray  # (..., V_s) the gradient element's size before the softcap factor

    def __iter__(self):  # loss, grad = jsd(...)
        return iter((self.loss, self.grad))


def softcap(x, cap):
    return cap * np.tanh(x / cap) if cap > 0.0 else x


def softcap_factor(x, cap):
    """d softcap(x) / dx: 1 - tanh(x / c)^2 (exactly 0 at +-inf), ones without softcapping."""
    if cap <= 0.0:
        return np.ones_like(x)
    t = np.tanh(x / cap)
    return 1.0 - t * t


def check_options(beta, temperature, reduction, student_softcapping, teacher_softcapping):
    assert not isinstance(beta, bool) and 0.0 <= beta <= 1.0, f"beta {beta!r}"
    assert temperature > 0.0 and math.isfinite(temperature), f"temperature {temperature!r}"
    assert reduction in ("mean", "sum", "none"), reduction
    assert student_softcapping >= 0.0 and teacher_softcapping >= 0.0


def row_terms(ls, lt, p_s, p_t, beta):
    """Per row: (loss, d loss / d u_s, d loss / d u_t, sum of |the loss's terms|, the gradient's term sizes)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if beta == 0.0:
            terms = np.where(p_t > 0, p_t * (lt - ls), 0.0)
            loss = terms.sum(axis=-1)
            d_s = p_s - p_t
            d_t = np.where(p_t > 0, p_t * (lt - ls - loss[:, None]), 0.0)
            sizes = p_s + p_t
        elif beta == 1.0:
            terms = np.where(p_s > 0, p_s * (ls - lt), 0.0)
            loss = terms.sum(axis=-1)
            d_s = np.where(p_s > 0, p_s * (ls - lt - loss[:, None]), 0.0)
            d_t = p_t - p_s
            sizes = np.where(p_s > 0, p_s * (2.0 + np.abs(ls - lt) + np.abs(loss)[:, None]), 0.0)
        else:
            lm = np.logaddexp(math.log1p(-beta) + ls, math.log(beta) + lt)
            kl_t_terms = np.where(p_t > 0, p_t * (lt - lm), 0.0)
            kl_s_terms = np.where(p_s > 0, p_s * (ls - lm), 0.0)
            kl_t, kl_s = kl_t_terms.sum(axis=-1), kl_s_terms.sum(axis=-1)
            terms = beta * np.abs(kl_t_terms) + (1.0 - beta) * np.abs(kl_s_terms)
            loss = beta * kl_t + (1.0 - beta) * kl_s
            d_s = (1.0 - beta) * np.where(p_s > 0, p_s * (ls - lm - kl_s[:, None]), 0.0)
            d_t = beta * np.where(p_t > 0, p_t * (lt - lm - kl_t[:, None]), 0.0)
            spread = np.abs(ls - lm) + np.abs(kl_s)[:, None]
            sizes = (1.0 - beta) * np.where(p_s > 0, p_s * (2.0 + spread), 0.0)
    return loss, d_s, d_t, np.abs(terms).sum(axis=-1), sizes


def error_scales(u_s, u_t, lse_s, lse_t, term_sum, sizes, student_softcapping, teacher_softcapping, temperature):
    """Magnitudes that bound a float32 implementation's rounding error, up to a small constant times eps32
    (tolerances.py's RTOL), in the style of reference.error_scales.

    M = M_s + M_t, M_x = 1 + |lse_x| + max_j |u_x,j| + c_x / T: ls and lt are computed with an absolute error of about
    eps32 M (u itself to eps32 max |u|, the softcap to eps32 c / T, lse to eps32 |lse| plus its sum), so each p_j
    carries a relative error of eps32 M. loss: every term p_j (difference of log-probabilities) gets eps32 (p_j M +
    |term_j|): scale M + sum_j |term_j|. Gradient: `sizes` are the absolute values of d loss / d u_s's terms with
    no cancellation credit, plus p_s twice for the errors of (ls - lt) and of the row constant (the loss or KLs,
    error eps32 about 2 M); scale M sizes. Both exclude the softcap factor 1 - tanh^2 (computed with an absolute
    error) and hold 1 / T (the chain rule's), but not the upstream (added by the caller)."""
    with np.errstate(invalid="ignore", over="ignore"):

        def magnitude(u, lse, cap):
            finite = np.where(np.isfinite(u), np.abs(u), 0.0)
            largest = finite.max(axis=-1) if u.shape[-1] and u.shape[0] else np.zeros(u.shape[0])
            return 1.0 + np.where(np.isfinite(lse), np.abs(lse), 0.0) + largest + cap / temperature

        m = magnitude(u_s, lse_s, student_softcapping) + magnitude(u_t, lse_t, teacher_softcapping)
        loss_scale = m + np.where(np.isfinite(term_sum), term_sum, 0.0)
        grad_terms = np.where(np.isfinite(sizes), sizes, 0.0) / temperature
    return loss_scale, m[:, None] * grad_terms, grad_terms


def jsd(
    student_logits,
    teacher_logits,
    labels=None,
    *,
    beta,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
    upstream=None,
):
    """The contract in float64. student_logits (..., V_s), teacher_logits (..., V_t) with V_t >= V_s (only its first
    V_s columns are read; the teacher's softmax is over them), labels (...) integers or None (every row counts; only
    `== ignore_index` is read from them). upstream: for "none" the cotangent of the per-row losses (leading shape,
    default ones); for "mean" / "sum" a number multiplying the loss's gradient (default 1). Pass exactly the values
    the kernels read (already rounded to the inputs' dtype)."""
    check_options(beta, temperature, reduction, student_softcapping, teacher_softcapping)
    xs_full = np.asarray(student_logits, np.float64)
    xt_full = np.asarray(teacher_logits, np.float64)
    lead, vocab = xs_full.shape[:-1], xs_full.shape[-1]
    assert xt_full.shape[:-1] == lead and xt_full.shape[-1] >= vocab, (xs_full.shape, xt_full.shape)
    n = math.prod(lead)
    xs = xs_full.reshape(n, vocab)
    xt = xt_full.reshape(n, xt_full.shape[-1])[:, :vocab]
    counted = np.ones(n, bool) if labels is None else np.asarray(labels).reshape(-1) != ignore_index
    assert counted.shape == (n,), "labels must have the logits' leading shape"
    # Ignored rows take no part in any arithmetic: their loss and gradient are exactly 0 even if they hold NaN.
    xs = np.where(counted[:, None], xs, 0.0)
    xt = np.where(counted[:, None], xt, 0.0)

    u_s = softcap(xs, student_softcapping) / temperature
    u_t = softcap(xt, teacher_softcapping) / temperature
    lse_s, lse_t = logsumexp_rows(u_s), logsumexp_rows(u_t)
    with np.errstate(invalid="ignore", over="ignore"):
        ls, lt = u_s - lse_s[:, None], u_t - lse_t[:, None]
        p_s, p_t = np.exp(ls), np.exp(lt)
    token, d_s, d_t, term_sum, sizes = row_terms(ls, lt, p_s, p_t, beta)
    # NaN / +inf anywhere in a counted row (or a row that is all -inf): the row's loss and gradient are NaN.
    bad = counted & ~(np.isfinite(lse_s) & np.isfinite(lse_t))
    token = np.where(counted, np.where(bad, np.nan, token), 0.0)

    if reduction == "none":
        g = np.ones(n) if upstream is None else np.asarray(upstream, np.float64).reshape(-1)
        loss = token.reshape(lead)
    else:
        scalar = 1.0 if upstream is None else float(upstream)
        den = float(max(1, int(counted.sum()))) if reduction == "mean" else 1.0
        g = np.full(n, scalar / den)
        loss = np.asarray(np.sum(token) / den)

    with np.errstate(invalid="ignore", over="ignore"):
        grad = d_s / temperature * softcap_factor(xs, student_softcapping) * g[:, None]
        teacher_grad = d_t / temperature * softcap_factor(xt, teacher_softcapping) * g[:, None]
    keep = counted[:, None] & ~bad[:, None]
    grad = np.where(keep, grad, np.where(bad[:, None], np.nan, 0.0))
    teacher_grad = np.where(keep, teacher_grad, np.where(bad[:, None], np.nan, 0.0))

    loss_scale, grad_scale, grad_terms = error_scales(
        u_s, u_t, lse_s, lse_t, term_sum, sizes, student_softcapping, teacher_softcapping, temperature
    )
    upstream_abs = np.abs(np.nan_to_num(g))[:, None]
    grad_scale = np.where(keep, grad_scale * upstream_abs, 0.0)
    grad_terms = np.where(keep, grad_terms * upstream_abs, 0.0)
    shape = (*lead, vocab)
    return JsdResult(
        reduction=reduction,
        token_loss=token,
        loss=loss,
        grad=grad.reshape(shape),
        teacher_grad=teacher_grad.reshape(shape),
        upstream=g,
        counted=counted,
        lse_s=np.where(counted, lse_s, 0.0),
        lse_t=np.where(counted, lse_t, 0.0),
        loss_scale=np.where(counted, loss_scale, 0.0),
        grad_scale=grad_scale.reshape(shape),
        grad_terms=grad_terms.reshape(shape),
    )


@dataclass
class LinearJsdResult:
    """linear_jsd in float64: `jsd` of the float64 logits h_s W_s^T + b_s and h_t W_t[:V_s]^T + b_t[:V_s]."""

    logits: JsdResult  # the loss and d loss / d student logits
    grad_hidden: np.ndarray  # (..., H_s)
    grad_weight: np.ndarray  # (V_s, H_s)
    grad_bias: np.ndarray | None  # (V_s,) or None without a student bias
    student_logits_abs: np.ndarray  # (N, V_s) |h_s| |W_s|^T + |b_s|: the size of each logit's products
    teacher_logits_abs: np.ndarray  # (N, V_s) the same for the teacher's first V_s columns

    def __iter__(self):  # loss, d_hidden, d_weight, d_bias = linear_jsd(...)
        return iter((self.logits.loss, self.grad_hidden, self.grad_weight, self.grad_bias))


def linear_jsd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels=None,
    *,
    student_bias=None,
    teacher_bias=None,
    upstream=None,
    **options,
):
    """student_hidden (..., H_s), student_weight (V_s, H_s), teacher_hidden (..., H_t), teacher_weight (V_t, H_t) with
    V_t >= V_s (its first V_s rows are used), biases (V,) or None; options: `jsd`'s keywords. The student's hidden,
    weight and bias gradients by the chain rule through the product; the teacher gets none."""
    vocab = np.shape(student_weight)[0]
    assert np.shape(teacher_weight)[0] >= vocab, "the teacher's vocabulary must be at least the student's"
    s_logits, s_abs, h, w, b, lead = head_logits(student_hidden, student_weight, student_bias)
    t_bias = None if teacher_bias is None else np.asarray(teacher_bias)[:vocab]
    t_logits, t_abs, _, _, _, t_lead = head_logits(teacher_hidden, np.asarray(teacher_weight)[:vocab], t_bias)
    assert t_lead == lead, "the teacher's hidden states must have the student's leading shape"
    result = jsd(s_logits.reshape(*lead, vocab), t_logits.reshape(*lead, vocab), labels, upstream=upstream, **options)
    grad_hidden, grad_weight, grad_bias = chain_through_head(result.grad, h, w, b, lead)
    return LinearJsdResult(result, grad_hidden, grad_weight, grad_bias, s_abs, t_abs)
