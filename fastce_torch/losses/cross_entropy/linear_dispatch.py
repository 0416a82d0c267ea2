"""The fused linear cross-entropy of an unsharded head: the dispatch between the plain-torch path, the eager autograd
Functions and, under torch.compile, the custom ops (linear_autograd.py), with and without the extra outputs; and the
extra outputs' fields from the per-row statistics (output_fields, which distributed/linear_sharded.py uses too)."""

import torch

from ...core.options import label_weights, loss_divisor, use_kernel
from ...core.outputs import CrossEntropyOutput, extra_outputs
from ...core.reference import reduce_losses, reference_token_losses, transform
from ...linear import engine
from .linear_autograd import (
    PerTokenFunction,
    ReducedFunction,
    outputs_forward_op,
    per_token_forward_op,
    reduced_op,
    row_entropy,
    weighted,
)

__all__ = ["output_fields", "unsharded_loss", "unsharded_outputs"]


def output_fields(loss, lse, argmax, entropy, labels, options, extras, reduction, n_items, vocab, class_weight=None,
                  token_weights=None):  # fmt: skip
    """CrossEntropyOutput from the loss and per-row (lse, argmax, entropy) (N,): lse and accuracy as
    extra_outputs gives them; the z_loss field (differentiable through lse) also weighted by the token
    weights (per row, 0 where ignored); the entropy field differentiable through `entropy`, not weighted, reduced
    by the unweighted divisor. NaN in both on a row holding NaN or +inf."""
    out = extra_outputs(
        loss, lse, argmax, None, labels, options, extras._replace(z_loss=False, entropy=False), reduction, n_items,
        vocab, class_weight,
    )._asdict()  # fmt: skip
    shape, ignore_index = labels.shape, options.ignore_index
    ignored, in_range = labels == ignore_index, (labels >= 0) & (labels < vocab)
    lse = lse.view(shape)
    lse = torch.where(lse.detach() == float("inf"), float("nan"), lse)
    if extras.z_loss:
        kept_lse = torch.where(ignored, 0.0, lse)  # ignored rows' lse is -inf: no inf * 0 in the gradient
        term = options.z_loss * kept_lse * kept_lse * torch.where(in_range | ignored, 1.0, float("nan")).to(lse.dtype)
        if class_weight is not None:
            term = term * label_weights(labels, class_weight.to(term.dtype), vocab)
        term = weighted(term, None if token_weights is None else token_weights.view(shape))
        divisor = loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype, class_weight)
        out["z_loss"] = term if divisor is None else term.sum() / divisor
    if extras.entropy:
        entropy = torch.where(torch.isnan(lse.detach()), float("nan"), entropy.view(shape))
        entropy = torch.where(ignored, 0.0, entropy)
        divisor = loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype)
        out["entropy"] = entropy if divisor is None else entropy.sum() / divisor
    return CrossEntropyOutput(**out)


def _reference_outputs(hidden, weight, bias, labels, options, reduction, n_items, chunking, extras, class_weight,
                       token_weights):  # fmt: skip
    """The plain-torch path with extra outputs: every field differentiable where the contract says so."""
    logits = engine.reference_logits(hidden, weight, bias, chunking)
    token_losses = reference_token_losses(logits, labels, options, class_weight)
    loss = reduce_losses(
        weighted(token_losses, token_weights), labels, reduction, n_items, options.ignore_index, class_weight
    )
    z = transform(logits, options, labels)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    entropy = row_entropy(lse, torch.where(p > 0, p * z, 0.0).sum(-1), labels, options.ignore_index)
    argmax = z.detach().argmax(-1)
    return output_fields(
        loss, lse.reshape(-1), argmax.reshape(-1), entropy.reshape(-1), labels, options, extras, reduction, n_items,
        logits.shape[-1], class_weight, token_weights,
    )  # fmt: skip


def unsharded_outputs(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, class_weight=None,
    token_weights=None,
):  # fmt: skip
    """linear_cross_entropy with extra outputs: CrossEntropyOutput. token_weights: shaped like labels, in the
    compute dtype, 0 where ignored (linear_api.py prepares them), or None."""
    ignore_index = options.ignore_index
    hidden, weight, bias = engine.autocast_or_common_dtype(hidden, weight, bias)
    vocab = weight.shape[0]
    if not use_kernel(hidden, backend):
        return _reference_outputs(
            hidden, weight, bias, labels, options, reduction, n_items, chunking, extras, class_weight, token_weights
        )
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    weights_1d = None if token_weights is None else token_weights.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        token_losses, lse, argmax, entropy = outputs_forward_op(
            hidden_2d, weight, bias, labels_1d, *options, *chunking, extras.z_loss, extras.entropy, class_weight
        )
        token_losses = weighted(token_losses.view(labels.shape), token_weights)
        loss = reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    elif reduction == "none":
        token_losses, lse, argmax, entropy = PerTokenFunction.apply(
            hidden_2d, weight, bias, labels_1d, options, chunking, extras, class_weight
        )
        loss = weighted(token_losses, weights_1d).view(labels.shape)
    else:
        needs = engine.gradients_needed(hidden, weight, bias)
        denominator = loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
        loss, lse, argmax, entropy = ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, extras, class_weight, None,
            weights_1d,
        )  # fmt: skip
    return output_fields(
        loss, lse, argmax, entropy, labels, options, extras, reduction, n_items, vocab, class_weight, weights_1d
    )


def unsharded_loss(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight=None,
    token_weights=None,
):  # fmt: skip
    ignore_index = options.ignore_index
    hidden, weight, bias = engine.autocast_or_common_dtype(hidden, weight, bias)
    if not use_kernel(hidden, backend):
        logits = engine.reference_logits(hidden, weight, bias, chunking)
        token_losses = weighted(reference_token_losses(logits, labels, options, class_weight), token_weights)
        return reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    weights_1d = None if token_weights is None else token_weights.reshape(-1).contiguous()
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        if compiling:
            token_losses = per_token_forward_op(hidden_2d, weight, bias, labels_1d, *options, *chunking, class_weight)
            token_losses = token_losses[0]
        else:
            token_losses = PerTokenFunction.apply(
                hidden_2d, weight, bias, labels_1d, options, chunking, None, class_weight
            )
        return weighted(token_losses, weights_1d).view(labels.shape)
    needs = engine.gradients_needed(hidden, weight, bias)
    n_rows = hidden_2d.shape[0]
    one_chunk = 0 < n_rows <= engine.rows_per_chunk(n_rows, weight.shape[0], hidden.element_size(), *chunking[:2])
    plain = class_weight is None and token_weights is None and not chunking.skip_ignored_rows
    if not compiling and one_chunk and plain and not chunking.float32_logits:
        return ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, None, options, chunking, needs, None, None, (reduction, n_items)
        )
    denominator = loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
    if compiling:
        return reduced_op(
            hidden_2d, weight, bias, labels_1d, denominator, *options, *chunking, *needs, class_weight, weights_1d
        )[0]
    return ReducedFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, None, class_weight, None,
        weights_1d,
    )  # fmt: skip
