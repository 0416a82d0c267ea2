"""The fused linear cross-entropy of an unsharded head: the dispatch between the plain-torch path, the eager autograd
Functions and, under torch.compile, the custom ops (autograd.py), with and without the extra outputs; and the extra
outputs' fields from the per-row statistics (output_fields, which sharded.py uses too)."""

import torch

from .. import contract
from . import chunks
from .autograd import (
    _outputs_forward_op,
    _per_token_forward_op,
    _PerTokenFunction,
    _reduced_op,
    _ReducedFunction,
    _weighted,
    row_entropy,
)
from .chunks import autocast_or_common_dtype, transposed_view


def output_fields(loss, lse, argmax, entropy, labels, options, extras, reduction, n_items, vocab, class_weight=None,
                  token_weights=None):  # fmt: skip
    """CrossEntropyOutput from the loss and per-row (lse, argmax, entropy) (N,): lse and accuracy as
    contract.extra_outputs gives them; the z_loss field (differentiable through lse) also weighted by the token
    weights (per row, 0 where ignored); the entropy field differentiable through `entropy`, not weighted, reduced
    by the unweighted divisor. NaN in both on a row holding NaN or +inf."""
    out = contract.extra_outputs(
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
            term = term * contract.label_weights(labels, class_weight.to(term.dtype), vocab)
        term = _weighted(term, None if token_weights is None else token_weights.view(shape))
        divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype, class_weight)
        out["z_loss"] = term if divisor is None else term.sum() / divisor
    if extras.entropy:
        entropy = torch.where(torch.isnan(lse.detach()), float("nan"), entropy.view(shape))
        entropy = torch.where(ignored, 0.0, entropy)
        divisor = contract.loss_divisor(labels, reduction, n_items, ignore_index, lse.dtype)
        out["entropy"] = entropy if divisor is None else entropy.sum() / divisor
    return contract.CrossEntropyOutput(**out)


def reference_logits(hidden, weight, bias, chunking):
    """The plain-torch path's logits: F.linear in the compute dtype, or in float32 for float32 logits."""
    if chunking.float32_logits:
        hidden, weight, bias = (None if t is None else t.float() for t in (hidden, weight, bias))
    if transposed_view(weight):  # weight_layout="hv": hidden @ (H, V) as stored, so its gradient comes back (H, V)
        logits = torch.matmul(hidden, weight.t())
        return logits if bias is None else logits + bias
    return torch.nn.functional.linear(hidden, weight, bias)


def _reference_outputs(hidden, weight, bias, labels, options, reduction, n_items, chunking, extras, class_weight,
                       token_weights):  # fmt: skip
    """The plain-torch path with extra outputs: every field differentiable where the contract says so."""
    logits = reference_logits(hidden, weight, bias, chunking)
    token_losses = contract.reference_token_losses(logits, labels, options, class_weight)
    loss = contract.reduce_losses(
        _weighted(token_losses, token_weights), labels, reduction, n_items, options.ignore_index, class_weight
    )
    z = contract.transform(logits, options, labels)
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
    compute dtype, 0 where ignored (api.py prepares them), or None."""
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    vocab = weight.shape[0]
    if not contract.use_kernel(hidden, backend):
        return _reference_outputs(
            hidden, weight, bias, labels, options, reduction, n_items, chunking, extras, class_weight, token_weights
        )
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    weights_1d = None if token_weights is None else token_weights.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        token_losses, lse, argmax, entropy = _outputs_forward_op(
            hidden_2d, weight, bias, labels_1d, *options, *chunking, extras.z_loss, extras.entropy, class_weight
        )
        token_losses = _weighted(token_losses.view(labels.shape), token_weights)
        loss = contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    elif reduction == "none":
        token_losses, lse, argmax, entropy = _PerTokenFunction.apply(
            hidden_2d, weight, bias, labels_1d, options, chunking, extras, class_weight
        )
        loss = _weighted(token_losses, weights_1d).view(labels.shape)
    else:
        needs = gradients_needed(hidden, weight, bias)
        denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
        loss, lse, argmax, entropy = _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, extras, class_weight, None,
            weights_1d,
        )  # fmt: skip
    return output_fields(
        loss, lse, argmax, entropy, labels, options, extras, reduction, n_items, vocab, class_weight, weights_1d
    )


def gradients_needed(hidden, weight, bias):
    """Which of (hidden, weight, bias) the computation owes a gradient."""
    grad_enabled = torch.is_grad_enabled()
    return (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )


def unsharded_loss(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight=None,
    token_weights=None,
):  # fmt: skip
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    if not contract.use_kernel(hidden, backend):
        logits = reference_logits(hidden, weight, bias, chunking)
        token_losses = _weighted(contract.reference_token_losses(logits, labels, options, class_weight), token_weights)
        return contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    weights_1d = None if token_weights is None else token_weights.reshape(-1).contiguous()
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        if compiling:
            token_losses = _per_token_forward_op(hidden_2d, weight, bias, labels_1d, *options, *chunking, class_weight)
            token_losses = token_losses[0]
        else:
            token_losses = _PerTokenFunction.apply(
                hidden_2d, weight, bias, labels_1d, options, chunking, None, class_weight
            )
        return _weighted(token_losses, weights_1d).view(labels.shape)
    needs = gradients_needed(hidden, weight, bias)
    n_rows = hidden_2d.shape[0]
    one_chunk = 0 < n_rows <= chunks.rows_per_chunk(n_rows, weight.shape[0], hidden.element_size(), *chunking[:2])
    plain = class_weight is None and token_weights is None and not chunking.skip_ignored_rows
    if not compiling and one_chunk and plain and not chunking.float32_logits:
        return _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, None, options, chunking, needs, None, None, (reduction, n_items)
        )
    denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
    if compiling:
        return _reduced_op(
            hidden_2d, weight, bias, labels_1d, denominator, *options, *chunking, *needs, class_weight, weights_1d
        )[0]
    return _ReducedFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, None, class_weight, None,
        weights_1d,
    )  # fmt: skip
