"""Vocab-parallel cross-entropy: the logits' vocabulary is split over the ranks of a process group (tensor
parallelism of the LM head), each rank holding a contiguous slice of columns; labels are global class ids,
the same on every rank.

Each rank reduces its own columns to three numbers per row (logsumexp over its slice, the transformed label logit
when it owns the label column, the sum of z for label smoothing); two all-reduces of O(N) floats combine them:
MAX of the local logsumexps, then SUM of [exp(lse_local - max), z_label, sum_z]. The loss, identical on every rank,
is computed from the combined per-row numbers; the backward needs no communication, since each rank's gradient
columns depend only on its own logits, the global logsumexp and the label.

`cross_entropy(..., process_group=group)` and a DTensor sharded on its last dimension (`Shard(-1)`) come here.
Eager calls run `_VocabParallelFunction` (in-place collectives, the kernels launched directly, the combine kernels of
combine.py between the two all-reduces); under torch.compile the same statistics and gradient are custom ops around
functional collectives (vocab_parallel_traced.py), so that the compiler traces the whole call. DTensor logits come
here through dtensor.py.
"""

import torch
import torch.distributed as dist

from ..core.guards import gradient_buffer, saved_logits
from ..core.launch import on_device
from ..core.options import loss_divisor
from ..core.outputs import extra_outputs
from ..core.reference import (
    entropy_gradient,
    global_statistics,
    logits_gradient,
    row_extras,
    row_shift,
    row_statistics,
    token_loss_from_statistics,
    transform,
)
from ..losses.cross_entropy import launch
from .combine import vocab_parallel_loss, vocab_parallel_rescale, vocab_parallel_statistics

__all__ = [
    "combine_statistics",
    "gathered_slices",
    "layout_of",
    "reduced_statistics",
    "shard_gradient",
    "shard_statistics",
    "vocab_parallel_cross_entropy",
]

# --- per-shard statistics and gradient: the only calls into the kernels ------------------------------------------


def shard_statistics(logits, labels, options, vocab_start, vocab_total, use_kernel, outputs=False):
    """Per-row float32 (lse over the local columns, transformed label logit where the label column is local else 0,
    sum of z over the local columns (zeros without smoothing)). Ignored rows' values are ignored by the loss (the
    kernels give them lse -inf, label logit 0, sum 0). With outputs (the extra outputs), then also the local argmax
    as a global column, the mean of z under the slice's softmax and the slice's largest z."""
    if use_kernel:
        return launch.forward(
            logits, labels, options, vocab_start=vocab_start, vocab_total=vocab_total, outputs=outputs
        )
    z = transform(logits, options, labels)
    statistics = row_statistics(z, labels, options, vocab_start)
    if not outputs:
        return statistics
    argmax, mean_z = row_extras(z)
    return (*statistics, argmax + vocab_start, mean_z, z.max(-1).values)


def shard_gradient(
    grad_output, denominator, logits, labels, lse, grad, options, vocab_start, vocab_total, use_kernel,
    grad_entropy=None, mean_z=None,
):  # fmt: skip
    """Writes the local columns of d loss / d logits into `grad` (which may be `logits` itself); grad_output is the
    per-token upstream gradient or one scalar, divided by denominator (0-d) unless None; lse the global
    logsumexp. grad_entropy, mean_z (per row, mean_z the global mz = lse - H): the entropy output's gradient too,
    in the same pass (launch.backward's HAS_ENTROPY_GRAD variant)."""
    entropy = {} if grad_entropy is None else dict(grad_entropy=grad_entropy, mean_z=mean_z)
    if use_kernel:
        denominator = None if denominator is None else denominator.reshape(1)
        return launch.backward(
            grad_output, logits, labels, lse, grad, options, denominator, vocab_start=vocab_start,
            vocab_total=vocab_total, **entropy,
        )  # fmt: skip
    grad_rows = grad_output.to(lse.dtype)
    if denominator is not None:
        grad_rows = (grad_rows / denominator).expand(labels.shape)
    gradient = logits_gradient(grad_rows.expand(labels.shape), logits, labels, lse, options, vocab_start,
                                        vocab_total)  # fmt: skip
    if grad_entropy is not None:
        gradient = gradient + entropy_gradient(grad_entropy, logits, labels, options, lse, mean_z)
    return grad.copy_(gradient)


