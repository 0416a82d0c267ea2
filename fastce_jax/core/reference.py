"""The loss contract's formulas in plain jnp (CONTRACT.md), shared by the kernels and the reference:

* the per-row formulas the Pallas kernels trace in their finish arithmetic and every jnp path uses (transform,
  row_statistics, token_loss_from_statistics, weighted_token_loss, outputs_from_statistics): one place, so the
  kernels and the reference agree;
* the reference itself, differentiable by plain autodiff: the reference backend of ``cross_entropy``, the non-GPU
  branch of a platform-dependent trace and the jvp rules of the kernel launches (reference_token_losses,
  reference_row_outputs, reference_backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .options import NO_EXTRAS, Extras, Options, ignore_value, label_weights

__all__ = [
    "compute_dtype",
    "transform",
    "row_statistics",
    "token_loss_from_statistics",
    "weighted_token_loss",
    "weighted_sum_z",
    "outputs_from_statistics",
    "softmax_mean_z",
    "reference_row_outputs",
    "reference_token_losses",
    "reference_backward",
]

# ----------------------------------------------------------------------------------------------------------------
# The per-row formulas (also traced inside the Pallas kernels).
# ----------------------------------------------------------------------------------------------------------------


def compute_dtype(dtype):
    """The dtype the loss is computed and returned in: float64 for float64 logits, float32 for every other dtype."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def transform(logits, options: Options):
    """z(x): Cohere scaling, then Gemma-2 softcapping (a zero option removes its code)."""
    z = logits
    if options.logit_scaling != 0.0:
        z = z * options.logit_scaling
    if options.logit_softcapping > 0.0:
        # jnp.tanh lowers to libdevice __nv_tanhf on Triton and maps -inf to -1, so -inf padding becomes -softcap
        # with a zero derivative.
        z = options.logit_softcapping * jnp.tanh(z * (1.0 / options.logit_softcapping))
    return z


def row_statistics(z, labels, options: Options, vocab_start=0):
    """(lse, label_logit, sum_z) of transformed logits z (..., V_local) holding columns [vocab_start, vocab_start +
    V_local): the row's logsumexp, z at the label where these columns hold it (else 0), and the sum of z (0 without
    label smoothing)."""
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)  # an all -inf row shifts by 0, as in the kernels; +inf gives NaN
    lse = m[..., 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    column = labels - vocab_start
    here = (column >= 0) & (column < z.shape[-1])
    label_logit = jnp.take_along_axis(z, jnp.where(here, column, 0).astype(jnp.int32)[..., None], axis=-1)[..., 0]
    label_logit = jnp.where(here, label_logit, 0.0)
    sum_z = jnp.sum(z, axis=-1) if options.label_smoothing != 0.0 else jnp.zeros_like(lse)
    return lse, label_logit, sum_z


def token_loss_from_statistics(lse, label_logit, sum_z, labels, options: Options, vocab: int):
    """The contract's per-token loss from a row's global statistics, the same arithmetic as the finish kernel:
    ``(1 - eps)(lse - z_y) + eps (lse - sum_z / V) + z_loss lse**2``; NaN for a label outside [0, V), 0 where
    ignored."""
    smoothing = options.label_smoothing
    loss = jnp.zeros_like(lse)
    if smoothing != 1.0:
        loss = loss + (1.0 - smoothing) * (lse - label_logit)
    if smoothing != 0.0:
        loss = loss + smoothing * (lse - sum_z * (1.0 / vocab))
    if options.z_loss != 0.0:
        loss = loss + options.z_loss * lse * lse
    # Multiply (not where) so an out-of-range row's gradient is NaN too.
    loss = loss * jnp.where((labels >= 0) & (labels < vocab), jnp.ones_like(loss), jnp.full_like(loss, jnp.nan))
    ign = ignore_value(labels.dtype, options.ignore_index)
    return loss if ign is None else jnp.where(labels == ign, 0.0, loss)


def weighted_token_loss(lse, label_logit, sum_wz, w_label, w_sum, labels, options: Options, vocab: int):
    """token_loss_from_statistics with class weights (F.cross_entropy's weight=), the finish kernel's arithmetic:
    ``w_y (1 - eps)(lse - z_y) + (eps / V)(W lse - sum_c w_c z_c) + w_y z_loss lse**2`` from w_label = w[y],
    w_sum = W = sum_c w_c and sum_wz = sum_c w_c z_c (a class of weight 0 left out even where z is -inf)."""
    smoothing = options.label_smoothing
    loss = jnp.zeros_like(lse)
    if smoothing != 1.0:
        loss = loss + (1.0 - smoothing) * w_label * (lse - label_logit)
    if smoothing != 0.0:
        loss = loss + smoothing * (1.0 / vocab) * (w_sum * lse - sum_wz)
    if options.z_loss != 0.0:
        loss = loss + options.z_loss * w_label * lse * lse
    loss = loss * jnp.where((labels >= 0) & (labels < vocab), jnp.ones_like(loss), jnp.full_like(loss, jnp.nan))
    ign = ignore_value(labels.dtype, options.ignore_index)
    return loss if ign is None else jnp.where(labels == ign, 0.0, loss)


def weighted_sum_z(z, weight):
    """sum_c w_c z_c per row, a class of weight 0 adding nothing (even where its z is -inf)."""
    return jnp.sum(jnp.where(weight == 0.0, 0.0, weight * z), axis=-1)


def outputs_from_statistics(lse, argmax, mean_z, labels, options: Options, vocab: int):
    """(accuracy, entropy) per token from a row's global statistics, the same arithmetic as the finish kernel;
    argmax: the first column holding the row's largest z (None: no accuracy); mean_z: sum_j p_j z_j, -inf logits
    contributing 0 (None: no entropy). Accuracy is 1.0 / 0.0, NaN for a label outside [0, V) or a row whose lse is
    NaN (it holds NaN or +inf); entropy is lse - mean_z; both are 0 where ignored."""
    ign = ignore_value(labels.dtype, options.ignore_index)
    accuracy = entropy = None
    if argmax is not None:
        valid = (labels >= 0) & (labels < vocab) & (lse == lse)
        # Typed constants: the Triton lowering cannot make an integer-typed NaN.
        hit = (argmax == labels).astype(lse.dtype)
        accuracy = jnp.where(valid, hit, jnp.full_like(lse, jnp.nan))
        if ign is not None:
            accuracy = jnp.where(labels == ign, jnp.zeros_like(lse), accuracy)
    if mean_z is not None:
        entropy = lse - mean_z
        if ign is not None:
            entropy = jnp.where(labels == ign, 0.0, entropy).astype(lse.dtype)
    return accuracy, entropy


# ----------------------------------------------------------------------------------------------------------------
# The reference: per-token losses and outputs of whole logits, and their gradient.
# ----------------------------------------------------------------------------------------------------------------


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
