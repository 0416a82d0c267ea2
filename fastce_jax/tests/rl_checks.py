"""float64 expectations for the RL features (temperature, token weights, the entropy's gradient, log_probs) built
on the repository's float64 reference (shared_tests/reference.py) and its tolerance model.

The temperature is applied literally, z = softcap(scale * x) / T (the reference's transform, then / T, and dz/dx
likewise), never through the packages' fold into the options; the error scales are the reference's for the folded
options (the magnitudes a float32 computation of the same z rounds). The entropy's gradient dH/dz_j =
p_j (mz - z_j) (mz = sum_j p_j z_j = lse - H) is added to the loss's with its own error scale."""

import dataclasses

import numpy as np

from shared_tests import reference

from .checks import as_float64


def _literal_z(x, opts, temperature):
    """(z, dz/dx) of float64 logits x (N, V): softcap(scale * x) / T and its derivative."""
    return reference.transform(x, opts) / temperature, reference.dz_dx(x, opts) / temperature


def folded(temperature, **options):
    """The options with the temperature folded in (what the packages pass their kernels), for the error scales."""
    if temperature == 1.0:
        return options
    scaling = options.get("logit_scaling", 0.0) or 1.0
    return dict(
        options,
        logit_scaling=scaling / temperature,
        logit_softcapping=options.get("logit_softcapping", 0.0) / temperature,
    )


def entropy_and_gradient(logits, labels, upstream, ignore_index=-100, temperature=1.0, **options):
    """(H per token, mz per token, g_H * dH/dx, error scale of that gradient, error scale of H) in float64 for
    logits (N, V) as the kernels read them; ignored rows: H 0 and gradient 0; upstream: g_H per token."""
    opts = reference.Options(ignore_index=ignore_index, **options)
    y = np.asarray(labels)
    ignored = y == ignore_index
    x = np.where(ignored[:, None], 0.0, as_float64(logits))
    z, dz = _literal_z(x, opts, temperature)
    lse = reference.logsumexp_rows(z)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        finite_z = np.where(z == -np.inf, 0.0, z)
        mz = np.sum(p * finite_z, axis=-1)
        g = np.asarray(upstream, np.float64)[:, None]
        grad = np.where(ignored[:, None], 0.0, p * (mz[:, None] - finite_z) * dz * g)
        # float32 error: p_j carries a relative error ~ eps32 * M_t (M_t as in reference.error_scales), mz - z_j an
        # absolute one ~ eps32 (|mz| + |z_j| + |lse|).
        zmax = np.max(np.where(np.isfinite(z), np.abs(z), 0.0), axis=-1)
        m = 1.0 + np.abs(lse) + zmax + opts.logit_softcapping / temperature
        s = (abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0) / temperature
        scale = m[:, None] * p * (np.abs(mz[:, None] - finite_z) + np.abs(mz)[:, None] + np.abs(finite_z) + 1.0)
        scale = scale * s * np.abs(g)
    entropy = np.where(ignored, 0.0, lse - mz)
    entropy_scale = np.where(ignored, 0.0, m + np.abs(mz) + np.abs(lse))
    return entropy, np.where(ignored, 0.0, mz), grad, np.where(ignored[:, None], 0.0, scale), entropy_scale


def with_entropy_gradient(ref, logits, labels, upstream, **options):
    """The reference result `ref` (shared_tests.reference.Result, 2-D logits) with the entropy's gradient (per-token
    upstream g_H) added to its gradient and its error scale to the gradient's."""
    _, _, grad, scale, _ = entropy_and_gradient(logits, labels, upstream, **options)
    total = np.where(np.isnan(ref.grad), np.nan, ref.grad + grad.reshape(ref.grad.shape))
    return dataclasses.replace(ref, grad=total, grad_scale=ref.grad_scale + scale.reshape(ref.grad.shape))


def with_lse_gradient(ref, logits, labels, upstream, ignore_index=-100, **options):
    """`ref` with g_lse * d lse / dx = g_lse * p * dz/dx added (the gradient a differentiated z_loss output sends
    through lse), and its error scale."""
    opts = reference.Options(ignore_index=ignore_index, **options)
    y = np.asarray(labels)
    ignored = (y == ignore_index)[:, None]
    x = np.where(ignored, 0.0, as_float64(logits))
    z = reference.transform(x, opts)
    lse = reference.logsumexp_rows(z)
    g = np.asarray(upstream, np.float64)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        grad = np.where(ignored, 0.0, p * reference.dz_dx(x, opts) * g)
        zmax = np.max(np.where(np.isfinite(z), np.abs(z), 0.0), axis=-1)
        m = 1.0 + np.abs(lse) + zmax + opts.logit_softcapping
        s = abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0
        scale = np.where(ignored, 0.0, m[:, None] * p * s * np.abs(g))
    total = np.where(np.isnan(ref.grad), np.nan, ref.grad + grad.reshape(ref.grad.shape))
    return dataclasses.replace(ref, grad=total, grad_scale=ref.grad_scale + scale.reshape(ref.grad.shape))


