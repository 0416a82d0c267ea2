"""The contract's formulas in plain torch (CONTRACT.md), shared by every path that does not run the kernels and by
the kernels' differentiable backwards: the transform of the logits, the row statistics (logsumexp, label logit, sum
of z) and their vocab-parallel combination, the per-token loss (plain and class-weighted) and its reduction, and the
gradients in framework ops (the loss's d / d logits, the z_loss output's lse part, the entropy's), so that autograd
and torch.func can differentiate them again. float32 math, float64 for float64 logits."""

import torch

from .options import compute_dtype, label_weights, loss_divisor

__all__ = [
    "entropy_gradient",
    "global_statistics",
    "label_columns",
    "logits_gradient",
    "lse_gradient",
    "reduce_losses",
    "reference_token_losses",
    "row_extras",
    "row_shift",
    "row_statistics",
    "softmax_mean",
    "token_loss_from_statistics",
    "transform",
    "weighted_token_losses",
]


def reduce_losses(token_losses, labels, reduction, n_items, ignore_index, weight=None):
    """The reduction in plain torch (the reference and torch.compile paths; the eager kernels reduce in-kernel)."""
    divisor = loss_divisor(labels, reduction, n_items, ignore_index, token_losses.dtype, weight)
    return token_losses if divisor is None else token_losses.sum() / divisor


def transform(logits, options, labels=None):
    """z: the logits in the compute dtype, scaled, then soft-capped. With labels, ignored rows are zeroed first, so
    that NaN there cannot leak into any arithmetic (or their zero gradient)."""
    if labels is not None:
        logits = torch.where((labels == options.ignore_index).unsqueeze(-1), 0.0, logits)
    z = logits.to(compute_dtype(logits.dtype))
    if options.logit_scaling != 0.0:
        z = z * options.logit_scaling
    if options.logit_softcapping > 0.0:
        z = options.logit_softcapping * torch.tanh(z / options.logit_softcapping)
    return z


def label_columns(labels, vocab_start, width, ignore_index):
    """(the column of each label in a slice [vocab_start, vocab_start + width), clamped into it; whether the slice
    holds the label)."""
    column = labels.long() - vocab_start
    owned = (column >= 0) & (column < width) & (labels != ignore_index)
    return column.clamp(0, max(width - 1, 0)), owned


def row_statistics(z, labels, options, vocab_start=0):
    """Per row of z (..., width), the columns [vocab_start, vocab_start + width) of the vocabulary: (logsumexp,
    the label's z where the slice holds the label else 0, sum of z (zeros without label smoothing)). Ignored rows
    give finite values that the loss ignores."""
    lse = torch.logsumexp(z, dim=-1)
    column, owned = label_columns(labels, vocab_start, z.shape[-1], options.ignore_index)
    label_logit = torch.where(owned, z.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
    sum_z = z.sum(dim=-1) if options.label_smoothing > 0.0 else torch.zeros_like(lse)
    return lse, label_logit, sum_z


def row_shift(maxima, n_rows):
    """The shift of each row's combined logsumexp: the reduced maximum, 0 where it is -inf (rows that are -inf on
    every rank, ignored or all -inf logits: -inf - -inf would be NaN)."""
    row_max = maxima[:n_rows]
    return torch.where(row_max == float("-inf"), 0.0, row_max)


def global_statistics(maxima, sums, n_rows, shift=None):
    """Vocab-parallel: (lse, z_label, sum_z or None) per row from the two all-reduced tensors of
    distributed/vocab_parallel.reduced_statistics (maxima holds 2 more entries, the widths, when they are checked;
    sums a third row, sum_z, with label smoothing) and its shift (derived again from maxima when None)."""
    shift = row_shift(maxima, n_rows) if shift is None else shift
    lse = shift + torch.log(sums[0])
    if maxima.shape[0] > n_rows:
        lse = torch.where(maxima[n_rows] == -maxima[n_rows + 1], lse, float("nan"))
    return lse, sums[1], (sums[2] if sums.shape[0] > 2 else None)


def token_loss_from_statistics(lse, label_logit, sum_z, labels, options, vocab):
    """The contract's per-token loss from a row's (logsumexp, label z, sum of z) over the whole vocabulary."""
    _, _, _, label_smoothing, z_loss = options
    loss = lse - label_logit
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_z / vocab)
    if z_loss != 0.0:
        loss = loss + z_loss * lse * lse
    ignored = labels == options.ignore_index
    # Multiply (not where) so that an out-of-range row's gradient is NaN too, as the kernels give it.
    loss = loss * torch.where(((labels >= 0) & (labels < vocab)) | ignored, 1.0, float("nan")).to(loss.dtype)
    return torch.where(ignored, 0.0, loss)


