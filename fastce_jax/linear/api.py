"""The public ``linear_cross_entropy`` and its argument checks. The chunk loop is in chunks.py, the custom_vjps in
autograd.py, the custom partitioning of sharded heads in sharded.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import contract, kernels
from . import chunks
from .autograd import kernel_loss
from .chunks import StaticConfig, rows_per_chunk


def _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False):
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    contract.check_flag(accumulate_in_float32, "accumulate_in_float32")
    return contract.check_flag(skip_ignored_rows, "skip_ignored_rows")


def _check_tensors(hidden, weight, bias):
    hidden = contract.check_float_array(hidden, "hidden")
    weight = contract.check_float_array(weight, "weight")
    if bias is not None:
        bias = contract.check_float_array(bias, "bias")
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) = (V, {hidden.shape[-1]}) with V >= 1 (nn.Linear / lm_head layout), "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    return hidden, weight, bias


def _reference_loss(logits, labels, options, reduction, n_items, returns, class_weight):
    """backend="reference": the jnp loss of the materialised logits (..., V), with the extra outputs asked for."""
    if not returns:
        losses = contract.reference_token_losses(logits, labels, options, class_weight)
        return contract.reduce_losses(losses, labels, reduction, n_items, options.ignore_index, class_weight)
    losses, lse, accuracy, entropy = contract.reference_row_outputs(logits, labels, options, returns, class_weight)
    vocab = logits.shape[-1]
    return contract.reduce_outputs(
        losses, lse, accuracy, entropy, labels, reduction, n_items, options, returns, vocab, class_weight
    )


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
):
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` without the (N, V) logits.

    Args:
      hidden: float32/bfloat16/float16/float64 (..., H), e.g. the final hidden states (a float64 common dtype is
        computed in float64 by the reference, whatever ``backend`` says).
      weight: (V, H), the LM head as ``nn.Linear`` / transformers' ``lm_head`` store it (a Flax
        ``Dense`` kernel is (H, V): pass its ``.T``).
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
    ``workspace_bytes``; see chunks.py).

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
    conditional by reading its predicate on the host (a wait per chunk; see chunks.py).

    return_z_loss, return_lse, return_accuracy, return_entropy: as in ``fastce_jax.cross_entropy``, collected chunk
    by chunk from the same forward kernels (no logits kept). Differentiating the returned z_loss (with z_loss != 0)
    recomputes each chunk's logits in the backward ("mean" / "sum": only when its cotangent is nonzero).

    class_weight: class weights (V,), ``cross_entropy``'s ``weight`` (the positional ``weight`` is the LM head
      here), in every chunk's kernels; "mean" divides by the non-ignored tokens' summed class weights.

    Returns:
      float32 loss: a scalar, or shaped like ``labels`` for reduction="none"; with any return_* True a
      ``CrossEntropyOutput(loss, z_loss, lse, accuracy, entropy)``, None for what was not asked.
    """
    hidden, weight, bias = _check_tensors(hidden, weight, bias)
    options = contract.check_options(
        ignore_index=ignore_index,
        reduction=reduction,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
    )
    labels = contract.check_labels(labels, hidden.shape[:-1], options.ignore_index)
    check = contract.check_flag(validate_labels, "validate_labels")
    n_items = contract.check_n_items(n_items)
    returns = contract.check_extras(
        return_z_loss=return_z_loss,
        return_lse=return_lse,
        return_accuracy=return_accuracy,
        return_entropy=return_entropy,
    )
    skip_ignored_rows = _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows)
    kept = None
    if shift := contract.check_shift(shift):
        labels, kept = contract.shifted_labels(labels, shift, options.ignore_index)
    vocab, dim = weight.shape
    class_weight = contract.check_class_weight(class_weight, vocab, "class_weight")
    if check:
        contract.validate_labels(labels, vocab, options.ignore_index)
    dtype = jnp.dtype(jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,))))
    if backend == "auto":
        backend = "kernel" if contract.on_gpu(hidden) else "reference"
    lead = tuple(hidden.shape[:-1])
    h2 = hidden.reshape(-1, dim)
    labels = jnp.asarray(labels)
    # No tokens: no chunk to launch; float64: the chunks compute in float32.
    if backend == "reference" or h2.shape[0] == 0 or dtype == jnp.float64:
        logits = chunks.chunk_logits(h2, weight, bias, dtype).reshape(lead + (vocab,))
        loss = _reference_loss(logits, labels, options, reduction, n_items, returns, class_weight)
    else:
        st = StaticConfig(
            options=options,
            interpret=not contract.on_gpu(hidden),
            reduction=reduction,
            chunk_rows=rows_per_chunk(h2.shape[0], vocab, dtype.itemsize, workspace_bytes, chunk_rows),
            dtype=dtype.name,
            f32_weight_grad=bool(accumulate_in_float32),
            with_bias=bias is not None,
            forward_config=kernels.forward_config(vocab),
            backward_config=kernels.backward_config(vocab),
            returns=returns,
            skip_ignored_rows=skip_ignored_rows,
            # Several devices: the loop runs on each device's block of rows and vocabulary (sharded.py);
            # class weights have no partitioning rule: such a call runs the loop on the whole (gathered) arrays.
            partitioned=jax.device_count() > 1 and class_weight is None,
        )
        with kernels.quiet_triton(st.interpret):
            loss = kernel_loss(h2, weight, bias, labels.reshape(-1), n_items, class_weight, st=st)
        if isinstance(loss, contract.CrossEntropyOutput):
            per_token = loss._fields if reduction == "none" else ("lse",)
            loss = loss._replace(
                **{f: getattr(loss, f).reshape(lead) for f in per_token if getattr(loss, f) is not None}
            )
        else:
            loss = loss.reshape(lead) if reduction == "none" else loss
    return contract.keep_positions(loss, kept, reduction)