# --- the collectives -----------------------------------------------------------------------------------------


def _all_reduce_in_place(tensor, op, group):
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return tensor


def combine_statistics(
    lse_local, z_label, sum_z, group, local_width, check_equal_widths, with_sum_z, extras=None, vocab_total=0
):
    """Global (lse, z_label, sum_z) per row from every rank's local statistics: two all-reduces of O(N) floats
    (with extras, the extra outputs' statistics as well: _combine_statistics_with_outputs)."""
    if extras is not None:
        return _combine_statistics_with_outputs(
            lse_local, z_label, sum_z, group, local_width, check_equal_widths, with_sum_z, extras, vocab_total
        )
    maxima, sums, shift = reduced_statistics(
        lse_local, z_label, sum_z, group, local_width, check_equal_widths, with_sum_z, _all_reduce_in_place
    )
    return global_statistics(maxima, sums, lse_local.shape[0], shift)


def reduced_statistics(lse_local, z_label, sum_z, group, local_width, check_equal_widths, with_sum_z, all_reduce):
    """The two all-reduces: (MAX over the ranks of the local logsumexps, SUM of [exp(lse_local - max), z_label,
    sum_z], the rows' shift: the max, 0 where it is -inf). all_reduce(tensor, "max" | "sum", group) returns the
    reduced tensor: in place in eager calls, functional collectives under torch.compile.

    With check_equal_widths (offsets derived from the rank), the MAX all-reduce also carries the local width and its
    negation: if the ranks' widths differ, the derived offsets are wrong, and every lse becomes NaN (so the loss and
    gradient show it) without a host synchronisation."""
    n_rows = lse_local.shape[0]
    # Fills, not a host-to-device copy: nothing here waits for the GPU.
    maxima = torch.empty(n_rows + 2 * check_equal_widths, dtype=lse_local.dtype, device=lse_local.device)
    maxima[:n_rows].copy_(lse_local)
    if check_equal_widths:
        maxima[n_rows].fill_(local_width)
        maxima[n_rows + 1].fill_(-local_width)
    maxima = all_reduce(maxima, "max", group)
    shift = row_shift(maxima, n_rows)
    parts = [torch.exp(lse_local - shift), z_label] + ([sum_z] if with_sum_z else [])
    sums = all_reduce(torch.stack(parts), "sum", group)
    return maxima, sums, shift


def _combine_statistics_with_outputs(
    lse_local, z_label, sum_z, group, local_width, check_equal_widths, with_sum_z, extras, vocab_total
):
    """Global (lse, z_label, sum_z) per row from every rank's local statistics: two all-reduces of O(N) floats.
    With extras = (argmax, mean_z, z_max) local (the extra outputs), then also the global (argmax, mean_z): the
    largest z rides on the MAX all-reduce, the mean of z (weighted by each slice's share of the softmax) on the SUM
    one, and the argmax takes one more all-reduce (MIN of the columns holding the largest z: the first on ties).

    With check_equal_widths (offsets derived from the rank), the MAX all-reduce also carries the local width and its
    negation: if the ranks' widths differ, the derived offsets are wrong, and every lse becomes NaN (so the loss and
    gradient show it) without a host synchronisation."""
    n_rows = lse_local.shape[0]
    # Fills, not a host-to-device copy: nothing here waits for the GPU.
    n_extra = n_rows if extras is not None else 0
    maxima = torch.empty(n_rows + n_extra + 2 * check_equal_widths, dtype=lse_local.dtype, device=lse_local.device)
    maxima[:n_rows].copy_(lse_local)
    if extras is not None:
        maxima[n_rows : 2 * n_rows].copy_(extras[2])
    if check_equal_widths:
        maxima[n_rows + n_extra].fill_(local_width)
        maxima[n_rows + n_extra + 1].fill_(-local_width)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    row_max = maxima[:n_rows]
    # Rows that are -inf on every rank (ignored rows, all -inf logits) shift by 0 (-inf - -inf would be NaN).
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    weight = torch.exp(lse_local - shift)
    parts = [weight, z_label] + ([sum_z] if with_sum_z else [])
    if extras is not None:
        parts.append(torch.where(weight > 0, weight * extras[1], 0.0))  # a slice with no softmax mass adds 0
    sums = torch.stack(parts)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    lse = shift + torch.log(sums[0])
    if check_equal_widths:
        equal = maxima[n_rows + n_extra] == -maxima[n_rows + n_extra + 1]
        lse = torch.where(equal, lse, float("nan"))
    combined = lse, sums[1], (sums[2] if with_sum_z else None)
    if extras is None:
        return combined
    z_max = maxima[n_rows : 2 * n_rows]
    candidates = torch.where(extras[2] == z_max, extras[0].long(), vocab_total)
    dist.all_reduce(candidates, op=dist.ReduceOp.MIN, group=group)
    return (*combined, candidates, sums[-1] / sums[0])


