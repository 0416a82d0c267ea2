"""Fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)` without the (N, V) logits.

Autocast: under torch.autocast for the tensors' device type the matmuls run in the autocast dtype, as F.linear's do:
hidden is cast at the entry (through autograd), weight and bias inside the computation (a copy of each), so that a
weight in another dtype (a float32 master weight) has its gradient accumulated in float32 and handed back in its own
dtype. The kernels' own code runs with autocast off.

The chunk loop is the engine (linear/engine.py) with this loss's per-chunk work (linear_chunks.py), its autograd
Functions and custom ops linear_autograd.py, their dispatch for an unsharded head linear_dispatch.py, the sharded
heads distributed/linear_sharded.py.
"""

import torch

from ...core.options import (
    KERNEL_DTYPES,
    check_class_weight,
    check_extras,
    check_labels,
    check_options,
    check_temperature,
    compute_dtype,
    is_dtensor,
    with_temperature,
)
from ...core.options import validate_labels as validate_label_values
from ...core.outputs import CrossEntropyOutput, unshifted
from ...core.token_inputs import check_shift, check_token_weights, masked_labels, shifted_labels, shifted_token_weights
from ...distributed.linear_sharded import sharded_linear_cross_entropy
from ...linear.engine import check_chunking, check_logits_dtype
from .linear_dispatch import unsharded_loss, unsharded_outputs
from .log_probs import negated_losses

__all__ = [
    "LINEAR_DTYPES",
    "WEIGHT_LAYOUTS",
    "check_linear_tensors",
    "linear_cross_entropy",
    "linear_log_probs",
    "prepared_token_weights",
    "vh_weight",
]

# float64 is accepted as in cross_entropy: computed in float64 by the plain-torch reference, whatever the backend.
LINEAR_DTYPES = (*KERNEL_DTYPES, torch.float64)


