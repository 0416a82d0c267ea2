"""The loss contract's per-token formulas in plain jnp, differentiable by plain autodiff: the reference backend of
``cross_entropy`` and the jvp rules of the kernel launches (ops.py). The shared formulas (transform, row
statistics, the loss from statistics) are contract.py's, so the kernels' finish arithmetic and these agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import (
    NO_EXTRAS,
    Extras,
    Options,
    compute_dtype,
    ignore_value,
    label_weights,
    outputs_from_statistics,
    row_statistics,
    token_loss_from_statistics,
    transform,
    weighted_sum_z,
    weighted_token_loss,
)


def _transformed(logits, labels, options: Options):
    """z of logits (..., V) with ignored rows zeroed before any math, so their gradient is exactly 0 even when
    the row holds NaN/inf; float32 math (float64 for float64 logits)."""
    ign = ignore_value(labels.dtype, options.ignore_index)
    if ign is not None:
        logits = jnp.where((labels == ign)[..., None], jnp.zeros((), logits.dtype), logits)
    return transform(logits.astype(compute_dtype(logits.dtype)), options)


def softmax_mean_z(z, lse):
    """sum_j p_j z_j per row, -inf logits contributing 0; differentiable (the -inf columns are replaced before the
    product, so no 0 * inf reaches the gradient)."""
    p = jnp.exp(z - lse[..., None])
    finite_z = jnp.where(z == -jnp.inf, jnp.zeros((), z.dtype), z)
    return jnp.sum(p * finite_z, axis=-1)


def reference_row_outputs(logits, labels, options: Options, returns, weight=None):
    """(loss, lse, accuracy, entropy) per token of logits (..., V) in jnp, like reference_token_losses (whose loss
    it is); accuracy / entropy None unless asked for. lse and entropy are differentiable (z_loss is computed from
    lse; the entropy's gradient is p_j (mz - z_j) dz/dx); argmax is computed from stop_gradient(z)."""
    z = _transformed(logits, labels, options)
    lse, label_logit, sum_z = row_statistics(z, labels, options)
    if weight is None:
        loss = token_loss_from_statistics(lse, label_logit, sum_z, labels, options, z.shape[-1])
    else:
        loss = _weighted_reference_loss(z, lse, label_logit, labels, options, weight)
    argmax = jnp.argmax(jax.lax.stop_gradient(z), axis=-1) if returns.accuracy else None
    mean_z = softmax_mean_z(z, lse) if returns.entropy else None
    accuracy, entropy = outputs_from_statistics(lse, argmax, mean_z, labels, options, z.shape[-1])
    if accuracy is not None:
        accuracy = jax.lax.stop_gradient(accuracy)
    return loss, lse, accuracy, entropy


def reference_token_losses(logits, labels, options: Options, weight=None):
    """Per-token losses of logits (..., V), labels (...) in jnp (no reshape, so any sharding of the leading axes
    stays where it is): float32 math and losses, float64 for float64 logits. Differentiable by plain autodiff.
    weight: class weights (V,) or None."""
    z = _transformed(logits, labels, options)
    lse, label_logit, sum_z = row_statistics(z, labels, options)
    if weight is not None:
        return _weighted_reference_loss(z, lse, label_logit, labels, options, weight)
    return token_loss_from_statistics(lse, label_logit, sum_z, labels, options, z.shape[-1])


def _weighted_reference_loss(z, lse, label_logit, labels, options: Options, weight):
    vocab = z.shape[-1]
    weight = weight.astype(z.dtype)
    sum_wz = weighted_sum_z(z, weight) if options.label_smoothing != 0.0 else jnp.zeros_like(lse)
    w_label = label_weights(labels, weight, vocab)
    return weighted_token_loss(lse, label_logit, sum_wz, w_label, jnp.sum(weight), labels, options, vocab)


def reference_backward(logits, labels, g, options: Options, g_lse=None, weight=None, g_entropy=None):
    """d(sum_t g_t loss_t + sum_t g_lse_t lse_t + sum_t g_entropy_t H_t)/d logits of reference_row_outputs (g,
    g_lse, g_entropy shaped like labels; g_lse / g_entropy None: without that term); weight: class weights or
    None."""
    if g_lse is None and g_entropy is None:
        _, vjp = jax.vjp(lambda x: reference_token_losses(x, labels, options, weight), logits)
        return vjp(g.astype(jnp.float32))[0]
    returns = NO_EXTRAS if g_entropy is None else Extras(entropy=True)

    def outputs(x):
        loss, lse, _, entropy = reference_row_outputs(x, labels, options, returns, weight)
        return (loss, lse) + (() if entropy is None else (entropy,))

    out, vjp = jax.vjp(outputs, logits)
    cotangents = [g.astype(out[0].dtype), jnp.zeros_like(out[1]) if g_lse is None else g_lse.astype(out[1].dtype)]
    if g_entropy is not None:
        cotangents.append(g_entropy.astype(out[2].dtype))
    return vjp(tuple(cotangents))[0]
