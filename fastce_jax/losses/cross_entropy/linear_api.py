"""The public ``linear_cross_entropy`` and ``linear_log_probs`` and their argument checks. The chunk loop is the
engine's (fastce_jax/linear/engine.py) with this loss's per-chunk work in linear_chunks.py, the custom_vjps are in
linear_autograd.py, the custom partitioning of sharded heads in fastce_jax/distributed/linear_sharded.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ...core import token_inputs
from ...core.launch import quiet_triton
from ...core.options import (
    as_array,
    check_class_weight,
    check_extras,
    check_flag,
    check_float_array,
    check_labels,
    check_n_items,
    check_options,
    ignore_value,
    on_gpu,
    reduce_losses,
)
from ...core.options import (
    validate_labels as check_label_values,
)
from ...core.outputs import CrossEntropyOutput, reduce_outputs, weigh_tokens
from ...core.reference import reference_row_outputs, reference_token_losses
from ...linear import engine
from .launch import backward_config, forward_config
from .linear_autograd import kernel_loss
from .linear_chunks import StaticConfig
from .log_probs import negated_losses

__all__ = [
    "WEIGHT_LAYOUTS",
    "check_weight_layout",
    "check_head_tensors",
    "check_tokens",
    "static_config",
    "aligned_token_weights",
    "linear_cross_entropy",
    "linear_log_probs",
]

WEIGHT_LAYOUTS = ("vh", "hv")


def check_weight_layout(weight_layout) -> bool:
    """Whether the weight is (H, V): weight_layout "vh" (nn.Linear / lm_head: (V, H), the default) or "hv" (a Flax
    Dense / nnx.Linear kernel as stored: (H, V))."""
    if not isinstance(weight_layout, str) or weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    return weight_layout == "hv"


def check_head_tensors(hidden, weight, bias, hv=False):
    hidden = check_float_array(hidden, "hidden")
    weight = check_float_array(weight, "weight")
    if bias is not None:
        bias = check_float_array(bias, "bias")
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    h_axis = 0 if hv else 1
    if weight.ndim != 2 or weight.shape[1 - h_axis] < 1 or weight.shape[h_axis] != hidden.shape[-1]:
        layout = (
            f'(H, V) = ({hidden.shape[-1]}, V) with V >= 1 (weight_layout="hv": a Flax Dense kernel)'
            if hv
            else f'(V, H) = (V, {hidden.shape[-1]}) with V >= 1 (weight_layout="vh": nn.Linear / lm_head)'
        )
        raise ValueError(f"weight must have shape {layout}, got {tuple(weight.shape)}")
    vocab = weight.shape[1 - h_axis]
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"bias must have shape (V,) = ({vocab},), got {tuple(bias.shape)}")
    return hidden, weight, bias


def aligned_token_weights(weights, labels, shift: int, ignore_index: int):
    """The weights aligned with the (shifted) labels: weights[..., shift:] then zeros, as the labels are shifted;
    0 on ignored rows, whose weight takes no part (a NaN or inf weight there stays out of the loss)."""
    if weights is None:
        return None
    weights = token_inputs.shifted_token_weights(jnp.asarray(weights), shift)
    ign = ignore_value(labels.dtype, ignore_index)
    return weights if ign is None else jnp.where(labels == ign, jnp.zeros((), weights.dtype), weights)


def _reference_loss(logits, labels, options, reduction, n_items, returns, class_weight, token_weights=None):
    """backend="reference": the jnp loss of the materialised logits (..., V), with the extra outputs asked for
    (the entropy differentiable by plain autodiff)."""
    if not returns:
        losses = reference_token_losses(logits, labels, options, class_weight)
        losses = weigh_tokens(losses, labels, token_weights, options.ignore_index)
        return reduce_losses(losses, labels, reduction, n_items, options.ignore_index, class_weight)
    losses, lse, accuracy, entropy = reference_row_outputs(logits, labels, options, returns, class_weight)
    return reduce_outputs(
        losses, lse, accuracy, entropy, labels, reduction, n_items, options, returns, logits.shape[-1], class_weight,
        token_weights=token_weights, entropy_grad=True,
    )  # fmt: skip


def static_config(
    hidden, weight, bias, options, reduction, dtype, logits_dtype, returns, class_weight, *, workspace_bytes,
    chunk_rows, accumulate_in_float32, skip_ignored_rows, hv,
):  # fmt: skip
    """The kernel path's StaticConfig for checked arguments (hidden (..., H), weight (V, H), or (H, V) with hv)."""
    vocab = weight.shape[1 if hv else 0]
    n_rows = math.prod(hidden.shape[:-1])
    logits_itemsize = 4 if logits_dtype is not None else dtype.itemsize
    return StaticConfig(
        options=options,
        interpret=not on_gpu(hidden),
        reduction=reduction,
        chunk_rows=engine.rows_per_chunk(n_rows, vocab, logits_itemsize, workspace_bytes, chunk_rows),
        dtype=dtype.name,
        f32_weight_grad=bool(accumulate_in_float32),
        with_bias=bias is not None,
        forward_config=forward_config(vocab),
        backward_config=backward_config(vocab),
        returns=returns,
        skip_ignored_rows=skip_ignored_rows,
        # Several devices: the loop runs on each device's block of rows and vocabulary (linear_sharded.py); class
        # weights have no partitioning rule: such a call runs the loop on the whole (gathered) arrays.
        partitioned=jax.device_count() > 1 and class_weight is None,
        logits_dtype=logits_dtype,
        weight_hv=hv,
    )


