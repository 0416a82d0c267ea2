"""The public ``cross_entropy`` and ``cross_entropy_reference``: the argument checks (core/options.py,
core/token_inputs.py), the route (the kernels or the jnp reference) and the call of the kernel path
(autograd.kernel_loss). The loss contract is CONTRACT.md at the repository root.
"""

from __future__ import annotations

import jax.numpy as jnp

from ...core import token_inputs
from ...core.launch import quiet_triton
from ...core.options import (
    INTERPRETED,
    NO_EXTRAS,
    Options,
    check_class_weight,
    check_extras,
    check_flag,
    check_float_array,
    check_labels,
    check_n_items,
    check_options,
    route,
)
from ...core.options import (
    validate_labels as check_label_values,
)
from ...core.outputs import reduce_outputs
from ...core.reference import reference_row_outputs, reference_token_losses
from . import autograd
from .launch import backward_config, forward_config

__all__ = ["cross_entropy", "cross_entropy_reference"]

# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def _cross_entropy(
    logits,
    labels,
    options: Options,
    reduction,
    n_items,
    backend,
    inplace_backward,
    returns=NO_EXTRAS,
    weight=None,
    token_weights=None,
):
    """The loss of checked arguments (labels from check_labels, token_weights from
    token_inputs.check_token_weights, aligned with the labels); a CrossEntropyOutput when ``returns`` asks for any
    extra output."""
    path = route(logits, backend)
    logits = jnp.asarray(logits)
    if logits.dtype == jnp.float64:
        # The kernels compute in float32: float64 logits (which exist only with x64 on; without it jnp.asarray made
        # them float32 above) go to the reference, computed in float64, whatever the backend says.
        path = "reference"
    labels = jnp.asarray(labels)
    if path == "reference" or labels.size == 0:  # an empty grid has no kernel
        if returns:
            loss, lse, accuracy, entropy = reference_row_outputs(logits, labels, options, returns, weight)
        else:
            loss, lse, accuracy, entropy = reference_token_losses(logits, labels, options, weight), *[None] * 3
        return reduce_outputs(
            loss, lse, accuracy, entropy, labels, reduction, n_items, options, returns, logits.shape[-1], weight,
            token_weights=token_weights, entropy_grad=True,
        )  # fmt: skip
    vocab = logits.shape[-1]
    configs = (forward_config(vocab), backward_config(vocab))
    with quiet_triton(interpret=path == INTERPRETED):
        return autograd.kernel_loss(
            logits,
            labels,
            n_items,
            weight,
            token_weights,
            options=options,
            reduction=reduction,
            inplace=inplace_backward,
            mode=path,
            configs=configs,
            returns=returns,
        )