@dataclasses.dataclass
class Expected:
    loss: reference.Result  # the (token-weighted) loss and the gradient of loss + entropy term, with error scales
    entropy: reference.Result | None  # the entropy output (reduced like the loss) as a Result for assert_loss


def expected_rl(
    logits,
    labels,
    reduction="none",
    *,
    upstream=None,
    n_items=None,
    temperature=1.0,
    token_weights=None,
    entropy_upstream=None,
    weight=None,
    **options,
):
    """The float64 result of cross_entropy(logits, labels, reduction=..., temperature=..., token_weights=...,
    return_entropy=True) for logits (N, V) (the values the kernels read), differentiated with cotangent
    `upstream` of the loss ("none": per token; else a scalar, default 1) and `entropy_upstream` of the entropy
    output (same shapes as the loss; None: not differentiated)."""
    x = as_float64(logits)
    y = np.asarray(labels).reshape(-1)
    ignore_index = options.get("ignore_index", -100)
    ignored = y == ignore_index
    w = np.ones(y.shape) if token_weights is None else np.asarray(token_weights, np.float64).reshape(-1)
    if reduction == "none":
        base = np.ones(y.shape) if upstream is None else np.asarray(upstream, np.float64).reshape(-1)
        den = 1.0
    else:
        den = reference.denominator(y, reduction, n_items, ignore_index, weight)
        base = np.full(y.shape, (1.0 if upstream is None else float(upstream)) / den)
    g = np.where(ignored, 0.0, base * w)
    # The loss on literally transformed logits: the reference without scaling / softcapping on z, then dz/dx.
    opts = reference.Options(**options)
    plain = dict(options, logit_scaling=0.0, logit_softcapping=0.0)
    z, dz = _literal_z(np.where(ignored[:, None], 0.0, x), opts, temperature)
    literal = reference.cross_entropy(
        z, y, reduction="none", upstream=g, opts=reference.Options(**plain), weight=weight
    )
    scales = reference.expected(x, y, "none", upstream=g, weight=weight, **folded(temperature, **options))
    # The fold is exact algebra: the folded reference's values agree with the literal ones.
    np.testing.assert_allclose(scales.token_loss, literal.token_loss, rtol=1e-9, atol=1e-12)
    token = np.where(ignored, 0.0, literal.token_loss * w)
    loss = token.reshape(np.shape(labels)) if reduction == "none" else np.asarray(np.sum(token) / den)
    grad = literal.grad * dz
    grad_scale = scales.grad_scale
    # The entropy output and its gradient (zero without entropy_upstream).
    if reduction == "none":
        g_h = np.zeros(y.shape) if entropy_upstream is None else np.asarray(entropy_upstream, np.float64)
        g_h = g_h.reshape(-1)
        h_den = 1.0
    else:
        h_den = reference.denominator(y, reduction, n_items, ignore_index)
        g_h = np.full(y.shape, (0.0 if entropy_upstream is None else float(entropy_upstream)) / h_den)
    h, _, h_grad, h_scale, h_err = entropy_and_gradient(x, y, g_h, temperature=temperature, **options)
    grad = np.where(np.isnan(grad), np.nan, grad + h_grad)
    grad_scale = grad_scale + h_scale
    h_value = h.reshape(np.shape(labels)) if reduction == "none" else np.asarray(np.sum(h) / h_den)
    entropy = dataclasses.replace(
        scales, reduction=reduction, token_loss=h, loss=h_value, upstream=np.full(y.shape, 1.0 / h_den),
        loss_scale=h_err,
    )  # fmt: skip
    result = dataclasses.replace(
        scales, reduction=reduction, token_loss=token, loss=loss, grad=grad, grad_scale=grad_scale,
        upstream=np.abs(base), loss_scale=scales.loss_scale * np.abs(w),
    )  # fmt: skip
    return Expected(result, entropy)
