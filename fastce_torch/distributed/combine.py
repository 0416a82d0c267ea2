"""Vocab-parallel mode: the kernels that combine the ranks' per-row statistics around the two all-reduces, and the
three host-side steps that launch them (`vocab_parallel_statistics`, `vocab_parallel_rescale`,
`vocab_parallel_loss`; the launches go through core/launch.py's launchers and capture guard, the statistics come from
the cross-entropy forward kernel's vocab-parallel mode)."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..core.kernel_helpers import cdiv
from ..core.launch import Launcher, launch_guarded, register_launchers
from ..losses.cross_entropy.forward import token_loss
from ..losses.cross_entropy.launch import denominator_operands, forward, option_flags

__all__ = [
    "VOCAB_PARALLEL_BLOCK",
    "VocabParallelStatistics",
    "maxima_launcher",
    "rescale_launcher",
    "vocab_parallel_loss",
    "vocab_parallel_loss_kernel",
    "vocab_parallel_loss_launcher",
    "vocab_parallel_maxima_kernel",
    "vocab_parallel_rescale",
    "vocab_parallel_rescale_kernel",
    "vocab_parallel_statistics",
]

# The forward kernel writes a rank's per-row statistics into rows 1-3 of one float32 buffer of 4 rows
# (`vocab_parallel_statistics`); these three kernels take it through the two all-reduces in place, so that the
# eager vocab-parallel call launches 4 kernels around its collectives instead of ~30 torch ops (bench/NOTES.md):
#   row 0: the MAX operand: the local lse, then the local width and its negation (the width check), then the divisor
#   row 1: the local lse; after the rescale, exp(lse_local - shift) (the SUM operand); after the combine, global lse
#   row 2: the label's z where this rank holds it, else 0;  row 3: the local sum of z (label smoothing)


@triton.jit
def vocab_parallel_maxima_kernel(
    statistics_ptr, stride, n_rows, width, CHECK_WIDTHS: tl.constexpr, BLOCK: tl.constexpr
):
    """Row 0 := row 1 (the local lse), and with CHECK_WIDTHS the local width and -width after it: the MAX all-reduce
    of both gives every rank max(width) and -min(width), equal only if all widths are."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_rows = offsets < n_rows
    tl.store(statistics_ptr + offsets, tl.load(statistics_ptr + stride + offsets, mask=in_rows), mask=in_rows)
    if CHECK_WIDTHS:
        if tl.program_id(0) == 0:
            tl.store(statistics_ptr + n_rows, width)
            tl.store(statistics_ptr + n_rows + 1, -width)


@triton.jit
def _row_shift(row_max):
    # A row that is -inf on every rank (ignored, or all -inf logits) shifts by 0: exp(-inf - 0) = 0, no -inf - -inf.
    return tl.where(row_max == float("-inf"), 0.0, row_max)


@triton.jit
def vocab_parallel_rescale_kernel(statistics_ptr, stride, n_rows, BLOCK: tl.constexpr):
    """Row 1 := exp(lse_local - shift), shift the reduced maximum of row 0: each rank's share of the row's sum."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_rows = offsets < n_rows
    shift = _row_shift(tl.load(statistics_ptr + offsets, mask=in_rows, other=0.0))
    lse_local = tl.load(statistics_ptr + stride + offsets, mask=in_rows, other=float("-inf"))
    tl.store(statistics_ptr + stride + offsets, tl.exp(lse_local - shift), mask=in_rows)


@triton.jit
def vocab_parallel_loss_kernel(
    statistics_ptr,  # (4, stride) after both all-reduces; row 1 receives the global lse, row 0 [n_rows + 2] the divisor
    stride,
    labels_ptr,
    losses_ptr,  # out ("none"): the per-token losses
    loss_ptr,  # out (REDUCE): the reduced loss
    n_items_ptr,  # in (DENOMINATOR_MODE 2): n_items as a float32 tensor
    n_rows,
    vocab_total,
    ignore_index,
    label_smoothing,
    z_loss,
    denominator_value,  # DENOMINATOR_MODE 1: the divisor ("sum": 1, or a number n_items)
    CHECK_WIDTHS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    REDUCE: tl.constexpr,
    DENOMINATOR_MODE: tl.constexpr,  # 0 the kept tokens (at least 1), 1 denominator_value, 2 *n_items_ptr
    BLOCK: tl.constexpr,
):
    """The global lse (NaN everywhere when the widths differ) and the contract's per-token loss (0 ignored, NaN for
    a label outside [0, vocab_total)); reduced, one program walks the rows in order, so the sum's order does not
    depend on the grid or the ranks' count (the reduced loss is the same on every rank, bitwise)."""
    widths_equal = True
    if CHECK_WIDTHS:
        widths_equal = tl.load(statistics_ptr + n_rows) == -tl.load(statistics_ptr + n_rows + 1)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    kept = tl.zeros([BLOCK], dtype=tl.float32)
    if REDUCE:
        n_blocks = tl.cdiv(n_rows, BLOCK)
        first = 0
    else:
        n_blocks = 1
        first = tl.program_id(0) * BLOCK
    for block in range(n_blocks):
        offsets = first + block * BLOCK + tl.arange(0, BLOCK)
        in_rows = offsets < n_rows
        shift = _row_shift(tl.load(statistics_ptr + offsets, mask=in_rows, other=0.0))
        lse = shift + tl.log(tl.load(statistics_ptr + stride + offsets, mask=in_rows, other=1.0))
        lse = tl.where(widths_equal, lse, float("nan"))
        z_label = tl.load(statistics_ptr + 2 * stride + offsets, mask=in_rows, other=0.0)
        sum_z = 0.0
        if HAS_SMOOTHING:
            sum_z = tl.load(statistics_ptr + 3 * stride + offsets, mask=in_rows, other=0.0)
        labels = tl.load(labels_ptr + offsets, mask=in_rows, other=ignore_index)
        loss = token_loss(z_label, labels, lse, sum_z, vocab_total, ignore_index, label_smoothing, z_loss,
                           HAS_SMOOTHING, HAS_Z_LOSS)  # fmt: skip
        tl.store(statistics_ptr + stride + offsets, lse, mask=in_rows)
        if REDUCE:
            total += tl.where(in_rows, loss, 0.0)
            kept += tl.where(in_rows & (labels != ignore_index), 1.0, 0.0)
        else:
            tl.store(losses_ptr + offsets, loss, mask=in_rows)
    if REDUCE:
        if DENOMINATOR_MODE == 0:
            denominator = tl.maximum(tl.sum(kept, axis=0), 1.0)
        elif DENOMINATOR_MODE == 1:
            denominator = denominator_value
        else:
            denominator = tl.load(n_items_ptr)
        tl.store(loss_ptr, tl.sum(total, axis=0) / denominator)
        tl.store(statistics_ptr + n_rows + 2, denominator)