def _combined_by_kernels(logits, labels, reduction, n_items, options, layout):
    """The eager forward on the kernels: (loss, global lse, divisor or None) from the statistics kernel, the two
    all-reduces in place on one buffer and the combine kernels between and after them, 4 launches in all (the
    torch-ops path, for the plain-torch backend and the extra outputs, is combine_statistics)."""
    group, vocab_start, vocab_total, check_equal_widths = layout
    with on_device(logits):
        statistics = vocab_parallel_statistics(logits, labels, options, vocab_start, vocab_total, check_equal_widths)
        dist.all_reduce(statistics.maxima, op=dist.ReduceOp.MAX, group=group)
        vocab_parallel_rescale(statistics)
        dist.all_reduce(statistics.sums, op=dist.ReduceOp.SUM, group=group)
        # Labels are the same on every rank, so the local kept-token count is the global one.
        return vocab_parallel_loss(statistics, labels, options, reduction, n_items, vocab_total)


class _VocabParallelFunction(torch.autograd.Function):
    """Collectives in the forward only; the backward is local."""

    @staticmethod
    def forward(ctx, logits, labels, reduction, n_items, inplace_backward, options, layout, use_kernel, extras=None):
        group, vocab_start, vocab_total, check_equal_widths = layout
        outputs = extras is not None
        if use_kernel and not outputs:
            loss, lse, denominator = _combined_by_kernels(logits, labels, reduction, n_items, options, layout)
        else:
            with on_device(logits):
                lse_local, z_label, sum_z, *local_extras = shard_statistics(
                    logits, labels, options, vocab_start, vocab_total, use_kernel, outputs
                )
            with_sum_z = options.label_smoothing > 0.0
            lse, z_label, sum_z, *global_extras = combine_statistics(
                lse_local, z_label, sum_z, group, logits.shape[-1], check_equal_widths, with_sum_z,
                local_extras if outputs else None, vocab_total,
            )  # fmt: skip
            losses = token_loss_from_statistics(lse, z_label, sum_z, labels, options, vocab_total)
            # Labels are the same on every rank, so the local kept-token count is the global one.
            denominator = loss_divisor(labels, reduction, n_items, options.ignore_index)
            loss = losses if denominator is None else losses.sum() / denominator
        entropy_grad = outputs and extras.entropy  # lse_out and mean_z then carry their true derivatives
        ctx.save_for_backward(logits, labels, lse, denominator, *(global_extras[1:] if entropy_grad else ()))
        ctx.inplace_backward, ctx.options, ctx.use_kernel = inplace_backward, options, use_kernel
        ctx.vocab_start, ctx.vocab_total, ctx.consumed, ctx.group = vocab_start, vocab_total, False, group
        ctx.extras = extras
        if not outputs:
            return loss
        # The extra outputs' statistics: lse is differentiable when the z_loss output is asked.
        lse_out = lse.clone()
        constant = global_extras[: 1 if entropy_grad else 2]  # argmax; mean_z unless the entropy is asked
        ctx.mark_non_differentiable(*constant, *(() if extras.z_loss or entropy_grad else (lse_out,)))
        ctx.set_materialize_grads(False)
        return loss, lse_out, *global_extras

    @staticmethod
    def backward(ctx, grad_output, *grad_extras):
        logits, labels, lse, denominator, *mean_z = saved_logits(ctx)
        grad_lse = grad_extras[0] if grad_extras and ctx.extras.z_loss else None
        # The entropy (lse - mz): mz's upstream b is -g_H, and the lse part's upstream a + b (as in
        # losses/cross_entropy/autograd.py).
        grad_mean_z = grad_extras[2] if mean_z else None
        if grad_lse is not None and grad_mean_z is not None:
            grad_lse = grad_lse + grad_mean_z
        grad_entropy = None if grad_mean_z is None else -grad_mean_z
        if grad_lse is not None or grad_entropy is not None:
            return _VocabParallelFunction._backward_outputs(
                ctx, grad_output, grad_lse, logits, labels, lse, denominator, grad_entropy, *mean_z
            )
        if grad_output is None:
            return (None,) * 9
        if torch.is_grad_enabled():
            # create_graph=True: the gradient is differentiated again, so it is built from differentiable ops (and
            # one differentiable all-reduce) on the intact logits, before anything is written in place.
            grad = _differentiable_shard_gradient(grad_output, denominator, logits, labels, lse, ctx)
            return grad, None, None, None, None, None, None, None
        grad = gradient_buffer(ctx, logits)
        with on_device(logits):
            shard_gradient(
                grad_output, denominator, logits, labels, lse, grad, ctx.options, ctx.vocab_start, ctx.vocab_total,
                ctx.use_kernel,
            )  # fmt: skip
        return grad, None, None, None, None, None, None, None

    @staticmethod
    def _backward_outputs(ctx, grad_output, grad_lse, logits, labels, lse, denominator, grad_entropy=None, mean_z=None):
        """With the z_loss or the entropy output differentiated: the z_loss output's part (the gradient of the global
        lse on this rank's columns, no communication) from the intact logits, then the loss's and the entropy's
        (with the global mz, no communication either) in one pass."""
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "create_graph=True through the z_loss or entropy output of vocab-parallel cross_entropy is not "
                "supported; differentiate the loss alone twice, or use plain (unsharded) logits"
            )
        loss_or_entropy = grad_output is not None or grad_entropy is not None
        if grad_output is None:  # no loss upstream (and no divisor) for the pass that adds the entropy's part
            grad_output, denominator = torch.zeros((), dtype=torch.float32, device=logits.device), None
        entropy = dict(grad_entropy=grad_entropy, mean_z=mean_z)
        if grad_lse is None:  # the loss's and the entropy's parts in one pass, in place when allowed
            grad = gradient_buffer(ctx, logits)
            with on_device(logits):
                shard_gradient(
                    grad_output, denominator, logits, labels, lse, grad, ctx.options, ctx.vocab_start,
                    ctx.vocab_total, ctx.use_kernel, **entropy,
                )  # fmt: skip
            return grad, *(None,) * 8
        # Both parts in float32, rounded to the logits' dtype once.
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        with on_device(logits):
            if ctx.use_kernel:
                launch.lse_backward(grad_lse, logits, labels, lse, grad, ctx.options, vocab_total=ctx.vocab_total)
            else:
                lse_options = ctx.options._replace(label_smoothing=0.0, z_loss=0.0)
                grad.copy_(
                    logits_gradient(
                        grad_lse.to(lse.dtype), logits, labels, lse, lse_options, ctx.vocab_total, ctx.vocab_total
                    )
                )
            if loss_or_entropy:
                loss_grad = torch.empty_like(grad)
                shard_gradient(
                    grad_output, denominator, logits, labels, lse, loss_grad, ctx.options, ctx.vocab_start,
                    ctx.vocab_total, ctx.use_kernel, **entropy,
                )  # fmt: skip
                grad += loss_grad
        return grad.to(logits.dtype), *(None,) * 8


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd differentiates: its backward sums the cotangents over the ranks, which is the
    gradient of the sum over ranks of each rank's objective."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return _SumOverRanks.apply(grad_total, ctx.group), None


