"""The cross-entropy's per-chunk work on the LM-head engine (linear/engine.py), for linear_cross_entropy and
linear_log_probs: per chunk the forward kernel gives each row's loss and log-sum-exp (and, for the extra outputs, its
argmax and mean of z), the backward kernel overwrites the same fresh logits with d loss / d logits (`chunk_gradient`),
and the engine folds that into the gradients. `chunked_forward` and `chunked_backward` are the two loops,
`reduced_in_one_chunk` the reduced loss of a call that one chunk holds (the kernel reduces in-kernel), and
`differentiable_grads` the same gradients in plain torch, for a backward that is differentiated again.

Reductions.
- "mean" / "sum": the gradients are complete after the forward (the denominator is counted on the device first, no
  host synchronisation); the backward only multiplies them by the upstream scalar, and skips even that on the device
  when the scalar is exactly 1. 6·N·H·V flops in all. Token weights keep this: w_t / denominator is the backward
  kernel's per-row upstream. A differentiated z_loss or entropy output is the exception: its upstream exists only in
  the backward, which then recomputes each chunk's logits for that part. Gradients are computed only when grad mode
  is on and an input requires one (2·N·H·V flops otherwise).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops. A differentiated entropy output adds its
  term in the same backward kernel pass (the kernel's entropy variant, from the forward's per-row entropy).
"""

import torch

from ...core.reference import entropy_gradient, logits_gradient, lse_gradient
from ...linear import engine
from . import launch

__all__ = ["chunk_gradient", "chunked_backward", "chunked_forward", "differentiable_grads", "reduced_in_one_chunk"]


def _chunk_forward(logits, labels, options, outputs=False, class_weight=None):
    """Per-token float32 (loss, lse) of a 2-D logits chunk; with outputs, also (argmax, mean of z) per row.
    class_weight: class weights (V,) or None, for every launcher call here."""
    loss, lse, _, *statistics = launch.forward(logits, labels, options, outputs=outputs, weight=class_weight)
    return loss, lse, *statistics


def chunk_gradient(logits, dlogits, labels, lse, options, upstream, denominator=None, class_weight=None):
    """Writes into `dlogits` (the logits' own buffer, or the chunk in the inputs' dtype next to float32 logits) the
    gradient of sum_t (g_loss_t loss_t / denominator + g_lse_t lse_t + g_entropy_t H_t) with upstream = (g_loss,
    g_lse, g_entropy, entropy) of the chunk's rows, each None for none of that part: g_loss per row or 0-d (with a
    denominator, a per-row g_loss is the token weights' factor w_t / denominator); g_lse (the z_loss output's)
    already holds any class weights' factor (the lse part is unweighted); entropy (the rows' H) gives mz = lse - H."""
    grad_loss, grad_lse, grad_entropy, entropy = upstream
    # The entropy's part rides in the loss's pass (the kernel's entropy variant; a zero upstream for the loss when
    # only the entropy is differentiated).
    entropy_keywords = {}
    if grad_entropy is not None:
        entropy_keywords = dict(grad_entropy=grad_entropy, mean_z=lse - entropy)
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    if grad_lse is None:
        return launch.backward(
            grad_loss, logits, labels, lse, dlogits, options, denominator, weight=class_weight, **entropy_keywords
        )
    if grad_loss is None:
        return launch.lse_backward(grad_lse, logits, labels, lse, dlogits, options)
    # Both parts in float32, rounded to the gradient's dtype once.
    total = launch.lse_backward(grad_lse, logits, labels, lse, torch.empty_like(logits, dtype=torch.float32), options)
    part = torch.empty_like(logits, dtype=torch.float32)
    total += launch.backward(
        grad_loss, logits, labels, lse, part, options, denominator, weight=class_weight, **entropy_keywords
    )
    return dlogits.copy_(total)


