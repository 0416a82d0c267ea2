"""float64 expectations for the RL features (temperature, token weights, the entropy's gradient, log_probs) built
on the repository's float64 reference (shared_tests/reference.py) and its tolerance model: the entropy's gradient
dH/dz_j = p_j (mz - z_j) (mz = sum_j p_j z_j = lse - H) is added to the reference's loss gradient, with its own
error scale."""

import dataclasses

import numpy as np

from shared_tests import reference

from .checks import as_float64


def entropy_and_gradient(logits, labels, upstream, ignore_index=-100, **options):
    """(H per token, mz per token, g_H * dH/dx, error scale of that gradient) in float64 for logits (N, V) as the
    kernels read them; ignored rows: H 0 and gradient 0; upstream: g_H per token."""
    opts = reference.Options(ignore_index=ignore_index, **options)
    x = as_float64(logits)
    y = np.asarray(labels)
    ignored = y == ignore_index
    x = np.where(ignored[:, None], 0.0, x)
    z = reference.transform(x, opts)
    lse = reference.logsumexp_rows(z)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(z - lse[:, None])
        finite_z = np.where(z == -np.inf, 0.0, z)
        mz = np.sum(p * finite_z, axis=-1)
        dh_dz = p * (mz[:, None] - finite_z)
        g = np.asarray(upstream, np.float64)[:, None]
        grad = np.where(ignored[:, None], 0.0, dh_dz * reference.dz_dx(x, opts) * g)
        # float32 error: p_j carries a relative error ~ eps32 * M_t (M_t as in reference.error_scales), mz - z_j an
        # absolute one ~ eps32 (|mz| + |z_j| + |lse|).
        zmax = np.max(np.where(np.isfinite(z), np.abs(z), 0.0), axis=-1)
        m = 1.0 + np.abs(lse) + zmax + opts.logit_softcapping
        s = abs(opts.logit_scaling) if opts.logit_scaling != 0.0 else 1.0
        scale = m[:, None] * p * (np.abs(mz[:, None] - finite_z) + np.abs(mz)[:, None] + np.abs(finite_z) + 1.0)
        scale = scale * s * np.abs(g)
    entropy = np.where(ignored, 0.0, lse - mz)
    return entropy, np.where(ignored, 0.0, mz), grad, np.where(ignored[:, None], 0.0, scale)


def with_entropy_gradient(ref, logits, labels, upstream, **options):
    """The reference result `ref` (shared_tests.reference.Result, 2-D logits) with the entropy's gradient (per-token
    upstream g_H) added to its gradient and its error scale to the gradient's."""
    _, _, grad, scale = entropy_and_gradient(logits, labels, upstream, **options)
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