def reference_token_losses(logits, labels, options, weight=None):
    """Per-token losses of the contract in plain torch (differentiable by autograd; backend='reference'): float32
    math and losses, float64 for float64 logits. weight: class weights (V,) or None."""
    z = transform(logits, options, labels)
    if weight is not None:
        return weighted_token_losses(z, labels, options, weight)
    return token_loss_from_statistics(*row_statistics(z, labels, options), labels, options, logits.shape[-1])


def weighted_token_losses(z, labels, options, weight):
    """F.cross_entropy's weighted per-token loss of transformed logits z (..., V): w[y] (1 - eps)(lse - z_y)
    + (eps / V) sum_c w_c (lse - z_c) + w[y] z_loss lse^2 (a class of weight 0 takes no part, even at z = -inf);
    NaN for a label outside [0, V), 0 where ignored."""
    _, _, _, label_smoothing, z_loss = options
    vocab = z.shape[-1]
    weight = weight.to(z.dtype)
    lse, label_logit, _ = row_statistics(z, labels, options._replace(label_smoothing=0.0))
    w_label = label_weights(labels, weight, vocab)
    loss = w_label * (lse - label_logit)
    if label_smoothing > 0.0:
        spread = torch.where(weight == 0.0, 0.0, weight * (lse.unsqueeze(-1) - z)).sum(-1)
        loss = (1.0 - label_smoothing) * loss + label_smoothing / vocab * spread
    if z_loss != 0.0:
        loss = loss + w_label * z_loss * lse * lse
    ignored = labels == options.ignore_index
    loss = loss * torch.where(((labels >= 0) & (labels < vocab)) | ignored, 1.0, float("nan")).to(loss.dtype)
    return torch.where(ignored, 0.0, loss)


def logits_gradient(grad_rows, logits, labels, lse, options, vocab_start=0, vocab_total=None, weight=None):
    """d loss / d logits of the columns [vocab_start, vocab_start + V) (float32; float64 for float64 logits) in
    plain torch ops, so that autograd and torch.func can differentiate it again: grad_rows (N,) the per-token
    upstream, lse (N,) the logsumexp over the whole vocabulary of vocab_total (default V), or None for that of these
    logits themselves. weight: class weights (V,) or None (not with a slice of the vocabulary)."""
    ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss = options
    vocab_total = logits.shape[-1] if vocab_total is None else vocab_total
    ignored = labels == ignore_index
    z = transform(logits, options, labels)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    dz = torch.exp(z - lse.unsqueeze(-1))
    column, owned = label_columns(labels, vocab_start, logits.shape[-1], ignore_index)
    if weight is not None:
        # w[y] ((1 - eps)(p - onehot) + 2 z_loss lse p) + (eps / V)(W p - w)
        weight = weight.to(dz.dtype)
        w_label = label_weights(labels, weight, vocab_total).unsqueeze(-1)
        coefficient = w_label * (1.0 - label_smoothing + 2.0 * z_loss * lse.unsqueeze(-1))
        dz = dz * (coefficient + label_smoothing / vocab_total * weight.sum())
        label_mass = owned.to(dz.dtype) * (1.0 - label_smoothing) * w_label.squeeze(-1)
        dz = dz.scatter_add(-1, column.unsqueeze(-1), -label_mass.unsqueeze(-1))
        if label_smoothing > 0.0:
            dz = dz - label_smoothing / vocab_total * weight
    else:
        if z_loss != 0.0:
            dz = dz * (1.0 + 2.0 * z_loss * lse.unsqueeze(-1))
        label_mass = owned.to(dz.dtype) * (1.0 - label_smoothing)
        dz = dz.scatter_add(-1, column.unsqueeze(-1), -label_mass.unsqueeze(-1))
        if label_smoothing > 0.0:
            dz = dz - label_smoothing / vocab_total
    if logit_softcapping > 0.0:
        tanh_z = z / logit_softcapping
        dz = dz * (1.0 - tanh_z * tanh_z)
    if logit_scaling != 0.0:
        dz = dz * logit_scaling
    in_range = (labels >= 0) & (labels < vocab_total)
    scale = torch.where(in_range, grad_rows.to(dz.dtype), float("nan"))  # a bad label's whole row is NaN
    return torch.where(ignored.unsqueeze(-1), 0.0, dz * scale.unsqueeze(-1))


