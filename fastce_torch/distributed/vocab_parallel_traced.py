"""The vocab-parallel cross-entropy as torch.compile traces it (no graph break, no host synchronisation): the local
statistics and the loss as torch.library custom ops around two functional all-reduces of O(N) floats.

The compiler sees the local statistics kernel and the loss as opaque ops and the two all-reduces as functional
collectives between them. The collectives carry no gradient: the loss op's backward gives each rank's columns of
d loss / d logits from the global logsumexp directly (the eager backward's kernel, no communication), which is the
derivative through the combined statistics. The eager path is vocab_parallel.py.
"""

import torch

from ..core.custom_ops import op_schema, records_of
from ..core.options import Options
from ..core.reference import (
    global_statistics,
    logits_gradient,
    reduce_losses,
    row_statistics,
    token_loss_from_statistics,
    transform,
)
from ..losses.cross_entropy import launch
from .vocab_parallel import reduced_statistics

__all__ = ["traced_vocab_parallel_cross_entropy"]


def _functional_all_reduce(tensor, op, group):
    # Functional collectives are ops dynamo traces into the graph (an in-place dist.all_reduce is a graph break);
    # wait_tensor makes the result an ordinary tensor, so the eager fallback of a graph break computes the same.
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(tensor, op, group))


# SymInt: under dynamic shapes the offsets are symbolic (rank * V_local).
_LAYOUT_SCHEMA = f"{op_schema(Options)}, SymInt vocab_start, SymInt vocab_total"


@torch.library.custom_op(
    "fastce::vocab_parallel_statistics",
    mutates_args=(),
    schema=f"(Tensor logits, Tensor labels, {_LAYOUT_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)
def _statistics_op(logits, labels, *options_and_layout):
    options, (vocab_start, vocab_total) = records_of(options_and_layout, Options)
    lse, z_label, sum_z = launch.forward(logits, labels, options, vocab_start=vocab_start, vocab_total=vocab_total)
    return lse.clone(), z_label, sum_z  # lse is a view of the launch's scratch buffer; an op's output owns its storage


@_statistics_op.register_fake
def _(logits, labels, *options_and_layout):
    n_rows = labels.shape[0]
    return tuple(logits.new_empty(n_rows, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op(
    "fastce::vocab_parallel_loss",
    mutates_args=(),
    schema=f"(Tensor logits, Tensor labels, Tensor maxima, Tensor sums, {_LAYOUT_SCHEMA}, bool use_kernel) -> Tensor",
)
def _loss_op(logits, labels, maxima, sums, *options_and_layout):
    """The per-token loss from reduced_statistics' reduced tensors; `logits` is only there for the backward. The
    op takes the all-reduces' outputs themselves (not the lse derived from them) and its backward derives the lse
    again: were anything computed from the logits before the all-reduces saved for the backward, a partitioner
    could recompute it there, collectives included (torch never eliminates a collective as dead code)."""
    options, (_, vocab_total, _) = records_of(options_and_layout, Options)
    lse, z_label, sum_z = global_statistics(maxima, sums, labels.shape[0])
    return token_loss_from_statistics(lse, z_label, sum_z, labels, options, vocab_total)


@_loss_op.register_fake
def _(logits, labels, maxima, sums, *options_and_layout):
    return sums.new_empty(labels.shape)


@torch.library.custom_op(
    "fastce::vocab_parallel_backward",
    mutates_args=(),
    schema=f"(Tensor grad_loss, Tensor logits, Tensor labels, Tensor lse, {_LAYOUT_SCHEMA}) -> Tensor",
)
def _backward_op(grad_loss, logits, labels, lse, *options_and_layout):
    options, (vocab_start, vocab_total) = records_of(options_and_layout, Options)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return launch.backward(
        grad_loss, logits, labels, lse, grad, options, vocab_start=vocab_start, vocab_total=vocab_total
    )


@_backward_op.register_fake
def _(grad_loss, logits, labels, lse, *options_and_layout):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _loss_setup_context(ctx, inputs, output):
    logits, labels, maxima, sums, *options_and_layout = inputs
    ctx.save_for_backward(logits, labels, maxima, sums)
    *ctx.options_and_layout, ctx.use_kernel = options_and_layout


def _loss_backward(ctx, grad_loss):
    logits, labels, maxima, sums = ctx.saved_tensors
    lse = global_statistics(maxima, sums, labels.shape[0])[0]
    if ctx.use_kernel:
        grad = _backward_op(grad_loss, logits, labels, lse, *ctx.options_and_layout)
    else:
        options, (vocab_start, vocab_total) = records_of(ctx.options_and_layout, Options)
        grad = logits_gradient(grad_loss, logits, labels, lse, options, vocab_start, vocab_total).to(logits.dtype)
    return grad, *[None] * (3 + len(ctx.options_and_layout) + 1)


torch.library.register_autograd("fastce::vocab_parallel_loss", _loss_backward, setup_context=_loss_setup_context)


def traced_vocab_parallel_cross_entropy(logits, labels, reduction, n_items, options, layout, use_kernel):
    """vocab_parallel_cross_entropy as torch.compile traces it (no graph break, no host synchronisation): the
    statistics op, two functional all-reduces of O(N) floats, the loss op, the reduction in plain torch. The compiler
    plans the gradient's memory itself (inplace_backward does not apply), and a second backward through the compiled
    graph is refused by torch.compile."""
    group, vocab_start, vocab_total, check_equal_widths = layout
    local_width = logits.shape[-1]
    logits_2d = logits.reshape(-1, local_width)
    if logits_2d.stride(-1) != 1 and local_width > 1:
        logits_2d = logits_2d.contiguous()
    labels_1d = labels.reshape(-1).contiguous()
    # The statistics carry no gradient (the loss op's backward accounts for them).
    with torch.no_grad():
        if use_kernel:
            statistics = _statistics_op(logits_2d, labels_1d, *options, vocab_start, vocab_total)
        else:
            z = transform(logits_2d, options, labels_1d)
            statistics = row_statistics(z, labels_1d, options, vocab_start)
    with_sum_z = options.label_smoothing > 0.0
    maxima, sums, _ = reduced_statistics(
        *statistics, group, local_width, check_equal_widths, with_sum_z, _functional_all_reduce
    )
    losses = _loss_op(logits_2d, labels_1d, maxima, sums, *options, vocab_start, vocab_total, use_kernel)
    loss = reduce_losses(losses, labels_1d, reduction, n_items, options.ignore_index)
    return loss.view(labels.shape) if reduction == "none" else loss