# --- the host side -------------------------------------------------------------------------------------------------

maxima_launcher = Launcher(vocab_parallel_maxima_kernel)
rescale_launcher = Launcher(vocab_parallel_rescale_kernel)
vocab_parallel_loss_launcher = Launcher(vocab_parallel_loss_kernel)
register_launchers(__name__, "maxima_launcher", "rescale_launcher", "vocab_parallel_loss_launcher")

VOCAB_PARALLEL_BLOCK = 1024  # rows per program of the three combine kernels


class VocabParallelStatistics(NamedTuple):
    """One rank's per-row statistics in the 4-row float32 buffer the combine kernels work in (see the kernels'
    section above); `maxima` and `sums` are the MAX and SUM all-reduces' operands, views of `buffer`."""

    buffer: torch.Tensor
    maxima: torch.Tensor
    sums: torch.Tensor
    n_rows: int
    check_widths: bool


def vocab_parallel_statistics(logits, labels, options, vocab_start, vocab_total, check_widths, layout=None):
    """The forward kernel in vocab-parallel mode into a new statistics buffer, then the MAX operand (row 0) from
    it: two launches. check_widths: the operand also carries the local width and its negation."""
    n_rows = labels.shape[0]
    stride = -(-(n_rows + 3) // 16) * 16  # + the widths and the divisor; rows stay 16-element aligned
    buffer = torch.empty((4, stride), dtype=torch.float32, device=logits.device)
    rows = buffer[1:, :n_rows].unbind(0)
    forward(logits, labels, options, vocab_start=vocab_start, vocab_total=vocab_total, layout=layout,
            statistics_out=rows)  # fmt: skip
    n_sums = 3 if options.label_smoothing > 0.0 else 2
    statistics = VocabParallelStatistics(
        buffer, buffer[0, : n_rows + 2 * check_widths], buffer[1 : 1 + n_sums].view(-1), n_rows, check_widths
    )
    args = (buffer, stride, n_rows, float(logits.shape[-1]), check_widths, VOCAB_PARALLEL_BLOCK)
    grid = (max(cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    launch_guarded(maxima_launcher, grid, args, ("vocab-parallel maxima", buffer.device, check_widths), buffer)
    return statistics


def vocab_parallel_rescale(statistics):
    """After the MAX all-reduce: each rank's exp(lse_local - max) into the SUM operand (row 1)."""
    buffer, n_rows = statistics.buffer, statistics.n_rows
    args = (buffer, buffer.shape[1], n_rows, VOCAB_PARALLEL_BLOCK)
    grid = (max(cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    launch_guarded(rescale_launcher, grid, args, ("vocab-parallel rescale", buffer.device), buffer)


def vocab_parallel_loss(statistics, labels, options, reduction, n_items, vocab_total):
    """After the SUM all-reduce: (loss, global lse (N,), divisor) of the contract, one launch. loss is the per-token
    float32 losses for "none" (divisor None), else a 0-d tensor of its own, and the divisor a 1-element view of the
    buffer (the backward's). lse is row 1 of the buffer, overwritten in place."""
    buffer, n_rows = statistics.buffer, statistics.n_rows
    reduce = reduction != "none"
    loss = torch.empty(() if reduce else (n_rows,), dtype=torch.float32, device=buffer.device)
    denominator_mode, denominator_value, n_items_ptr = denominator_operands(reduction, n_items, buffer)
    flags = option_flags(options)
    args = (
        buffer, buffer.shape[1], labels, loss, loss, n_items_ptr, n_rows, vocab_total, options.ignore_index,
        options.label_smoothing, options.z_loss, denominator_value, statistics.check_widths, flags[2], flags[3],
        reduce, denominator_mode if reduce else 0, VOCAB_PARALLEL_BLOCK,
    )  # fmt: skip
    grid = (1 if reduce else max(cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    variant = ("vocab-parallel loss", buffer.device, labels.dtype, *args[12:17])
    launch_guarded(vocab_parallel_loss_launcher, grid, args, variant, buffer)
    lse = buffer[1, :n_rows]
    return loss, lse, (buffer[0, n_rows + 2 : n_rows + 3] if reduce else None)