def check_linear_tensors(hidden, weight, bias, labels):
    """The head's tensors (dtypes, shapes, devices) and the labels' (check_labels), with errors naming each."""
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in LINEAR_DTYPES:
            got = getattr(tensor, "dtype", type(tensor))
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {got}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., H)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H = hidden.shape[-1] (nn.Linear's layout): hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have a vocabulary dimension of at least 1")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be None or a (V,) = ({weight.shape[0]},) tensor, got {bias!r:.80}")
        if bias.dtype not in LINEAR_DTYPES:
            raise TypeError(f"bias must be float32, bfloat16, float16 or float64, got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden on {hidden.device}")
    check_labels(labels, "hidden", hidden.shape, hidden.device)


WEIGHT_LAYOUTS = ("vh", "hv")


def vh_weight(weight, hidden, weight_layout):
    """The weight as (V, H): itself for weight_layout "vh" (nn.Linear / lm_head), the `.t()` view of an (H, V)
    kernel (Flax nn.Dense / nnx.Linear's layout) for "hv": no copy, and its gradient comes back (H, V) in the
    kernel's own memory layout (linear/engine.new_grads)."""
    if not isinstance(weight_layout, str) or weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    if weight_layout == "vh":
        return weight
    if is_dtensor(weight) or is_dtensor(hidden):
        raise NotImplementedError(
            'weight_layout="hv" with DTensor inputs is not supported: pass the (V, H) weight (weight_layout="vh"), '
            "or plain local tensors with process_group="
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f'weight_layout="hv" takes weight (H, V) with H = hidden.shape[-1] = {hidden.shape[-1]}, got '
            f"{tuple(getattr(weight, 'shape', ()))}"
        )
    return weight.t()


def prepared_token_weights(token_weights, labels, shift, ignore_index, dtype):
    """The token weights as the chunks take them: aligned with the (shifted) labels, in the loss's compute dtype,
    0 where the label is ignore_index (the loss and gradient are 0 there whatever the weight, NaN included)."""
    if token_weights is None:
        return None
    # DTensor labels (the vocab-parallel DTensor path takes them whole): the weights go with the full labels.
    labels, token_weights = (t.full_tensor() if is_dtensor(t) else t for t in (labels, token_weights))
    if shift:
        token_weights = shifted_token_weights(token_weights, shift)
    return torch.where(labels == ignore_index, 0.0, token_weights.to(compute_dtype(dtype)))


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
    process_group=None,
    vocab_start=None,
    class_weight=None,
    temperature=1.0,
    token_weights=None,
    logits_dtype=None,
    where=None,
    weight_layout="vh",
):
    """fastce_torch.cross_entropy(hidden @ weight.T + bias, labels, ...) without ever allocating the logits.

    hidden (..., H), weight (V, H) as nn.Linear / lm_head store it, bias (V,) or None, labels (...) int32/int64;
    hidden, weight and bias are float32, bfloat16, float16 or float64 on one device; mixed dtypes compute in the
    promoted dtype (a cast copy of the narrower ones), each gradient in its own tensor's dtype; a float64 promoted
    dtype is computed in float64 by plain torch, whatever `backend` says. Every keyword is cross_entropy's
    (CONTRACT.md). Returns a float32 scalar ("mean", "sum") or per-token losses shaped like labels ("none"), float64
    when computed in float64. backend: "auto" = the chunked kernels for CUDA tensors, plain torch (matmul + the
    reference loss) elsewhere; "kernel" = the chunked kernels always (CPU: Triton's interpreter); "reference" =
    plain torch.

    For "mean"/"sum" with gradients enabled the gradients are computed during the forward (see
    linear_chunks.py), so a second backward through the same loss (retain_graph=True) raises.

    shift=k (True = 1): cross_entropy's, along hidden's second-to-last (the sequence) dimension: the loss of
    `linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])` without slicing (or copying) hidden.

    Chunking (the kernels only; neither changes the loss beyond rounding): `workspace_bytes` bounds the chunk of
    logits materialised at a time (None: DEFAULT_WORKSPACE_BYTES = 256 MiB), `chunk_rows` (an int) forces the rows
    per chunk whatever the budget; `accumulate_in_float32=True` sums a bf16/fp16 weight's gradient over the chunks
    in a float32 accumulator (one rounding instead of one per chunk, 4·V·H more bytes).

    skip_ignored_rows=True (the kernels only): the chunks cover only the rows whose label is not ignore_index
    (gathered chunk by chunk, a copy of their rows of hidden), so ignored rows (padding, prompt tokens) cost no
    matmul work: 6·K·H·V flops for K kept rows instead of 6·N·H·V. The same loss and gradients (d hidden exactly 0
    on ignored rows), every output in the original order. It reads the number of kept rows on the host: one
    synchronisation per call (under torch.compile a backward that recomputes the logits, "none" or a
    differentiated z_loss output, reads it again inside its custom op), so it raises under CUDA-graph capture.
    Off by default: the default path never synchronises.

    return_z_loss, return_lse, return_accuracy, return_entropy: as cross_entropy's (CrossEntropyOutput), collected
    chunk by chunk from the same forward kernels. Differentiating the z_loss output recomputes each chunk's logits
    in the backward. Under torch.compile any of them sends "mean"/"sum" through the per-token ops (the backward
    recomputes the logits: 8·N·H·V flops instead of 6).

    Sharded heads (distributed/linear_sharded.py): with `process_group`, weight (V_local, H) and bias (V_local,) are
    this rank's rows of a column-parallel head, a contiguous slice of the vocabulary starting at `vocab_start` (None:
    rank * V_local, every rank the same width), hidden and labels (global ids) the same on every rank; O(N)
    communication per call plus the all-reduce of d hidden. A DTensor weight (FSDP2's fully_shard) with a plain
    hidden: this rank's rows against the gathered weight, the weight's gradient reduce-scattered (averaged) back to
    its placements as FSDP2 does. hidden a Replicate DTensor with a Shard(0) weight: vocab-parallel over the mesh.

    class_weight: class weights (V,), cross_entropy's `weight=` (the positional `weight` is the LM head here), in
    every chunk's kernels; "mean" divides by the kept tokens' summed class weights (on the device).

    temperature (> 0): the transformed logits are softcap(scale * x) / temperature in every output and gradient
    (folded into the scaling and softcap options). token_weights (shaped like labels, floating, no gradient, may be
    negative): each token's loss (its z-loss term included, and the z_loss output's term) is multiplied by its weight
    before the reduction; "mean" still divides by the non-ignored count (or n_items, or the class weights' divisor).
    "mean"/"sum" keep the gradients computed in the forward (the weights are the backward kernel's per-row factor).
    return_entropy=True: the entropy output carries a gradient ("none": in the same recomputing backward;
    "mean"/"sum": when it is differentiated, the backward recomputes each chunk's logits, as for the z_loss output).
    logits_dtype: None (the inputs' dtype) or float32 ("float32" or torch.float32): with bf16/fp16 inputs the
    chunks' logits are float32 (on CUDA the matmul reads the bf16/fp16 operands and writes float32; on the CPU the
    chunk's operands are cast), the workspace counts 4 bytes per logit plus, in a pass that computes gradients, the
    gradient chunk in the inputs' dtype (the products' operand, as with the default logits).
    where: as cross_entropy's (a bool tensor shaped like labels; False tokens are left out as if their label were
    ignore_index, folded into the labels; with skip_ignored_rows their matmuls are skipped too).
    weight_layout: "vh" (the default: weight (V, H), nn.Linear's) or "hv": weight (H, V), a Flax nn.Dense /
    nnx.Linear kernel as stored, used through its `.t()` view (the matmuls read it in place, no transposed copy;
    its gradient is (H, V) in the same memory layout). With process_group, weight (H, V_local); not with DTensors.
    """
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        weight = vh_weight(weight, hidden, weight_layout)
    check_linear_tensors(hidden, weight, bias, labels)
    labels = masked_labels(labels, where, ignore_index)
    sharded = process_group is not None or vocab_start is not None or any(map(is_dtensor, (hidden, weight, bias)))
    if sharded and class_weight is not None:
        raise NotImplementedError(
            "fastce_torch.linear_cross_entropy: class_weight with a sharded head (process_group=, vocab_start= or a "
            "DTensor weight) is not supported; call it without class_weight, or gather the head and call it unsharded"
        )
    class_weight = check_class_weight(class_weight, weight.shape[0], hidden.device, "class_weight")
    options = check_options(
        ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
    )
    options = with_temperature(options, check_temperature(temperature))
    token_weights = check_token_weights(token_weights, labels)
    dtype = hidden.dtype if bias is None else torch.promote_types(hidden.dtype, bias.dtype)
    dtype = torch.promote_types(dtype, weight.dtype)
    if torch.is_autocast_enabled(hidden.device.type) and dtype != torch.float64:
        dtype = torch.get_autocast_dtype(hidden.device.type)
    float32_logits = check_logits_dtype(logits_dtype, dtype)
    chunking = check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows, float32_logits)
    extras = check_extras(return_z_loss, return_lse, return_accuracy, return_entropy)
    kept = None
    if shift := check_shift(shift, labels):
        labels, kept = shifted_labels(labels, shift, ignore_index)
    token_weights = prepared_token_weights(token_weights, labels, shift, ignore_index, dtype)
    if sharded:
        loss = sharded_linear_cross_entropy(
            hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, validate_labels,
            process_group, vocab_start, token_weights,
        )  # fmt: skip
        if isinstance(loss, CrossEntropyOutput):
            return unshifted(loss, kept, reduction)
        return loss[..., :kept] if kept is not None and reduction == "none" else loss
    if validate_labels:
        validate_label_values(labels, weight.shape[0], ignore_index)
    if any(extras):
        output = unsharded_outputs(
            hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, class_weight,
            token_weights,
        )  # fmt: skip
        return unshifted(output, kept, reduction)
    loss = unsharded_loss(
        hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight, token_weights
    )
    return loss[..., :kept] if kept is not None and reduction == "none" else loss


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
    process_group=None,
    vocab_start=None,
    weight_layout="vh",
):
    """Per-token log-probabilities log p(token_t) of softmax(softcap(scale * (hidden @ weight.T + bias)) /
    temperature), shaped like tokens (with shift=k like tokens[..., k:]), float32 (float64 for float64 inputs): 0.0
    where the token is ignore_index, NaN for a token outside [0, V). return_entropy=True: LogProbOutput(logprobs,
    entropy), the entropy per token (0 where ignored). Both differentiable through any objective built on them
    (hidden, weight and bias get gradients): linear_cross_entropy(reduction="none") underneath, so no (N, V) logits
    (the backward recomputes each chunk: 2NHV of matmul work forward, 6NHV backward). With gradients off
    (torch.no_grad, inference_mode, inputs not requiring grad) nothing is kept for a backward. The other keywords
    are linear_cross_entropy's (weight_layout="hv": weight (H, V))."""
    out = linear_cross_entropy(
        hidden, weight, tokens, bias=bias, ignore_index=ignore_index, reduction="none",
        logit_softcapping=logit_softcapping, logit_scaling=logit_scaling, backend=backend,
        validate_labels=validate_labels, shift=shift, workspace_bytes=workspace_bytes, chunk_rows=chunk_rows,
        return_entropy=return_entropy, process_group=process_group, vocab_start=vocab_start, temperature=temperature,
        logits_dtype=logits_dtype, weight_layout=weight_layout,
    )  # fmt: skip
    plain_tokens = tokens.full_tensor() if is_dtensor(tokens) else tokens
    return negated_losses(out, plain_tokens, shift, ignore_index, return_entropy)