def cross_entropy(
    logits,
    labels,
    *,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    inplace_backward=True,
    validate_labels=False,
    shift=0,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    weight=None,
    temperature=1.0,
    token_weights=None,
    where=None,
):
    """Cross-entropy of ``logits`` (..., V) against integer ``labels`` (...).

    Per token, with z the (scaled, softcapped) logits and lse = logsumexp(z):
    ``(1 - eps)(lse - z_y) + eps (lse - mean(z)) + z_loss * lse**2``; see
    CONTRACT.md for every rule (ignore_index, NaN for out-of-range labels,
    -inf logits, reductions, n_items).

    Args:
      logits: float32/bfloat16/float16 array (..., V); float64 (with x64 on) is computed in float64 by the
        jnp reference whatever ``backend`` says (a float64 loss and gradient).
      labels: int32/int64 array shaped like ``logits.shape[:-1]``.
      ignore_index: label value whose tokens get loss 0 and gradient 0.
      reduction: "mean" (over non-ignored tokens, or over ``n_items``), "sum"
        or "none" (per-token losses shaped like ``labels``).
      n_items: optional denominator for "mean" and "sum": a Python number > 0 or a 0-d
        (possibly traced) array, e.g. transformers' ``num_items_in_batch``.
      logit_softcapping: t > 0 applies ``z = t * tanh(z / t)`` (Gemma 2).
      logit_scaling: s != 0 applies ``z = s * z`` first (Cohere).
      label_smoothing: eps in [0, 1].
      z_loss: coefficient of ``lse**2``.
      backend: "auto" (kernels for GPU arrays, the jnp reference elsewhere),
        "kernel" (Pallas kernels always; interpret mode off GPU) or "reference".
        Under jit/grad/vmap in a process with a GPU backend, "auto" decides
        when the computation is lowered, by the platform it runs on
        (``jax.lax.platform_dependent``); "kernel" there means the compiled
        kernels.  Reverse mode runs the kernels; derivatives of those
        derivatives (grad of grad, jax.hessian, jvp of grad) are the
        reference's, exact. Forward mode on the loss itself (jax.jvp,
        jax.linearize, jax.jacfwd) raises JAX's TypeError for a custom_vjp
        function: use backend="reference" for it.
      inplace_backward: let the backward kernel's output alias the logits
        residual (``input_output_aliases``); XLA reuses that buffer when the
        logits are dead after the backward (e.g. computed inside the same jit),
        and otherwise inserts a copy.  False never aliases.
      validate_labels: eagerly raise ValueError naming the first label that is
        neither in [0, V) nor ``ignore_index``.  Needs concrete labels: under
        jit/vmap it raises ValueError instead of validating.
      shift: k >= 0 (True = 1) scores position t against label t + k along labels' last (sequence) axis: the
        loss of ``cross_entropy(logits[..., :-k, :], labels[..., k:])`` ("none": shaped like ``labels[..., k:]``)
        without slicing the logits; the kernels run on the full logits with the last k positions ignored. k >= the
        sequence length leaves no token (as the slice does).
      return_z_loss, return_lse, return_accuracy, return_entropy: extra outputs (CONTRACT.md "Extra outputs"),
        computed in the same kernel passes: the z-loss term z_loss * lse**2 reduced like the loss
        (differentiable), the per-token lse (-inf where ignored), the accuracy of the argmax (per token for
        "none", else the fraction of non-ignored rows) and the entropy of softmax(z) reduced like the loss
        (differentiable: dH/dz_j = p_j (mz - z_j), mz = lse - H, added in the backward kernel's pass); lse and
        accuracy carry no gradient (stop_gradient).
      weight: class weights (V,), as torch.nn.functional.cross_entropy's ``weight`` (CONTRACT.md "Class
        weights"): floating point, computed in float32 by the kernels; "mean" is the weighted mean. They are a
        constant: differentiating with respect to them raises ValueError.
      temperature: T > 0 (a Python float): the transformed logits are ``softcap(scale * x) / T`` in every output
        and gradient (folded into the scaling and soft-capping: T = 1 runs exactly today's kernels).
      token_weights: per-token weights shaped like ``labels`` (advantages, masks; may be negative): each token's
        loss (its z-loss term included) is multiplied by its weight before the reduction; "mean" still divides by
        the number of non-ignored tokens (or n_items), "none" returns weight * loss. With ``shift`` they are aligned
        with the labels (w[..., t] goes with labels[..., t]). The z_loss output is weighted like the loss's term;
        lse, accuracy and entropy are not. A constant: differentiating with respect to them raises ValueError.
      where: optax's mask, a bool array shaped like ``labels``: False leaves the token out exactly as ignore_index
        does (loss 0, gradient 0, not counted by "mean"); folded into the labels (O(N), no extra kernel pass).
        With ``shift`` it goes with the labels (where[..., t] with labels[..., t]).

    Returns:
      float32 loss (scalar, or shaped like ``labels`` for reduction="none"); float64 for float64 logits.
      Its gradient w.r.t. logits has logits' dtype. With any return_* True, a
      ``CrossEntropyOutput(loss, z_loss, lse, accuracy, entropy)`` with None for what was not asked.
    """
    options = check_options(
        ignore_index=ignore_index,
        reduction=reduction,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
        temperature=temperature,
    )
    logits = check_float_array(logits, "logits")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    labels = check_labels(labels, logits.shape[:-1], options.ignore_index)
    labels = token_inputs.masked_labels(labels, where, options.ignore_index)
    inplace_backward = check_flag(inplace_backward, "inplace_backward")
    check = check_flag(validate_labels, "validate_labels")
    n_items = check_n_items(n_items)
    returns = check_extras(
        return_z_loss=return_z_loss,
        return_lse=return_lse,
        return_accuracy=return_accuracy,
        return_entropy=return_entropy,
    )
    shift = token_inputs.check_shift(shift)
    weight = check_class_weight(weight, logits.shape[-1])
    token_weights = token_inputs.check_token_weights(token_weights, labels.shape)
    kept = None
    if shift:
        labels, kept = token_inputs.shifted_labels(labels, shift, options.ignore_index)
        token_weights = token_inputs.shifted_token_weights(token_weights, shift)
    if check:
        check_label_values(labels, logits.shape[-1], options.ignore_index)
    loss = _cross_entropy(
        logits, labels, options, reduction, n_items, backend, inplace_backward, returns, weight, token_weights
    )
    return token_inputs.keep_positions(loss, kept, reduction)


def cross_entropy_reference(logits, labels, **options):
    """Pure-jnp ``cross_entropy``: the same keywords (``backend`` is ignored),
    differentiable by plain autodiff; float32 math (float64 for float64 logits),
    so it materialises (N, V) float32 values."""
    return cross_entropy(logits, labels, **dict(options, backend="reference"))
