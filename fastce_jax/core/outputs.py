"""The output records and the call's result from per-token values (CONTRACT.md "Extra outputs"): CrossEntropyOutput,
LogProbOutput and PolicyLossOutput, the reduced loss, the z_loss, lse, accuracy and entropy outputs, and per-token
weights (token_weights) applied to the loss and its z-loss term."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .options import Options, ignore_value, label_weights, reduce_losses

__all__ = [
    "CrossEntropyOutput",
    "LogProbOutput",
    "PolicyLossOutput",
    "weigh_tokens",
    "z_loss_from_lse",
    "reduce_outputs",
    "with_outputs",
]


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` / ``linear_cross_entropy`` return when any return_* keyword is True: the loss (as
    without them; it still includes the z-loss term) and the outputs asked for, None for the others (CONTRACT.md
    "Extra outputs"). ``loss``, ``z_loss`` and ``entropy`` are differentiable; lse and accuracy carry a zero
    gradient (stop_gradient)."""

    loss: jax.Array
    z_loss: jax.Array | None = None
    lse: jax.Array | None = None
    accuracy: jax.Array | None = None
    entropy: jax.Array | None = None


class LogProbOutput(NamedTuple):
    """What ``log_probs`` / ``linear_log_probs`` return with return_entropy=True: float32 log p(token) and the
    entropy of softmax(z) per token, both shaped like the (shifted) tokens, 0 where the token is ignored; both
    differentiable."""

    logprobs: jax.Array
    entropy: jax.Array


class PolicyLossOutput(NamedTuple):
    """What ``linear_policy_loss`` returns: the 0-d float32 loss (differentiable) and the metrics TRL's GRPOTrainer
    logs, detached float32 scalars, masked means over the call's mask: the KL to the reference policy (0 when
    beta == 0), the entropy, and the fractions of tokens whose ratio was clipped low, high, or either."""

    loss: jax.Array
    kl: jax.Array
    entropy: jax.Array
    clip_ratio_low: jax.Array
    clip_ratio_high: jax.Array
    clip_ratio_region: jax.Array


def weigh_tokens(values, labels, token_weights, ignore_index: int):
    """values * token_weights per token (shaped like labels), 0 where the label is ignore_index whatever its
    weight (a NaN weight makes only a kept token NaN); values unchanged when token_weights is None."""
    if token_weights is None:
        return values
    weighted = values * token_weights.astype(values.dtype)
    ign = ignore_value(labels.dtype, ignore_index)
    return weighted if ign is None else jnp.where(labels == ign, jnp.zeros((), values.dtype), weighted)


def z_loss_from_lse(lse, labels, options: Options, vocab: int):
    """z_loss * lse**2 per token, differentiable in lse: NaN for a label outside [0, V) (its gradient too), 0 where
    ignored (that row's lse, -inf from the kernels, is replaced before squaring so no 0 * inf reaches the gradient)."""
    ign = ignore_value(labels.dtype, options.ignore_index)
    if ign is not None:
        lse = jnp.where(labels == ign, 0.0, lse).astype(lse.dtype)
    term = options.z_loss * lse * lse
    term = term * jnp.where((labels >= 0) & (labels < vocab), jnp.ones_like(term), jnp.full_like(term, jnp.nan))
    return term if ign is None else jnp.where(labels == ign, 0.0, term).astype(term.dtype)


def reduce_outputs(
    token_losses,
    lse,
    accuracy,
    entropy,
    labels,
    reduction: str,
    n_items,
    options: Options,
    returns,
    vocab: int,
    weight=None,
    *,
    token_weights=None,
    entropy_grad=False,
):
    """The call's result from per-token values shaped like labels: the reduced loss alone when no extra output was
    asked for, else a CrossEntropyOutput (see with_outputs). token_weights: per-token weights shaped like labels
    (each token's loss, and its z-loss term, multiplied before the reduction; the divisor unchanged) or None."""
    token_losses = weigh_tokens(token_losses.reshape(labels.shape), labels, token_weights, options.ignore_index)
    loss = reduce_losses(token_losses, labels, reduction, n_items, options.ignore_index, weight)
    if not returns:
        return loss
    return with_outputs(
        loss, lse, accuracy, entropy, labels, reduction, n_items, options, returns, vocab, weight,
        token_weights=token_weights, entropy_grad=entropy_grad,
    )  # fmt: skip


def with_outputs(
    loss,
    lse,
    accuracy,
    entropy,
    labels,
    reduction: str,
    n_items,
    options: Options,
    returns,
    vocab: int,
    weight=None,
    *,
    token_weights=None,
    entropy_grad=False,
):
    """CrossEntropyOutput of the (reduced) loss and per-token lse / accuracy / entropy (None where not computed):
    z_loss and entropy reduced like the loss, accuracy the fraction over non-ignored rows for "mean" / "sum", lse
    per token, -inf where ignored. lse, accuracy and entropy leave through stop_gradient; z_loss is differentiable
    through lse. weight: class weights or None: z_loss is then the loss's weighted term (w[y] z_loss lse**2 over
    the loss's weighted divisor); lse, accuracy and entropy ignore them. token_weights: per-token weights or None:
    z_loss is weighted like the loss's term, the others are not. entropy_grad: the entropy output keeps its
    gradient (the caller's backward handles it) instead of leaving through stop_gradient."""
    ignore_index = options.ignore_index
    ign = ignore_value(labels.dtype, ignore_index)
    ignored = jnp.zeros(labels.shape, bool) if ign is None else labels == ign
    lse = lse.reshape(labels.shape)
    out = CrossEntropyOutput(loss)
    if returns.z_loss:
        z_term = z_loss_from_lse(lse, labels, options, vocab)
        if weight is not None:
            z_term = z_term * label_weights(labels, weight, vocab).astype(z_term.dtype)
        z_term = weigh_tokens(z_term, labels, token_weights, ignore_index)
        out = out._replace(z_loss=reduce_losses(z_term, labels, reduction, n_items, ignore_index, weight))
    if returns.lse:
        out = out._replace(lse=jax.lax.stop_gradient(jnp.where(ignored, -jnp.inf, lse).astype(lse.dtype)))
    if returns.accuracy:
        acc = jax.lax.stop_gradient(accuracy.reshape(labels.shape))
        if reduction != "none":
            acc = jnp.sum(acc) / jnp.maximum(jnp.sum(~ignored), 1).astype(acc.dtype)
        out = out._replace(accuracy=acc)
    if returns.entropy:
        ent = entropy.reshape(labels.shape)
        ent = ent if entropy_grad else jax.lax.stop_gradient(ent)
        out = out._replace(entropy=reduce_losses(ent, labels, reduction, n_items, ignore_index))
    return out