def _differentiable_shard_gradient(grad_output, denominator, logits, labels, lse, ctx):
    """This rank's columns of d loss / d logits in plain torch, differentiable again with respect to every rank's
    logits: the global logsumexp is recomputed as the saved one (a constant shift, detached) plus the log of a
    differentiable sum over the ranks of exp(local logsumexp - shift). A second backward through it therefore runs
    the same all-reduce on every rank: each rank must differentiate (all ranks call backward together, as they do
    for the loss). The rank's result is the gradient of the sum over the ranks of each rank's objective (for a
    Hessian-vector product, sum over ranks of <v_rank, grad_rank>, each rank gets its columns of H v)."""
    z = transform(logits, ctx.options, labels)
    shift = torch.where(torch.isfinite(lse), lse, 0.0).detach()
    local = torch.exp(torch.logsumexp(z, dim=-1) - shift)
    global_lse = shift + torch.log(_SumOverRanks.apply(local, ctx.group))
    global_lse = torch.where(torch.isnan(lse), lse, global_lse)  # unequal widths: NaN stays NaN
    grad_rows = grad_output.float()
    if denominator is not None:
        grad_rows = grad_rows / denominator
    grad_rows = grad_rows.expand(labels.shape)
    grad = logits_gradient(grad_rows, logits, labels, global_lse, ctx.options, ctx.vocab_start, ctx.vocab_total)
    return grad.to(logits.dtype)