# --- the extra outputs' statistics and gradients ----------------------------------------------------------------


def row_extras(z):
    """Per row of transformed logits z (..., V): (argmax, first index on ties, as int64; the mean of z under
    softmax(z), with -inf logits contributing 0). Plain torch, for the reference paths."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    mean_z = torch.where(p > 0, p * z, 0.0).sum(-1)
    return z.argmax(-1), mean_z


def lse_gradient(grad_lse, logits, labels, options):
    """d(sum_t grad_lse_t * lse_t) / d logits (..., V) in differentiable plain torch (float32; float64 for
    float64 logits): the z_loss output's gradient, as losses/cross_entropy/launch.lse_backward computes it."""
    vocab = logits.shape[-1]
    options = options._replace(label_smoothing=0.0, z_loss=0.0)
    rows, flat = logits.reshape(-1, vocab), labels.reshape(-1)
    grad = logits_gradient(grad_lse.reshape(-1), rows, flat, None, options, vocab_start=vocab, vocab_total=vocab)
    return grad.to(logits.dtype).reshape(logits.shape)


def softmax_mean(z):
    """(p = softmax(z), mz = sum_j p_j z_j per row, keepdim, and z with 0 where p_j = 0) in differentiable plain torch:
    -inf logits contribute 0 to mz and to its gradient (no 0 * inf, in the forward or the backward)."""
    p = torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
    z_kept = torch.where(p > 0, z, 0.0)
    return p, (p * z_kept).sum(-1, keepdim=True), z_kept


def entropy_gradient(grad_entropy, logits, labels, options, lse=None, mean_z=None):
    """d(sum_t grad_entropy_t * H_t) / d logits (..., V) in differentiable plain torch (float32; float64 for float64
    logits), H the entropy of softmax(z): dH/dz_j = p_j (mz - z_j), mz = sum_j p_j z_j, then dz/dx; 0 on ignored
    rows: what the cross-entropy's backward kernel adds with grad_entropy= and mean_z=. lse, mean_z: per row (N,),
    given for a slice of the vocabulary (vocab-parallel: the global ones); None: those of these logits."""
    shape, labels = logits.shape, labels.reshape(-1)
    logits = logits.reshape(-1, shape[-1])
    z = transform(logits, options, labels)
    if lse is None:
        p, mean_z, z_kept = softmax_mean(z)
    else:
        p = torch.exp(z - lse.to(z.dtype).unsqueeze(-1))
        z_kept, mean_z = torch.where(p > 0, z, 0.0), mean_z.to(z.dtype).unsqueeze(-1)
    dz = p * (mean_z - z_kept) * grad_entropy.reshape(labels.shape).to(z.dtype).unsqueeze(-1)
    if options.logit_softcapping > 0.0:
        tanh_z = z / options.logit_softcapping
        dz = dz * (1.0 - tanh_z * tanh_z)
    if options.logit_scaling != 0.0:
        dz = dz * options.logit_scaling
    dz = torch.where((labels == options.ignore_index).unsqueeze(-1), 0.0, dz)
    return dz.to(logits.dtype).reshape(shape)