def chunked_forward(
    hidden,
    weight,
    bias,
    labels,
    options,
    chunking,
    denominator=None,
    needs=(False, False, False),
    outputs=False,
    kept=engine.FIND,
    class_weight=None,
    token_weights=None,
):
    """Token losses (N,) and lse (N,) of 2-D hidden; with any of `needs` (hidden, weight, bias) also the gradients of
    sum_t w_t loss_t / denominator (a 1-element float32 device tensor; w_t the float32 token_weights (N,), or 1)
    computed chunk by chunk. The token losses are not multiplied by the weights. Returns
    (token_losses, lse, (grad_hidden, grad_weight, grad_bias)), None for gradients not needed; with outputs, then
    also the per-row argmax (int32) and mean of z (the extra outputs' statistics, collected chunk by chunk)."""
    n_rows, device = hidden.shape[0], hidden.device
    with engine.kernel_context(hidden):
        kept = engine.kept_rows(labels, options.ignore_index, chunking) if kept is engine.FIND else kept
        weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
        # One chunk over every row (every small call) keeps the kernel's own per-row outputs (no allocation, no
        # copy); otherwise the chunks gather theirs into (token losses, lse[, argmax, mean of z]).
        per_row = None
        step = engine.rows_per_chunk(
            n_rows, weight.shape[0], engine.logit_bytes(hidden, chunking, any(needs)), *chunking[:2]
        )
        if kept is not None or step < n_rows or n_rows == 0:
            fills = (0.0, -float("inf")) + ((0, float("nan")) if outputs else ())
            kinds = (torch.float32, torch.float32) + ((torch.int32, torch.float32) if outputs else ())
            per_row = [
                engine.per_row(n_rows, kept, fill, kind, device) for fill, kind in zip(fills, kinds, strict=True)
            ]
        grads = engine.new_grads(hidden, weight, bias, needs, chunking, kept)
        one = torch.ones((), dtype=torch.float32, device=device) if any(needs) and token_weights is None else None
        for rows, hidden_chunk, labels_chunk, logits, dlogits, first in engine.row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept, any(needs)
        ):
            chunk_outputs = _chunk_forward(logits, labels_chunk, options, outputs, class_weight)
            if per_row is None:
                per_row = list(chunk_outputs)
            else:
                for whole, part in zip(per_row, chunk_outputs, strict=True):
                    whole[rows] = part
            if any(needs):
                factor = one if token_weights is None else token_weights[rows]
                upstream = (factor, None, None, None)
                chunk_gradient(
                    logits, dlogits, labels_chunk, chunk_outputs[1], options, upstream, denominator, class_weight
                )
                engine.accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
        token_losses, lse, *statistics = per_row
        result = token_losses, lse, engine.finish_grads(grads, weight, bias)
        return (*result, *statistics) if outputs else result


def reduced_in_one_chunk(hidden, weight, bias, labels, options, chunking, needs, reduction, n_items):
    """The reduced loss when one chunk holds every row (every small call): the forward kernel also sums the losses
    and counts their divisor, where chunked_forward's caller needs loss_divisor's and the sum's framework ops
    (more host time than a small call's kernels). Returns (loss (0-d), denominator (1,), gradients)."""
    with engine.kernel_context(hidden):
        weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
        grads = engine.new_grads(hidden, weight, bias, needs, chunking)
        workspace = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        logits = engine.chunk_logits(workspace, hidden, weight_c, bias_c)
        loss, lse, denominator = launch.forward(logits, labels, options, reduction, n_items)
        if any(needs):
            one = torch.ones((), dtype=torch.float32, device=hidden.device)
            chunk_gradient(logits, logits, labels, lse, options, (one, None, None, None), denominator)
            engine.accumulate_grads(logits, hidden, weight_c, slice(None), grads, True)
        return loss, denominator, engine.finish_grads(grads, weight, bias)


def chunked_backward(
    upstream, hidden, weight, bias, labels, lse, options, chunking, needs, kept=engine.FIND, class_weight=None
):
    """Gradients of sum_t (g_loss_t loss_t + g_lse_t lse_t + g_entropy_t H_t) with upstream = (g_loss, g_lse,
    g_entropy, entropy) per row (N,) (chunk_gradient; None for a part not there), recomputing each chunk's logits
    from hidden and weight."""
    # no_grad: under create_graph=True autograd runs backward with grad mode on, and these are kernels and out= ops.
    with engine.kernel_context(hidden):
        if not any(needs):
            return engine.new_grads(hidden, weight, bias, needs, chunking)
        # The forward's kept rows: handed over by the eager Functions, found again (a second synchronisation) by
        # the custom ops' backward.
        kept = engine.kept_rows(labels, options.ignore_index, chunking) if kept is engine.FIND else kept
        grads = engine.new_grads(hidden, weight, bias, needs, chunking, kept)
        weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
        for rows, hidden_chunk, labels_chunk, logits, dlogits, first in engine.row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept
        ):
            rows_upstream = tuple(None if part is None else part[rows] for part in upstream)
            chunk_gradient(logits, dlogits, labels_chunk, lse[rows], options, rows_upstream, class_weight=class_weight)
            engine.accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
        return engine.finish_grads(grads, weight, bias)


def differentiable_grads(
    grad_rows, hidden, weight, bias, labels, options, needs, grad_lse=None, class_weight=None, grad_entropy=None
):
    """The gradients of sum_t (grad_rows_t loss_t + grad_lse_t lse_t + grad_entropy_t H_t) (each None for none of
    it) in plain torch (F.linear, then the contract's d / d logits and the two products), so that autograd can
    differentiate them again (create_graph=True: gradient penalties, Hessian-vector products). It materialises the
    (N, V) logits; only a second-order computation comes here."""
    # Under autocast a float32 master weight meets bf16 hidden here: compute in hidden's dtype, as the kernels did.
    weight = weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    parts = []
    if grad_rows is not None:
        parts.append(logits_gradient(grad_rows, logits, labels, None, options, weight=class_weight))
    if grad_lse is not None:
        parts.append(lse_gradient(grad_lse, logits, labels, options))
    if grad_entropy is not None:
        parts.append(entropy_gradient(grad_entropy, logits, labels, options))
    dlogits = parts[0].to(logits.dtype)
    for part in parts[1:]:
        dlogits = dlogits + part.to(logits.dtype)
    need_hidden, need_weight, need_bias = needs
    return (
        dlogits @ weight if need_hidden else None,
        dlogits.t() @ hidden if need_weight else None,
        dlogits.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias else None,
    )
