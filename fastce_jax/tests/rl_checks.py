"""float64 expectations of the RL features (temperature, token weights, the entropy's gradient, log_probs) for the
JAX tests: the repository's one reference (shared_tests/reference.py: reference.differentiated, entropy_grad) on the
values the kernels read, as its Results (checks.assert_loss / assert_grad take them)."""

import dataclasses

import numpy as np

from shared_tests import reference

from .checks import as_float64


@dataclasses.dataclass
class Expected:
    loss: reference.Result  # the (token-weighted) loss and the gradient of loss + entropy term, with error scales
    entropy: reference.Result  # the entropy output (reduced like the loss) as a Result for assert_loss


def expected_rl(
    logits, labels, reduction="none", *, upstream=None, n_items=None, temperature=1.0, token_weights=None,
    entropy_upstream=None, weight=None, **options,
):  # fmt: skip
    """The float64 result of cross_entropy(logits, labels, reduction=..., temperature=..., token_weights=...,
    return_entropy=True), differentiated with cotangent `upstream` of the loss ("none": per token; else a scalar,
    default 1) and `entropy_upstream` of the entropy output (same shapes; None: not differentiated)."""
    ref = reference.differentiated(
        as_float64(logits), np.asarray(labels), reduction=reduction, n_items=n_items,
        opts=reference.Options(temperature=temperature, **options),
        weight=None if weight is None else np.asarray(weight, np.float64),
        token_weights=None if token_weights is None else np.asarray(token_weights, np.float64),
        upstream=(1.0 if upstream is None else upstream, 0.0, 0.0 if entropy_upstream is None else entropy_upstream),
    )  # fmt: skip
    return Expected(ref.loss, ref.entropy)


def mean_z(logits, labels, **options):
    """mz = sum_j p_j z_j = lse - H per row (what the forward kernels give the entropy's backward); 0 where ignored."""
    out = reference.outputs(as_float64(logits), np.asarray(labels), reduction="none", opts=reference.Options(**options))
    return np.where(np.isfinite(out.lse), out.lse - out.entropy, 0.0)


def with_entropy_gradient(ref, logits, labels, upstream, **options):
    """The reference result `ref` (2-D logits) with g_H * dH/dx (reference.entropy_grad, per-token upstream g_H)
    added to its gradient and the entropy's error scale to the gradient's."""
    grad, scale, _ = reference.entropy_grad(
        as_float64(logits), np.asarray(labels), upstream=np.asarray(upstream, np.float64),
        opts=reference.Options(**options),
    )  # fmt: skip
    return dataclasses.replace(ref, grad=ref.grad + grad, grad_scale=ref.grad_scale + scale)


def with_lse_gradient(ref, logits, labels, upstream, ignore_index=-100, **options):
    """`ref` with g_lse * d lse / dx = g_lse * p * dz/dx added (the gradient a differentiated z_loss output sends
    through lse; reference.transform / dz_dx / logsumexp_rows), and its error scale (M_t p_j |s| |g|)."""
    opts = reference.Options(ignore_index=ignore_index, **options)
    ignored = (np.asarray(labels) == ignore_index)[:, None]
    x = np.where(ignored, 0.0, as_float64(logits))
    z = reference.transform(x, opts)
    lse = reference.logsumexp_rows(z)
    g = np.asarray(upstream, np.float64)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        grad = np.where(ignored, 0.0, p * reference.dz_dx(x, opts) * g)
        zmax = np.max(np.where(np.isfinite(z), np.abs(z), 0.0), axis=-1)
        m = 1.0 + np.abs(lse) + zmax + opts.logit_softcapping  # M_t, as reference.error_scales
        s = abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0
        scale = np.where(ignored, 0.0, m[:, None] * p * s * np.abs(g))
    return dataclasses.replace(ref, grad=ref.grad + grad, grad_scale=ref.grad_scale + scale)