# --- layouts: where this rank's columns sit in the global vocabulary ------------------------------------------


def _explicit_layout(group, vocab_start, local_width, device):
    """Global vocabulary size from explicit offsets: every rank's (start, width) is gathered (O(world) integers,
    one host synchronisation per call) and must tile [0, V) without gaps or overlaps."""
    return gathered_slices(group, vocab_start, local_width, device)[-1][0]


def gathered_slices(group, vocab_start, local_width, device):
    """Every rank's (start, width), sorted, checked to tile [0, V), then (V, 0) appended: O(world) integers, one
    host synchronisation."""
    mine = torch.tensor([vocab_start, local_width], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    slices = sorted(tuple(int(v) for v in t.tolist()) for t in gathered)
    end = 0
    for start, width in slices:
        if start != end:
            raise ValueError(
                f"vocab_start: the ranks' vocabulary slices (start, width) {slices} do not tile [0, V) contiguously"
            )
        end = start + width
    return [*slices, (end, 0)]


def layout_of(group, vocab_start, local_width, device):
    """(group, vocab_start, vocab_total, check_equal_widths) for a plain-tensor call."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised (init_process_group)")
    if vocab_start is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return group, rank * local_width, world * local_width, True
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    return group, vocab_start, _explicit_layout(group, vocab_start, local_width, device), False


def vocab_parallel_cross_entropy(
    logits, labels, reduction, n_items, inplace_backward, options, layout, use_kernel, extras=None
):
    """logits (..., V_local) this rank's columns, labels (...) global ids; returns the loss of the contract (with
    extras, a Extras asking for some: CrossEntropyOutput)."""
    local_width = logits.shape[-1]
    logits_2d = logits.reshape(-1, local_width)
    if logits_2d.stride(-1) != 1 and local_width > 1:
        logits_2d = logits_2d.contiguous()
    # In place only where no two rows share memory (expanded logits).
    inplace_backward = inplace_backward and not launch.rows_overlap(logits_2d)
    labels_1d = labels.reshape(-1).contiguous()
    if extras is not None:
        loss, lse, argmax, mean_z = _VocabParallelFunction.apply(
            logits_2d, labels_1d, reduction, n_items, inplace_backward, options, layout, use_kernel, extras
        )
        loss = loss.view(labels.shape) if reduction == "none" else loss
        vocab_total = layout[2]
        return extra_outputs(
            loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab_total, None, extras.entropy
        )
    loss = _VocabParallelFunction.apply(
        logits_2d, labels_1d, reduction, n_items, inplace_backward, options, layout, use_kernel
    )
    return loss.view(labels.shape) if reduction == "none" else loss