def _with_lead_shape(result, lead, reduction):
    """The kernel path's flat per-token results shaped like the labels: the loss ("none"), every per-token field
    of a CrossEntropyOutput (lse always, the others for "none")."""
    if not isinstance(result, CrossEntropyOutput):
        return result.reshape(lead) if reduction == "none" else result
    per_token = result._fields if reduction == "none" else ("lse",)
    return result._replace(**{f: getattr(result, f).reshape(lead) for f in per_token if getattr(result, f) is not None})


def linear_cross_entropy(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    validate_labels=False,
    shift=0,
    workspace_bytes=None,
    chunk_rows=None,
    accumulate_in_float32=False,
    skip_ignored_rows=False,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    class_weight=None,
    temperature=1.0,
    token_weights=None,
    logits_dtype=None,
    where=None,
    weight_layout="vh",
):
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` without the (N, V) logits.

    Args:
      hidden: float32/bfloat16/float16/float64 (..., H), e.g. the final hidden states (a float64 common dtype is
        computed in float64 by the reference, whatever ``backend`` says).
      weight: (V, H), the LM head as ``nn.Linear`` / transformers' ``lm_head`` store it; with
        ``weight_layout="hv"`` (H, V), a Flax ``nn.Dense`` / ``nnx.Linear`` kernel as stored.
      labels: int32/int64 (...), hidden's leading shape.
      bias: optional (V,).
      ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss,
      validate_labels: as in ``fastce_jax.cross_entropy`` (CONTRACT.md).
      shift: as in ``fastce_jax.cross_entropy``, along hidden's second-to-last (sequence) axis: the loss of
        ``linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])`` without slicing hidden.
      backend: "auto" (the chunked kernel path for GPU arrays, "reference" elsewhere), "kernel" (the chunked
        path always; Pallas interpret mode off GPU) or "reference" (the plain matmul, then the jnp reference
        loss: it materialises the logits). Traced (under jit), "auto" assumes the arrays live on the default
        backend: to jit over CPU arrays in a process whose default backend is a GPU, pass backend="reference"
        (cross_entropy, whose fallback needs no matmul, decides that when the computation is lowered).

    The logits are computed in the inputs' common dtype (with float32 accumulation inside the matmul, as XLA's
    GPU matmuls do); the loss is float32 (float64 for a float64 common dtype). Gradients flow to hidden, weight
    and bias, in their dtypes. The extra memory is the gradients plus one chunk of logits (at most
    ``workspace_bytes``; see fastce_jax/linear/engine.py).

    Chunking (the kernel path only; neither changes the loss beyond rounding): ``workspace_bytes`` bounds the chunk
    of logits materialised at a time (None: DEFAULT_WORKSPACE_BYTES = 256 MiB), ``chunk_rows`` (an int) forces the
    rows per chunk whatever the budget; ``accumulate_in_float32=True`` sums a bf16/fp16 weight's gradient over the
    chunks in a float32 accumulator (one rounding instead of one per chunk, 4·V·H more bytes).

    skip_ignored_rows=True (the kernel path only): the chunk loop takes the rows whose label is not ignore_index
    first (a stable sort of the ignored mask; each chunk gathers its rows of hidden and scatters its rows of d
    hidden back), and a chunk with no kept row runs under a ``lax.cond`` that skips its matmuls and kernels on the
    device, so ignored rows (padding, prompt tokens) cost no matmul work beyond the one chunk holding the last kept
    row. jit, grad, second order and vmap work (under vmap with batched labels the cond becomes a select: both
    branches run, nothing is saved). The same loss and gradients (d hidden exactly 0 on ignored rows), every
    output in the original order. Nothing is read on the host by fastce, but on a GPU XLA runs each chunk's
    conditional by reading its predicate on the host (a wait per chunk; see fastce_jax/linear/engine.py).

    return_z_loss, return_lse, return_accuracy, return_entropy: as in ``fastce_jax.cross_entropy``, collected chunk
    by chunk from the same forward kernels (no logits kept). Differentiating the returned z_loss (with z_loss != 0)
    recomputes each chunk's logits in the backward ("mean" / "sum": only when its cotangent is nonzero).

    class_weight: class weights (V,), ``cross_entropy``'s ``weight`` (the positional ``weight`` is the LM head
      here), in every chunk's kernels; "mean" divides by the non-ignored tokens' summed class weights.

    temperature: a float > 0: the logits are ``softcap(scaling * x) / temperature`` in every output and gradient
      (folded into the scaling and soft-capping, exact algebra; 1.0 changes nothing).
    token_weights: None, or a floating array shaped like ``labels`` (no gradient: differentiating with respect to
      it raises): each token's loss (its z-loss term included) is multiplied by its weight before the reduction;
      "mean" still divides by the non-ignored count (or n_items, or the class weights' divisor). Weights may be
      negative; an ignored token's weight takes no part. With ``shift`` they are aligned with labels. The z_loss
      output is weighted like the loss's term; lse, accuracy and entropy are not. "mean" / "sum" keep the
      gradients-in-forward path (each row's factor is w_t / divisor): no recompute.
    logits_dtype: None (the logits in the inputs' common dtype) or "float32" / jnp.float32: the chunk GEMM takes
      the bf16 / fp16 operands as they are and gives float32 logits (``preferred_element_type``; no float32 copy
      of the weight), the kernels read float32 and the workspace counts 4 bytes per logit. d logits is rounded to
      the operands' dtype for the gradient products (as an unfused head's backward); d bias sums it in float32.
      A no-op for float32 / float64 inputs.
    where: as in ``fastce_jax.cross_entropy``: a bool array shaped like ``labels``, False tokens left out as if
      their label were ignore_index (folded into the labels; with skip_ignored_rows their matmuls are skipped too).
    weight_layout: "vh" (the default: weight (V, H)) or "hv" (weight (H, V), a Flax Dense / nnx.Linear kernel):
      the matmuls contract the weight's H axis where it is (``lax.dot_general`` dimension numbers, no transposed
      copy) and its gradient is (H, V), like the weight. Under sharding the vocabulary axis is the weight's axis 1.

    Returns:
      float32 loss: a scalar, or shaped like ``labels`` for reduction="none"; with any return_* True a
      ``CrossEntropyOutput(loss, z_loss, lse, accuracy, entropy)``, None for what was not asked.
    """
    hv = check_weight_layout(weight_layout)
    hidden, weight, bias = check_head_tensors(hidden, weight, bias, hv)
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
    labels = check_labels(labels, hidden.shape[:-1], options.ignore_index, "hidden")
    labels = token_inputs.masked_labels(labels, where, options.ignore_index)
    token_weights = token_inputs.check_token_weights(token_weights, labels.shape)
    check = check_flag(validate_labels, "validate_labels")
    n_items = check_n_items(n_items)
    returns = check_extras(
        return_z_loss=return_z_loss,
        return_lse=return_lse,
        return_accuracy=return_accuracy,
        return_entropy=return_entropy,
    )
    skip_ignored_rows = engine.check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows)
    kept = None
    if shift := token_inputs.check_shift(shift):
        labels, kept = token_inputs.shifted_labels(labels, shift, options.ignore_index)
    vocab, dim = weight.shape[::-1] if hv else weight.shape
    class_weight = check_class_weight(class_weight, vocab, "class_weight")
    if check:
        check_label_values(labels, vocab, options.ignore_index)
    dtype = jnp.dtype(jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,))))
    logits_dtype = engine.check_logits_dtype(logits_dtype, dtype)
    if backend == "auto":
        backend = "kernel" if on_gpu(hidden) else "reference"
    lead = tuple(hidden.shape[:-1])
    h2 = hidden.reshape(-1, dim)
    labels = jnp.asarray(labels)
    token_weights = aligned_token_weights(token_weights, labels, shift, options.ignore_index)
    # No tokens: no chunk to launch; float64: the chunks compute in float32.
    if backend == "reference" or h2.shape[0] == 0 or dtype == jnp.float64:
        logits = engine.chunk_logits(h2, weight, bias, dtype, logits_dtype, hv).reshape(lead + (vocab,))
        loss = _reference_loss(logits, labels, options, reduction, n_items, returns, class_weight, token_weights)
    else:
        st = static_config(
            hidden, weight, bias, options, reduction, dtype, logits_dtype, returns, class_weight,
            workspace_bytes=workspace_bytes, chunk_rows=chunk_rows, accumulate_in_float32=accumulate_in_float32,
            skip_ignored_rows=skip_ignored_rows, hv=hv,
        )  # fmt: skip
        flat_weights = None if token_weights is None else token_weights.reshape(-1)
        with quiet_triton(st.interpret):
            loss = kernel_loss(h2, weight, bias, labels.reshape(-1), n_items, class_weight, flat_weights, st=st)
        loss = _with_lead_shape(loss, lead, reduction)
    return token_inputs.keep_positions(loss, kept, reduction)


def check_tokens(tokens, hidden):
    """tokens named as such (linear_cross_entropy's checks name them labels): integers shaped like hidden's lead."""
    tokens = as_array(tokens, "tokens")
    if not jnp.issubdtype(jnp.dtype(tokens.dtype), jnp.integer):
        raise TypeError(f"tokens must be int32 or int64, got {tokens.dtype}")
    lead = tuple(jnp.shape(hidden)[:-1])
    if tuple(tokens.shape) != lead:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} must equal hidden's leading shape {lead}")
    return tokens


def linear_log_probs(
    hidden,
    weight,
    tokens,
    *,
    bias=None,
    temperature=1.0,
    return_entropy=False,
    ignore_index=-100,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    shift=0,
    workspace_bytes=None,
    chunk_rows=None,
    logits_dtype=None,
    backend="auto",
    validate_labels=False,
    weight_layout="vh",
):
    """log p(token_t) under softmax(z), z = softcap(scaling * (hidden @ weight.T + bias)) / temperature, without the
    (N, V) logits: the RL policy's per-token log-probabilities (and entropies) from its hidden states.

    ``-linear_cross_entropy(hidden, weight, tokens, reduction="none", ...)`` (the keywords are its own): float32,
    shaped like tokens (with shift k: like tokens[..., k:]), 0.0 where the token is ignore_index, NaN for a token
    outside [0, V). return_entropy=True returns ``LogProbOutput(logprobs, entropy)``, the entropy per token (0
    where ignored). Both are differentiable (hidden, weight, bias) through any objective: the forward keeps the
    lse per token (and the entropy) and the backward recomputes each chunk's logits (2·N·H·V of matmul work
    forward, 6·N·H·V backward), the entropy's term in the same backward kernel. A call that is not differentiated
    saves nothing for a backward. weight_layout="hv": weight is (H, V), as linear_cross_entropy's.
    """
    tokens = check_tokens(tokens, hidden)
    want_entropy = check_flag(return_entropy, "return_entropy")
    out = linear_cross_entropy(
        hidden,
        weight,
        tokens,
        bias=bias,
        ignore_index=ignore_index,
        reduction="none",
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        backend=backend,
        validate_labels=validate_labels,
        shift=shift,
        workspace_bytes=workspace_bytes,
        chunk_rows=chunk_rows,
        return_entropy=want_entropy,
        temperature=temperature,
        logits_dtype=logits_dtype,
        weight_layout=weight_layout,
    )
    return negated_losses(out, want_entropy)
