"""Triton kernels for the fused cross-entropy (see CONTRACT.md for the math), their launchers (`forward`,
`backward`) and launch configuration (`forward_config`, `backward_config`), with the tuned constants.

Two kernels, each reading the logits once (and _scale_unless_one_kernel, for linear_cross_entropy's gradients):
  _forward_kernel   grid (N, C): one program walks one chunk of one row, one exp per element, keeping the running
                    max, sum of exp and sum of z. With C > 1 each chunk publishes these partials and the row's last
                    chunk to finish combines them; then one masked scalar load reads the label logit, and the
                    per-token loss and logsumexp are written. For "mean"/"sum" the last row to finish in each
                    group of 64 rows sums the group, and the last group reduces the group sums, so a reduced
                    loss costs one launch and no framework ops.
  _backward_kernel  grid (N, cdiv(V, BLOCK)): recomputes z, writes the gradient in one pass, in place when the
                    caller passes the logits buffer as the gradient buffer.
Rows whose label is ignore_index are never read: their partials are empty and their gradient is written as zeros.
Rows are addressed as (batch, row) with two strides, so 2-D logits and strided 3-D logits (logits[:, :-1]) reach the
kernels without a copy. Row offsets are 64-bit, so N*V beyond 2**31 elements is fine.
The decomposition of a row (chunk width, tile width, warps) depends on V alone, never on N: a row's loss and
gradient are bitwise the same whatever batch it is computed in.
Vocab-parallel mode (VOCAB_PARALLEL, a constexpr: the single-device path compiles without it): the logits are one
rank's columns [vocab_start, vocab_start + V) of a vocabulary of vocab_total; the forward writes per row the local
logsumexp, the transformed label logit (0 unless this slice holds the label) and the local sum of z, for the caller
to combine across ranks; the backward takes the global logsumexp and places the label at column label - vocab_start.
Extra outputs (OUTPUTS, a constexpr: the default variants compile without it, bench/tools/same_ptx.py checks that
their instructions are unchanged): the forward also keeps per chunk the first column of the largest z and
sum_j e^(z_j - max) z_j, combines them like the other partials and writes per row the argmax and the mean of z
(accuracy and entropy in cross_entropy's CrossEntropyOutput); `lse_backward` is the z_loss output's gradient.
Launches go through `_Launcher`: Triton's generic `kernel[grid](...)` the first time a variant runs, then that compiled
variant's own launcher directly (see `_Launcher`; FASTCE_TORCH_LAUNCH_CACHE=0 at import turns this off).
"""

import contextlib
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

from .contract import Options  # noqa: F401  (the launchers' `options` argument; bench tools build it from here)

INTERPRETED = bool(knobs.runtime.interpret)


# Tiles and warps from bench/tools/tune_kernels.py on the H200 (2026-11-30, bench/NOTES.md): forward tiles of 4096
# with 4 warps reached 0.95-1.08x the one-read floor at N=8192 (stages 1 or 3 alike); backward tiles of 2048 with
# 4 warps 1.01-1.05x the read+write floor. Rows are split into chunks of 16384 columns whatever N is (batch
# invariance): at N=512, V=256000 chunks of 16384 (8192 programs) took 75 us against 90 us for 65536, and at N=8192
# the extra partials are 3 floats per 16384 logits.
FORWARD_BLOCK, FORWARD_WARPS, FORWARD_STAGES = 4096, 4, 3
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4
CHUNK = 16384
ROWS_PER_GROUP = 64  # rows counted per group before the batch-level count (in-kernel "mean"/"sum")
GROUPS_BLOCK = 1024  # groups summed per step by the batch's last group
SCALE_BLOCK = 4096  # elements per program of _scale_unless_one_kernel


@triton.jit
def _tanh(x):
    # libdevice's tanh is not available in Triton's interpreter; this form is exact enough and never overflows.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _transform(x, scaling, softcap, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """x -> z in float32: optional scaling (Cohere), then optional soft-capping (Gemma 2)."""
    z = x.to(tl.float32)
    if HAS_SCALING:
        z = z * scaling
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _row_offset(row, batch_stride, row_stride, rows_per_batch):
    """Element offset of flat row `row` in a (batch, rows_per_batch, V) view with arbitrary batch and row strides
    (a 2-D (N, V) tensor is one batch), so strided 3-D logits such as logits[:, :-1] need no copy. int64."""
    return (row // rows_per_batch) * batch_stride + (row % rows_per_batch) * row_stride


@triton.jit
def _combine_partials(part_max, part_sum):
    """logsumexp of a row from its chunks' (max, sum of exp(z - max)) pairs."""
    row_max = tl.max(part_max, 0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    return shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), 0))


@triton.jit
def _token_loss(
    z_label,
    label,
    lse,
    sum_z,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """The per-token loss of a row from its label's z (z_label), its label, logsumexp (lse) and sum of z (sum_z)
    over V columns: NaN for a label outside [0, V), 0 for ignore_index (contract.token_loss_from_statistics)."""
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < V)
    loss = lse - z_label
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_z / V)
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))  # a bad label shows as NaN, never as a plausible number
    return tl.where(ignored, 0.0, loss)


@triton.jit
def _weighted_token_loss(
    z_label,
    label,
    lse,
    sum_wz,
    w_label,
    w_sum,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """_token_loss with class weights w (F.cross_entropy's weight=): w[y] (1 - eps)(lse - z_y)
    + (eps / V)(W lse - sum_c w_c z_c) + w[y] z_loss lse^2, from w_label = w[y], w_sum = W = sum_c w_c and
    sum_wz = sum_c w_c z_c."""
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < V)
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * w_label * (lse - z_label) + label_smoothing / V * (w_sum * lse - sum_wz)
    else:
        loss = w_label * (lse - z_label)
    if HAS_Z_LOSS:
        loss += w_label * z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    return tl.where(ignored, 0.0, loss)


@triton.jit
def _dloss_dlogits(
    p,
    tanh_z,
    cols,
    label,
    lse,
    V,
    scaling,
    label_smoothing,
    z_loss,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """d loss / d x for a tile, from p = softmax(z) and (with soft-capping) tanh of the capped argument:
    dL/dz_j = p_j (1 + 2 z_loss lse) - (1 - eps) [j == y] - eps / V, then the chain rule back to x."""
    if HAS_Z_LOSS:
        dz = p * (1.0 + 2.0 * z_loss * lse)
    else:
        dz = p
    if HAS_SMOOTHING:
        dz = tl.where(cols == label, dz - (1.0 - label_smoothing), dz) - label_smoothing / V
    else:
        dz = tl.where(cols == label, dz - 1.0, dz)
    if HAS_SOFTCAP:
        dz = dz * (1.0 - tanh_z * tanh_z)
    if HAS_SCALING:
        dz = dz * scaling
    return dz


@triton.jit
def _forward_kernel(
    logits_ptr,
    logits_batch_stride,
    logits_row_stride,
    rows_per_batch,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    sum_z_out_ptr,
    scratch_ptr,
    arrivals_ptr,
    reduced_ptr,
    denominator_out_ptr,
    n_items_ptr,
    partials_offset,
    partials_stride,
    groups_offset,
    n_rows,
    V,
    chunk_width,
    n_chunks,
    ignore_index,
    scaling,
    softcap,
    label_smoothing,
    z_loss,
    denominator_value,
    vocab_start,
    weight_ptr,
    weight_sum_ptr,
    BLOCK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    REDUCE: tl.constexpr,
    DENOMINATOR: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr,
    ROWS_PER_GROUP: tl.constexpr,
    VOCAB_PARALLEL: tl.constexpr,
    OUTPUTS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Program (row, chunk) of the forward: the running max / sum of exp / sum of z over the chunk's columns.

    logits_ptr, logits_batch_stride, logits_row_stride, rows_per_batch: the logits, row r at
        (r // rows_per_batch) * batch stride + (r % rows_per_batch) * row stride (`row_layout`).
    labels_ptr: (n_rows,) int labels. loss_ptr: (n_rows,) float32 per-token losses (vocab-parallel: the label's z
        where this slice holds it, else 0). lse_ptr: (n_rows,) float32 logsumexp. sum_z_out_ptr: (n_rows,) float32
        sum of z (written in vocab-parallel mode only).
    scratch_ptr: the float32 scratch (chunk partials at partials_offset, partials_stride apart; the row groups'
        loss sums then kept counts at groups_offset; with OUTPUTS, after the five partials, rows padded to 16
        apart: the int32 argmax per row (a global column in vocab-parallel mode), the mean of z under softmax(z),
        and in vocab-parallel mode the slice's largest z). arrivals_ptr: the same buffer as int32 counters: [row] the
        row's finished chunks, [n_rows] the finished groups, [n_rows + 1 + g] group g's finished rows.
    reduced_ptr: the 0-d reduced loss (REDUCE). denominator_out_ptr: the divisor it used (REDUCE).
        n_items_ptr: a device n_items (DENOMINATOR == 2).
    n_rows, V (this launch's columns), chunk_width, n_chunks: the grid's extent.
    ignore_index, scaling, softcap, label_smoothing, z_loss: the options (their flags below switch them on).
    denominator_value: the divisor when DENOMINATOR == 1. vocab_start: the slice's first global column.
    BLOCK: the tile width. CHUNKS_BLOCK: n_chunks rounded up to a power of 2. HAS_SCALING, HAS_SOFTCAP,
    HAS_SMOOTHING, HAS_Z_LOSS: which options apply. REDUCE: reduce "mean"/"sum" in-kernel. DENOMINATOR: 0 the
    kept-token count, 1 denominator_value, 2 *n_items_ptr. GROUPS_BLOCK: groups summed per step by the last group.
    ROWS_PER_GROUP: rows per group. VOCAB_PARALLEL: write the slice's statistics instead of the loss.
    OUTPUTS: also keep, per chunk, the first column of the largest z and sum_j e^(z_j - max) z_j (rescaled like the
    sum of exponentials; -inf logits contribute 0), two more partials (the int32 one at arrivals_ptr), and write the
    row's argmax and mean of z (the extra outputs: accuracy and entropy).
    HAS_WEIGHT: class weights, float32 (V,) at weight_ptr and their sum at weight_sum_ptr (read with smoothing):
    the loss is weighted as F.cross_entropy's (`_weighted_token_loss`), the sum-of-z partial becomes
    sum_c w_c z_c (a class of weight 0 adds nothing, even at z = -inf), and "mean" divides by sum_t w[y_t]. Not
    with VOCAB_PARALLEL.
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # The float32 scratch: the chunks' three partials (max, sum of exp, sum of z; partials_stride apart) and the row
    # groups' loss sums then kept counts, at offsets the launcher keeps multiples of 16 elements.
    max_ptr = scratch_ptr + partials_offset
    sumexp_ptr = max_ptr + partials_stride
    sumz_ptr = sumexp_ptr + partials_stride
    if OUTPUTS:
        argmax_part_ptr = arrivals_ptr + partials_offset + 3 * partials_stride  # int32: the same buffer
        sumez_ptr = sumz_ptr + 2 * partials_stride
        # The per-row outputs, in the same buffer after the partials (no kernel argument of their own, so the
        # default variant's arguments are what they were).
        outputs_offset = partials_offset + 5 * partials_stride
        rows_padded = (n_rows + 15) // 16 * 16
        argmax_out_ptr = arrivals_ptr + outputs_offset
        mean_z_out_ptr = scratch_ptr + outputs_offset + rows_padded
        z_max_out_ptr = mean_z_out_ptr + rows_padded
    group_partials_ptr = scratch_ptr + groups_offset
    row_ptr = logits_ptr + _row_offset(row, logits_batch_stride, logits_row_stride, rows_per_batch)
    label = tl.load(labels_ptr + row).to(tl.int64)

    start = chunk * chunk_width
    end = tl.minimum(start + chunk_width, V)
    end = tl.where(label == ignore_index, start, end)  # an ignored row's logits are never read

    # Scalar running max and sum: the tile's max is taken first, so each element costs one exp.
    run_max = -float("inf")
    run_sum = 0.0
    run_sumz = 0.0
    if OUTPUTS:
        run_argmax = start
        run_sumez = 0.0
    for tile_start in tl.range(start, end, BLOCK):
        cols = tile_start + tl.arange(0, BLOCK)
        in_row = cols < end
        x = tl.load(row_ptr + cols, mask=in_row, other=-float("inf"))
        z = _transform(x, scaling, softcap, HAS_SCALING, HAS_SOFTCAP)
        z = tl.where(in_row, z, -float("inf"))  # soft-capping maps -inf to -softcap; masked lanes stay -inf
        new_max = tl.maximum(run_max, tl.max(z, 0))
        # While everything seen is -inf, shift by 0 instead (-inf - -inf would be NaN).
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        if OUTPUTS:
            tile_max = tl.max(z, 0)
            # The first column holding the tile's max; a later tile takes over only with a strictly larger max.
            tile_argmax = tl.min(tl.where(z == tile_max, cols, end), 0)
            run_argmax = tl.where(tile_max > run_max, tile_argmax, run_argmax)
            e = tl.exp(z - shift)
            run_sumez = run_sumez * tl.exp(run_max - shift) + tl.sum(tl.where(z == -float("inf"), 0.0, e * z), 0)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(e, 0)
        else:
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift), 0)
        run_max = new_max
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
                run_sumz += tl.sum(tl.where(w == 0.0, 0.0, w * z), 0)
            else:
                run_sumz += tl.sum(tl.where(in_row, z, 0.0), 0)

    shift = tl.where(run_max == -float("inf"), 0.0, run_max)
    lse = shift + tl.log(run_sum)
    sum_z = run_sumz
    if OUTPUTS:
        argmax = run_argmax
        mean_z = run_sumez / run_sum
        z_max = run_max
    is_last = True
    if n_chunks > 1:
        # Publish this chunk; the row's last chunk to arrive combines all of them in chunk order, so the result
        # does not depend on which program came last.
        slot = row * n_chunks + chunk
        tl.store(max_ptr + slot, run_max)
        tl.store(sumexp_ptr + slot, run_sum)
        tl.store(sumz_ptr + slot, run_sumz)
        if OUTPUTS:
            tl.store(argmax_part_ptr + slot, run_argmax)
            tl.store(sumez_ptr + slot, run_sumez)
        tl.debug_barrier()  # every thread's stores precede the release below
        is_last = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == n_chunks - 1
        if is_last:
            slots = row * n_chunks + tl.arange(0, CHUNKS_BLOCK)
            slot_mask = tl.arange(0, CHUNKS_BLOCK) < n_chunks
            lse = _combine_partials(
                tl.load(max_ptr + slots, mask=slot_mask, other=-float("inf"), volatile=True),
                tl.load(sumexp_ptr + slots, mask=slot_mask, other=0.0, volatile=True),
            )
            sum_z = tl.sum(tl.load(sumz_ptr + slots, mask=slot_mask, other=0.0, volatile=True), 0)
            if OUTPUTS:
                part_max = tl.load(max_ptr + slots, mask=slot_mask, other=-float("inf"), volatile=True)
                part_argmax = tl.load(argmax_part_ptr + slots, mask=slot_mask, other=V, volatile=True)
                row_max = tl.max(part_max, 0)
                z_max = row_max
                # Chunks are in column order: the smallest index among the chunks holding the max is the first.
                argmax = tl.min(tl.where(part_max == row_max, part_argmax, V), 0)
                argmax = tl.where(row_max == -float("inf"), 0, argmax)
                rescale = tl.exp(part_max - tl.where(row_max == -float("inf"), 0.0, row_max))
                part_sum = tl.load(sumexp_ptr + slots, mask=slot_mask, other=0.0, volatile=True)
                part_sumez = tl.load(sumez_ptr + slots, mask=slot_mask, other=0.0, volatile=True)
                mean_z = tl.sum(part_sumez * rescale, 0) / tl.sum(part_sum * rescale, 0)
    if VOCAB_PARALLEL and is_last:
        # This rank's share: the label logit only where the label column is one of its own (0 elsewhere, so the
        # ranks' values sum to the label logit), the local lse and sum of z. The loss is the caller's, after the
        # ranks combine these.
        local_label = label - vocab_start
        owned = (local_label >= 0) & (local_label < V) & (label != ignore_index)
        z_label = _transform(
            tl.load(row_ptr + local_label, mask=owned, other=0.0), scaling, softcap, HAS_SCALING, HAS_SOFTCAP
        )
        tl.store(loss_ptr + row, tl.where(owned, z_label, 0.0))
        tl.store(lse_ptr + row, lse)
        tl.store(sum_z_out_ptr + row, sum_z)
        if OUTPUTS:
            tl.store(argmax_out_ptr + row, (argmax + vocab_start).to(tl.int32))
            tl.store(mean_z_out_ptr + row, mean_z)
            tl.store(z_max_out_ptr + row, z_max)
    elif is_last:
        # The only data-dependent address: loaded only for a label inside [0, V).
        load_label = (label >= 0) & (label < V) & (label != ignore_index)
        z_label = _transform(
            tl.load(row_ptr + label, mask=load_label, other=0.0), scaling, softcap, HAS_SCALING, HAS_SOFTCAP
        )
        if HAS_WEIGHT:
            w_sum = 0.0
            if HAS_SMOOTHING:
                w_sum = tl.load(weight_sum_ptr)
            loss = _weighted_token_loss(
                z_label,
                label,
                lse,
                sum_z,
                tl.load(weight_ptr + label, mask=load_label, other=0.0),
                w_sum,
                V,
                ignore_index,
                label_smoothing,
                z_loss,
                HAS_SMOOTHING,
                HAS_Z_LOSS,
            )
        else:
            loss = _token_loss(
                z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
            )
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
        if OUTPUTS:
            tl.store(argmax_out_ptr + row, argmax.to(tl.int32))
            tl.store(mean_z_out_ptr + row, mean_z)
        if REDUCE:
            # In this same launch, in a fixed order (deterministic): the last row to finish in each group of
            # ROWS_PER_GROUP rows sums the group's losses (and counts its kept tokens) while other rows still run;
            # the last group to finish reduces the group sums. One pass over all N losses by the batch's last
            # row instead left a serial chain of loads after everything else: +13% at V=32000 (bench/NOTES.md).
            tl.debug_barrier()
            group = row // ROWS_PER_GROUP
            group_size = tl.minimum(n_rows - group * ROWS_PER_GROUP, ROWS_PER_GROUP)
            n_groups = (n_rows + ROWS_PER_GROUP - 1) // ROWS_PER_GROUP
            if tl.atomic_add(arrivals_ptr + n_rows + 1 + group, 1, sem="acq_rel") == group_size - 1:
                members = tl.arange(0, ROWS_PER_GROUP)
                rows = group * ROWS_PER_GROUP + members
                in_group = members < group_size
                tl.store(
                    group_partials_ptr + group,
                    tl.sum(tl.load(loss_ptr + rows, mask=in_group, other=0.0, volatile=True), 0),
                )
                if DENOMINATOR == 0:
                    labels = tl.load(labels_ptr + rows, mask=in_group, other=ignore_index)
                    if HAS_WEIGHT:  # the weighted mean's divisor: sum of w[y] (a label outside [0, V) adds 0)
                        has_class = (labels != ignore_index) & (labels >= 0) & (labels < V)
                        kept = tl.load(weight_ptr + tl.where(has_class, labels, 0), mask=has_class, other=0.0)
                        tl.store(group_partials_ptr + n_groups + group, tl.sum(kept, 0))
                    else:
                        tl.store(
                            group_partials_ptr + n_groups + group, tl.sum((labels != ignore_index).to(tl.float32), 0)
                        )
                tl.debug_barrier()
                if tl.atomic_add(arrivals_ptr + n_rows, 1, sem="acq_rel") == n_groups - 1:
                    _reduce_losses(
                        group_partials_ptr,
                        reduced_ptr,
                        denominator_out_ptr,
                        n_items_ptr,
                        n_groups,
                        denominator_value,
                        DENOMINATOR,
                        GROUPS_BLOCK,
                        HAS_WEIGHT,
                    )


@triton.jit
def _reduce_losses(
    group_partials_ptr,
    reduced_ptr,
    denominator_out_ptr,
    n_items_ptr,
    n_groups,
    denominator_value,
    DENOMINATOR: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """*reduced = sum of losses / denominator and *denominator_out = denominator, from the groups' [loss sums...,
    kept counts...]. DENOMINATOR: 0 = the kept-token count (at least 1, so an all-ignored batch gives 0; with
    HAS_WEIGHT the sum of the kept tokens' class weights, 1 where it is exactly 0), 1 = denominator_value,
    2 = *n_items_ptr (a device scalar)."""
    total = 0.0
    count = 0.0
    for start in tl.range(0, n_groups, GROUPS_BLOCK):
        groups = start + tl.arange(0, GROUPS_BLOCK)
        in_batch = groups < n_groups
        total += tl.sum(tl.load(group_partials_ptr + groups, mask=in_batch, other=0.0, volatile=True), 0)
        if DENOMINATOR == 0:
            count += tl.sum(tl.load(group_partials_ptr + n_groups + groups, mask=in_batch, other=0.0, volatile=True), 0)
    if DENOMINATOR == 0:
        if HAS_WEIGHT:
            denominator = tl.where(count == 0.0, 1.0, count)
        else:
            denominator = tl.maximum(count, 1.0)
    elif DENOMINATOR == 1:
        denominator = denominator_value
    else:
        denominator = tl.load(n_items_ptr).to(tl.float32)
    tl.store(reduced_ptr, total / denominator)
    tl.store(denominator_out_ptr, denominator)


@triton.jit
def _backward_kernel(
    logits_ptr,
    logits_batch_stride,
    logits_row_stride,
    grad_ptr,
    grad_batch_stride,
    grad_row_stride,
    rows_per_batch,
    labels_ptr,
    lse_ptr,
    grad_loss_ptr,
    grad_loss_stride,
    denominator_ptr,
    V,
    ignore_index,
    scaling,
    softcap,
    label_smoothing,
    z_loss,
    vocab_start,
    vocab_total,
    weight_ptr,
    weight_sum_ptr,
    BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_DENOMINATOR: tl.constexpr,
    VOCAB_PARALLEL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Program (row, tile) of the backward: d loss / d logits of BLOCK columns of one row, written to the gradient.

    logits_ptr, logits_batch_stride, logits_row_stride / grad_ptr, grad_batch_stride, grad_row_stride: the logits
        and the gradient (may be the same buffer), both with rows_per_batch rows per batch (`row_layout`).
    labels_ptr: (n_rows,) int labels. lse_ptr: (n_rows,) float32 logsumexp (vocab-parallel: the global one).
    grad_loss_ptr, grad_loss_stride: the upstream gradient per token (stride 1) or one scalar (stride 0).
    denominator_ptr: the 1-element divisor of a reduced loss (HAS_DENOMINATOR).
    V: this launch's columns. ignore_index, scaling, softcap, label_smoothing, z_loss: the options.
    vocab_start, vocab_total: the slice's first global column and the global vocabulary (VOCAB_PARALLEL).
    BLOCK: the tile width. HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS: which options apply.
    HAS_DENOMINATOR: divide the upstream by *denominator_ptr. VOCAB_PARALLEL: columns are a slice of vocab_total.
    HAS_WEIGHT: class weights at weight_ptr (float32 (V,)), their sum at weight_sum_ptr (read with smoothing):
    dL/dz_j = w[y] ((1 - eps)(p_j - [j == y]) + 2 z_loss lse p_j) + (eps / V)(W p_j - w_j). Not with
    VOCAB_PARALLEL.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V

    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index
    if VOCAB_PARALLEL:  # columns are local, the label and the uniform target are global
        label_column = label - vocab_start
        vocab_all = vocab_total
    else:
        label_column = label
        vocab_all = V
    lse = tl.load(lse_ptr + row)
    # Upstream gradient of this token's loss; stride 0 when it is one scalar broadcast over the rows.
    grad_loss = tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32)
    if HAS_DENOMINATOR:  # a reduced loss: d loss / d token loss = 1 / denominator
        grad_loss = grad_loss / tl.load(denominator_ptr)
    grad_loss = tl.where((label >= 0) & (label < vocab_all), grad_loss, float("nan"))
    if HAS_WEIGHT:
        w_label = tl.load(weight_ptr + label, mask=(label >= 0) & (label < V) & ~ignored, other=0.0)
        if not HAS_SMOOTHING:  # the weight of the label is a per-row factor of the unweighted gradient
            grad_loss = grad_loss * w_label

    logits_row = logits_ptr + _row_offset(row, logits_batch_stride, logits_row_stride, rows_per_batch)
    # `!= 0` is a no-op compiled (the compare of an int1 with false folds away: same PTX) but makes the mask a bool
    # payload in Triton's interpreter, which splats the scalar `~ignored` to int64; Triton 3.9's interpreted masked
    # load rejects a non-bool mask ("mask has unsupported dtype").
    x = tl.load(logits_row + cols, mask=(in_row & ~ignored) != 0, other=0.0).to(tl.float32)
    if HAS_SCALING:
        x = x * scaling
    tanh_z = x  # unused without soft-capping
    if HAS_SOFTCAP:
        tanh_z = _tanh(x / softcap)
        x = softcap * tanh_z
    if HAS_WEIGHT and HAS_SMOOTHING:
        p = tl.exp(x - lse)
        coefficient = w_label * (1.0 - label_smoothing) + label_smoothing / V * tl.load(weight_sum_ptr)
        if HAS_Z_LOSS:
            coefficient += w_label * 2.0 * z_loss * lse
        w = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
        dx = p * coefficient - label_smoothing / V * w
        dx = tl.where(cols == label, dx - w_label * (1.0 - label_smoothing), dx)
        if HAS_SOFTCAP:
            dx = dx * (1.0 - tanh_z * tanh_z)
        if HAS_SCALING:
            dx = dx * scaling
    else:
        dx = _dloss_dlogits(
            tl.exp(x - lse),
            tanh_z,
            cols,
            label_column,
            lse,
            vocab_all,
            scaling,
            label_smoothing,
            z_loss,
            HAS_SCALING,
            HAS_SOFTCAP,
            HAS_SMOOTHING,
            HAS_Z_LOSS,
        )
    dx = tl.where(ignored, 0.0, dx * grad_loss)
    grad_row = grad_ptr + _row_offset(row, grad_batch_stride, grad_row_stride, rows_per_batch)
    tl.store(grad_row + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _scale_unless_one_kernel(tensor_ptr, n_elements, factor_ptr, BLOCK: tl.constexpr):
    """tensor_ptr[:n_elements] *= *factor_ptr, and no memory traffic at all when the factor is exactly 1 (the usual
    upstream gradient of a loss), which the host cannot know without a synchronisation. Exact zeros stay zero
    whatever the factor (NaN, inf): an ignored token's gradient is 0, as the backward kernel writes it."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        x = tl.load(tensor_ptr + offsets, mask=in_range)
        scaled = tl.where(x == 0, 0.0, x.to(tl.float32) * factor)
        tl.store(tensor_ptr + offsets, scaled.to(tensor_ptr.dtype.element_ty), mask=in_range)


# --- vocab-parallel: combining the ranks' statistics ---------------------------------------------------------------
# The forward kernel writes a rank's per-row statistics into rows 1-3 of one float32 buffer of 4 rows
# (`vocab_parallel_statistics`); these three kernels take it through the two all-reduces in place, so that the
# eager vocab-parallel call launches 4 kernels around its collectives instead of ~30 torch ops (bench/NOTES.md):
#   row 0: the MAX operand: the local lse, then the local width and its negation (the width check), then the divisor
#   row 1: the local lse; after the rescale, exp(lse_local - shift) (the SUM operand); after the combine, global lse
#   row 2: the label's z where this rank holds it, else 0;  row 3: the local sum of z (label smoothing)


@triton.jit
def _vocab_parallel_maxima_kernel(
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
def _vocab_parallel_rescale_kernel(statistics_ptr, stride, n_rows, BLOCK: tl.constexpr):
    """Row 1 := exp(lse_local - shift), shift the reduced maximum of row 0: each rank's share of the row's sum."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_rows = offsets < n_rows
    shift = _row_shift(tl.load(statistics_ptr + offsets, mask=in_rows, other=0.0))
    lse_local = tl.load(statistics_ptr + stride + offsets, mask=in_rows, other=float("-inf"))
    tl.store(statistics_ptr + stride + offsets, tl.exp(lse_local - shift), mask=in_rows)


@triton.jit
def _vocab_parallel_loss_kernel(
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
        loss = _token_loss(z_label, labels, lse, sum_z, vocab_total, ignore_index, label_smoothing, z_loss,
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


# --- launchers ---------------------------------------------------------------------------------------------------


# Plain integer helpers: triton.cdiv / next_power_of_2 go through Triton's jit dispatch (~10 us each on the host).
def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << max(n - 1, 0).bit_length()


class ForwardConfig(NamedTuple):
    """The forward kernel's decomposition of a row: tile width, chunk width, number of chunks, warps, stages."""

    block: int
    chunk: int
    n_chunks: int
    warps: int
    stages: int


class BackwardConfig(NamedTuple):
    """The backward kernel's tile width and warps."""

    block: int
    warps: int


@functools.lru_cache(maxsize=1024)
def forward_config(vocab, block=None, chunk=None, warps=None, stages=None):
    """The forward's ForwardConfig at V = vocab; V alone decides (batch invariance). Each setting left None is the
    module's tuned constant (FORWARD_BLOCK, CHUNK, FORWARD_WARPS, FORWARD_STAGES); block and chunk are capped at V
    rounded up to a power of 2. Cached per argument set (the launchers ask on every call): the constants are read
    once per vocab, so a sweep over other settings passes them here or builds its own ForwardConfig and gives it to
    `forward(config=...)` rather than changing the constants."""
    width = _next_power_of_2(vocab)
    block = min(FORWARD_BLOCK if block is None else block, width)
    chunk = max(block, min(CHUNK if chunk is None else chunk, width))
    warps = FORWARD_WARPS if warps is None else warps
    return ForwardConfig(block, chunk, _cdiv(vocab, chunk), warps, FORWARD_STAGES if stages is None else stages)


@functools.lru_cache(maxsize=1024)
def backward_config(vocab, block=None, warps=None):
    """The backward's BackwardConfig at V = vocab (None: BACKWARD_BLOCK, BACKWARD_WARPS); cached as forward_config."""
    block = min(BACKWARD_BLOCK if block is None else block, _next_power_of_2(vocab))
    return BackwardConfig(block, BACKWARD_WARPS if warps is None else warps)


@functools.lru_cache(maxsize=256)
def _flags(options):
    """The kernels' option constexprs, in their order: HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS (cached
    per Options: a pure function of its values, and equal Options give equal flags)."""
    return (
        options.logit_scaling != 0.0,
        options.logit_softcapping > 0.0,
        options.label_smoothing > 0.0,
        options.z_loss != 0.0,
    )


def _checked(tensor):
    if not tensor.is_cuda and not INTERPRETED:
        raise RuntimeError(
            "the Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before "
            "triton is first imported, or use backend='reference'"
        )


_SAME_DEVICE = contextlib.nullcontext()  # stateless: one instance serves every call


def on_device(tensor):
    """Triton launches on the current device's current stream: make the tensor's device current for the launch
    (logits on cuda:1 while cuda:0 is current). A no-op (one shared nullcontext) when it already is; the current
    device comes from torch's C getter, as the launch cache reads it (a CUDA tensor means CUDA is initialised)."""
    if tensor.is_cuda and tensor.get_device() != _current_device():
        return torch.cuda.device(tensor.device)
    return _SAME_DEVICE


FIRST_LAUNCH_IN_CAPTURE = (
    "fastce_torch: this kernel variant (options, reduction, dtype, device) has not run yet in this process, and its "
    "first launch cannot be captured in a CUDA graph: Triton compiles and loads a kernel on its first launch, which "
    "stream capture forbids. Run the same step once outside the capture first (torch.cuda.graph's documented "
    "warm-up on a side stream does it), then capture."
)
# Kernel variants that have been launched in this process (so Triton has compiled and loaded their modules).
_launched = set()


def _guard_capture(variant, tensor):
    """Raise FIRST_LAUNCH_IN_CAPTURE instead of letting a first launch invalidate a CUDA graph capture (whose own
    error, "operation failed due to a previous error during capture", names no cause)."""
    if variant not in _launched:
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(FIRST_LAUNCH_IN_CAPTURE)
        _launched.add(variant)


# --- the launch cache ----------------------------------------------------------------------------------------------
# Triton's `kernel[grid](*args)` costs ~26 us of host time per launch on the H200 machine (bench/NOTES.md): it reads
# its options, binds and specialises every argument, builds a string key, checks the kernel's globals and builds a
# launch-metadata record, before calling the compiled variant's launcher (~8 us). After Triton has compiled and
# launched a variant once, `_Launcher` calls that launcher itself, keyed on what Triton's specialisation of the
# arguments depends on (dtypes, 16-byte alignment of pointers, integers equal to 1, divisible by 16, 32 or 64 bits,
# the constexprs), computed by `_ArgumentLayout` without Triton's binder (2.5 us against 6.2 us for the forward's
# 38 arguments, helpers' CPU) and checked against the binder at every variant recorded, and on the options Triton
# adds to its key, so a cached variant is exactly the one Triton would launch. Written against Triton 3.6.0's runtime
# (JITFunction.run, CompiledKernel, native_specialize_impl); any other version, the interpreter, or
# FASTCE_TORCH_LAUNCH_CACHE=0 (read once, at import) keeps the generic path.
LAUNCH_CACHE_VARIABLE = "FASTCE_TORCH_LAUNCH_CACHE"
LAUNCH_CACHE_TRITON = "3.6.0"  # the Triton release whose launch path _Launcher reproduces


def _launch_cache_refusal():
    """Why the launch cache cannot be used in this process, or "" when it can."""
    if INTERPRETED:
        return "Triton's interpreter (TRITON_INTERPRET=1) runs the kernels"
    if os.environ.get(LAUNCH_CACHE_VARIABLE, "1") == "0":
        return f"{LAUNCH_CACHE_VARIABLE}=0"
    if triton.__version__ != LAUNCH_CACHE_TRITON:
        return f"Triton {triton.__version__}: the cached launch is written for Triton {LAUNCH_CACHE_TRITON}"
    return ""


class _LaunchCacheSetting:
    """The process's launch-cache setting: decided once at import, switched only by `launch_cache(...)`."""

    def __init__(self):
        self.refusal = _launch_cache_refusal()
        self.enabled = not self.refusal


_launch_cache_setting = _LaunchCacheSetting()


def launch_cache_enabled():
    return _launch_cache_setting.enabled


@contextlib.contextmanager
def launch_cache(enabled):
    """Run the block with the launch cache on or off (tests, bench tools: the same kernels through both paths).
    Turning it on where it is refused (interpreter, FASTCE_TORCH_LAUNCH_CACHE=0, another Triton) raises."""
    if enabled and _launch_cache_setting.refusal:
        raise RuntimeError(f"the launch cache is off in this process: {_launch_cache_setting.refusal}")
    saved = _launch_cache_setting.enabled
    _launch_cache_setting.enabled = bool(enabled)
    try:
        yield
    finally:
        _launch_cache_setting.enabled = saved


_MISSING = object()

# What Triton's CUDA driver asks for the current device and stream (driver.active.get_current_device is
# torch.cuda.current_device, get_current_stream torch._C._cuda_getCurrentRawStream), as the C getters themselves: a
# cached launch skips torch.cuda.current_device's lazy-initialisation check, which cannot matter there, since a
# variant is only known after a generic launch initialised CUDA in this process, and a forked child forgets every
# variant (_forget_variants_after_fork). CPU builds of torch have neither getter; nothing is cached there.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)

# Triton 3.6's integer specialisation (native_specialize_impl, handle_long_type): an int equal to 1 becomes the
# constexpr 1 (unless do_not_specialize), else "i32" within the int32 range, "i64" within int64, "u64" up to 2**64 - 1
# (anything beyond raises); its attribute is "D" when divisible by 16 (unless do_not_specialize_on_alignment), else "".
_INT_TYPES = ("i32", "i64", "u64")
_INT_CLASS = (
    "(0 if -0x80000000 <= {a} <= 0x7FFFFFFF else 1 if -0x8000000000000000 <= {a} <= 0x7FFFFFFFFFFFFFFF "
    "else 2 if 0 <= {a} <= 0xFFFFFFFFFFFFFFFF else 3)"
)
_KEYED_CONSTEXPR_TYPES = (int, bool)  # constexpr values keyed by value: for these, equal values print alike


class _ArgumentLayout:
    """Triton 3.6's specialisation of one kernel's arguments, for argument sets whose exact types are `types`,
    computed without its binder. `key(args, *options)` is a flat tuple of what the specialisation depends on, per
    parameter in order: a constexpr's value; a tensor's dtype, and whether its data pointer is 16-byte aligned; an
    int's == 1, divisibility by 16 and int32/int64/uint64 range (each only where Triton looks at it); nothing for a
    bool, float or None (Triton gives them "u1", "fp32", constexpr None whatever the value); then the options.
    `specialization(key)` rebuilds Triton's own specialisation list from a key, so equal keys mean equal
    specialisations, and the launcher checks it against the binder's at every variant it records.

    `build` returns None where this reproduction is not certain (another argument type, a tensor subclass, an
    annotated parameter, a constexpr neither int nor bool, a backend whose tensor specialisation is not Triton's
    native one): those argument sets are keyed by the binder."""

    def __init__(self, parts, key):
        self.parts, self.key = parts, key

    @classmethod
    def build(cls, params, types, backend):
        if len(params) != len(types) or getattr(backend, "supports_native_tensor_specialization", None) is not True:
            return None
        parts, elements = [], []
        for index, (param, kind) in enumerate(zip(params, types)):
            a = f"a{index}"
            if param.is_constexpr:
                if kind not in _KEYED_CONSTEXPR_TYPES:
                    return None
                parts.append(("constexpr", None, False, False))
                elements.append(a)
                continue
            if param.annotation_type:
                return None
            specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
            if kind is torch.Tensor:
                parts.append(("tensor", param.is_const, specialize, align))
                elements.append(f"{a}.dtype")
                if specialize and align:
                    elements.append(f"not {a}.data_ptr() & 15")
            elif kind is int:
                parts.append(("int", None, specialize, align))
                if specialize:
                    elements.append(f"{a} == 1")
                    if align:
                        elements.append(f"not {a} & 15")
                elements.append(_INT_CLASS.format(a=a))
            elif kind in (bool, float, type(None)):
                parts.append((kind.__name__, None, False, False))
            else:
                return None
        names = [f"a{index}" for index in range(len(params))]
        source = (
            "def key(args, num_warps, num_stages, debug, instrumentation_mode):\n"
            f"    {', '.join(names)}, = args\n"
            f"    return ({''.join(e + ', ' for e in elements)}num_warps, num_stages, debug, instrumentation_mode)\n"
        )
        namespace = {}
        exec(compile(source, f"<fastce launch key of {len(params)} arguments>", "exec"), namespace)
        return cls(tuple(parts), namespace["key"])

    def specialization(self, key):
        """Triton's specialisation list (its binder's second result) of the arguments that gave `key`."""
        from triton._utils import canonicalize_ptr_dtype

        result, values = [], iter(key)
        for kind, is_const, specialize, align in self.parts:
            if kind == "constexpr":
                result.append(("constexpr", next(values)))
            elif kind == "tensor":
                dtype = canonicalize_ptr_dtype(next(values), is_const)
                attribute = None
                if specialize:
                    attribute = "D" if align and next(values) else ""
                result.append((dtype, attribute))
            elif kind == "int":
                one = next(values) if specialize else False
                divisible = next(values) if specialize and align else False
                int_class = next(values)
                if int_class == 3:
                    raise OverflowError("integer to be specialized too large to represent")
                if one:
                    result.append(("constexpr", 1))
                else:
                    result.append((_INT_TYPES[int_class], ("D" if divisible else "") if specialize else None))
            elif kind == "bool":
                result.append(("u1", None))
            elif kind == "float":
                result.append(("fp32", None))
            else:
                result.append(("constexpr", None))
        return result


def _binder_key(binder):
    """The launch key through Triton's binder itself, for argument sets _ArgumentLayout does not cover."""

    def key(args, num_warps, num_stages, debug, instrumentation_mode):
        return tuple(binder(*args)[1]), num_warps, num_stages, debug, instrumentation_mode

    return key


class _Launcher:
    """Launches one @triton.jit kernel: `cached(grid, args, ...)` calls the compiled variant's launcher directly when
    Triton has launched that variant before on this device (True), else does nothing (False), and the caller
    then calls `launch`, Triton's generic path, which also records the variant it launched.

    args are all the kernel's parameters in its signature's order, constexprs included, as Triton itself passes
    them to a compiled launcher; grid is (x, y, z). What the cached launch keeps from JITFunction.run: the current
    device and stream as Triton reads them, its check that the kernel's globals did not change (a change takes the
    generic path, which raises Triton's error), and launch hooks (any registered hook, or a pre-run hook, takes the
    generic path). What it skips: the option parsing, the binder (the key comes from _ArgumentLayout, per exact
    argument types, or from Triton's binder for types it does not cover), the string key, the launch-metadata record
    (built only for launch hooks), the grid canonicalisation. A variant is recorded only after checking that Triton's
    own key for the arguments maps to the CompiledKernel it launched and that the layout's key rebuilds the binder's
    specialisation; any failure while recording turns this launcher's cache off for good (`failure` says why) and
    every launch takes the generic path."""

    def __init__(
        self, kernel, setting=_launch_cache_setting, current_device=_current_device, current_stream=_current_stream
    ):
        self.kernel, self.setting = kernel, setting
        # device -> {exact argument types: (key function, _ArgumentLayout or None, {key: (launcher, function,
        # packed metadata)})}
        self.variants = {}
        self.failure = None
        self.hits = 0  # cached launches, for tests and bench tools
        self._current_device, self._current_stream = current_device, current_stream

    def _key(self, layout, args, num_warps, num_stages):
        # Triton keys its compiled variants on (its specialisation of the arguments, str(the options)), where the
        # options are the launch's keywords (num_warps, num_stages) plus debug and instrumentation_mode.
        debug = self.kernel.debug or knobs.runtime.debug
        return layout[0](args, num_warps, num_stages, debug, knobs.compilation.instrumentation_mode)

    def cached(self, grid, args, num_warps=None, num_stages=None):
        if not self.setting.enabled or self.failure is not None:
            return False
        runtime = knobs.runtime
        # Triton 3.6's hooks are HookChains; anything else set there (a plain callable) counts as a hook.
        if (
            getattr(runtime.launch_enter_hook, "calls", True)
            or getattr(runtime.launch_exit_hook, "calls", True)
            or self.kernel.pre_run_hooks
        ):
            return False
        device = self._current_device()
        layouts = self.variants.get(device)
        if layouts is None:
            return False
        layout = layouts.get(tuple(map(type, args)))
        if layout is None:
            return False
        entry = layout[2].get(
            layout[0](
                args, num_warps, num_stages, self.kernel.debug or runtime.debug, knobs.compilation.instrumentation_mode
            )
        )
        if entry is None:
            return False
        for (name, _), (value, globals_dict) in self.kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != value:
                return False
        run, function, metadata = entry
        # No hooks are registered (checked above): Triton would call empty hook chains with a metadata record.
        run(grid[0], grid[1], grid[2], self._current_stream(device), function, metadata, None, None, None, *args)
        self.hits += 1
        return True

    def launch(self, grid, args, num_warps=None, num_stages=None):
        options = {}
        if num_warps is not None:
            options["num_warps"] = num_warps
        if num_stages is not None:
            options["num_stages"] = num_stages
        compiled = self.kernel[grid](*args, **options)
        if self.setting.enabled and self.failure is None:
            try:
                self._record(compiled, args, options, num_warps, num_stages)
            except Exception as error:  # never let the cache break a launch: the generic path stays
                self.failure = f"{type(error).__name__}: {error}"
        return compiled

    def layout(self, args, device=0):
        """The (key function, _ArgumentLayout or None, entries) this launcher keys these arguments' types with on
        `device` (made if new): for tests and bench tools."""
        kernel_cache, kernel_key_cache, _, backend, binder = self.kernel.device_caches[device]
        layouts = self.variants.setdefault(device, {})
        types = tuple(map(type, args))
        layout = layouts.get(types)
        if layout is None:
            argument_layout = _ArgumentLayout.build(self.kernel.params, types, backend)
            key = _binder_key(binder) if argument_layout is None else argument_layout.key
            layout = layouts[types] = (key, argument_layout, {})
        return layout

    def _record(self, compiled, args, options, num_warps, num_stages):
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import compute_cache_key

        if not isinstance(compiled, CompiledKernel):  # a jit_cache_hook skipped the launch, or an async compile
            raise TypeError(f"kernel[grid](...) returned {type(compiled).__name__}, not a CompiledKernel")
        device = self._current_device()
        kernel_cache, kernel_key_cache, _, _, binder = self.kernel.device_caches[device]
        specialization = binder(*args)[1]
        triton_options = dict(options)
        triton_options["debug"] = self.kernel.debug or knobs.runtime.debug
        triton_options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, triton_options)) is not compiled:
            raise RuntimeError("Triton's own key for these arguments does not give the kernel it launched")
        layout = self.layout(args, device)
        key = self._key(layout, args, num_warps, num_stages)
        if layout[1] is not None and layout[1].specialization(key) != specialization:
            raise RuntimeError("the launch key does not rebuild Triton's specialisation of these arguments")
        known = layout[2].get(key)
        if known is not None and known[2] is not compiled.packed_metadata:
            raise RuntimeError("two compiled variants under one launch key")
        layout[2][key] = (compiled.run, compiled.function, compiled.packed_metadata)

    def forget(self):
        self.variants.clear()


_forward_launcher = _Launcher(_forward_kernel)
_backward_launcher = _Launcher(_backward_kernel)
_scale_launcher = _Launcher(_scale_unless_one_kernel)
_maxima_launcher = _Launcher(_vocab_parallel_maxima_kernel)
_rescale_launcher = _Launcher(_vocab_parallel_rescale_kernel)
_vocab_parallel_loss_launcher = _Launcher(_vocab_parallel_loss_kernel)


def _launchers():
    # Looked up at each call, so a launcher replaced by a test is the one forgotten.
    return (
        _forward_launcher, _backward_launcher, _scale_launcher, _maxima_launcher, _rescale_launcher,
        _vocab_parallel_loss_launcher,
    )  # fmt: skip


def forget_launches():
    """Forget which kernel variants have run (the capture guard's record and the launch cache): the next launch of
    each variant takes Triton's generic path again, as in a fresh process."""
    _launched.clear()
    for launcher in _launchers():
        launcher.forget()


def _forget_variants_after_fork():
    # A forked child cannot use its parent's CUDA context: its first launch must take Triton's generic path (and
    # torch.cuda's checks), not a cached launcher whose device getter skips them.
    for launcher in _launchers():
        launcher.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_variants_after_fork)


def row_layout(logits):
    """(batch stride, row stride, rows per batch) of logits viewed as (batch, rows, V) with unit column stride:
    the flat row r is (r // rows per batch, r % rows per batch). Logits (..., V) whose leading dimensions collapse
    into one or two strided dimensions qualify; None otherwise (the caller copies)."""
    if logits.is_contiguous() and logits.numel():  # the common case, without the general walk below
        return 0, logits.shape[-1], logits.numel() // logits.shape[-1]
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return None
    lead, strides = logits.shape[:-1], logits.stride()[:-1]
    # Drop size-1 dimensions (their stride is meaningless), then merge neighbours that are contiguous in each other.
    dims = [(size, stride) for size, stride in zip(lead, strides) if size != 1]
    merged = []
    for size, stride in dims:
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if not merged:
        return 0, logits.shape[-1], max(1, logits.numel() // max(logits.shape[-1], 1))
    if len(merged) == 1:
        return 0, merged[0][1], merged[0][0]
    if len(merged) == 2:
        return merged[0][1], merged[1][1], merged[1][0]
    return None


def rows_overlap(logits):
    """True when two rows of logits share memory (expand, as_strided): the gradient must not be written in place."""
    if logits.is_contiguous():
        return False
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return True
    span = logits.shape[-1]  # elements one row covers
    for size, stride in sorted(
        (d for d in zip(logits.shape[:-1], logits.stride()[:-1]) if d[0] > 1), key=lambda d: d[1]
    ):
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False


@functools.lru_cache(maxsize=1024)
def _scratch_offsets(n_rows, n_chunks, reduce):
    """The forward scratch buffer's layout (see forward): the element offsets of lse, the per-token losses, the
    denominator, the row groups' partials and the chunk partials, the partials' stride and the buffer's size."""
    n_groups = _cdiv(n_rows, ROWS_PER_GROUP) if reduce else 0
    n_counters = n_rows + 1 + n_groups if n_chunks > 1 or reduce else 1
    rows_padded = -(-n_rows // 16) * 16
    lse_offset = -(-n_counters // 16) * 16
    token_losses_offset = lse_offset + rows_padded
    denominator_offset = token_losses_offset + (rows_padded if reduce else 0)
    groups_offset = denominator_offset + 16
    partials_offset = groups_offset + -(-2 * n_groups // 16) * 16
    partials_stride = -(-n_rows * n_chunks // 16) * 16 if n_chunks > 1 else 16
    size = partials_offset + 3 * partials_stride
    return lse_offset, token_losses_offset, denominator_offset, groups_offset, partials_offset, partials_stride, size


def forward(
    logits,
    labels,
    options,
    reduction="none",
    n_items=None,
    vocab_start=0,
    vocab_total=None,
    config=None,
    layout=None,
    outputs=False,
    weight=None,
    statistics_out=None,
):
    """One launch: (loss, lse, denominator) of logits (..., V) laid out as `row_layout` allows and flat labels (N,).
    loss is the per-token float32 losses (N,) for reduction "none", else a 0-d tensor of its own (the reduced loss),
    and denominator the 1-element divisor the backward needs for "mean"/"sum" (None for "none").

    Vocab-parallel mode (vocab_total given: the logits are columns [vocab_start, vocab_start + V) of a vocabulary of
    vocab_total): per-row float32 (lse over the local columns, transformed label logit where the label is local
    else 0, local sum of z (0 without smoothing)); ignored rows give (-inf, 0, 0). reduction must be "none".
    config: a ForwardConfig for these logits' V (default forward_config(V)). layout: row_layout(logits), when the
    caller has it already.
    outputs=True: two more results, per row the int32 argmax of the transformed logits (first column on ties) and
    the float32 mean of z under softmax(z) (entropy = lse - it), NaN where ignored; in vocab-parallel mode three:
    the argmax as a global column, the mean of z over the slice's softmax, and the slice's largest z.
    weight: class weights, a float32 contiguous (V,) tensor on the logits' device (`class_weight_operands`), or
    None; not in vocab-parallel mode. statistics_out (vocab-parallel mode): three float32 (N,) tensors that receive
    the lse, label logit and sum of z (`vocab_parallel_statistics`' rows) instead of new ones."""
    vocab_parallel = vocab_total is not None
    if weight is not None and vocab_parallel:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    if vocab_parallel and reduction != "none":
        raise ValueError("the vocab-parallel forward returns per-row statistics: reduction must be 'none'")
    _checked(logits)
    vocab = logits.shape[-1]
    n_rows = labels.shape[0]
    # The caller copies logits that have no row layout.
    batch_stride, row_stride, rows_per_batch = row_layout(logits) if layout is None else layout
    block, chunk, n_chunks, warps, stages = forward_config(vocab) if config is None else config
    reduce = reduction != "none"
    device = logits.device
    # The returned loss owns its storage (in-place ops on it are ordinary autograd). Everything else lives in one
    # int32 buffer (one allocation, one fill when counters are used): the int32 arrival counters, which must start at
    # zero, then float32 (the kernel writes every float before reading it) lse, the per-token losses when reduced,
    # the denominator, the row groups' loss sums and kept counts, and the three chunk partials. Only what
    # is returned or read as a tensor gets a view (each costs a tensor object, ~1 us of host time); the kernel finds
    # the rest at element offsets from the buffer. Every piece starts at a multiple of 16 elements, so the pointers
    # keep the buffer's 16-byte alignment and the offsets stay divisible by 16 whatever N is: Triton specialises on
    # both, and a variant per N modulo 16 would mean more compiles and more launch-cache entries.
    # Without chunk partials and without the in-kernel reduction no counter is used (the kernel reads arrivals only
    # under n_chunks > 1 or REDUCE), so the buffer needs no fill: on a GPU that is one fill launch less.
    # arrivals[row] counts a row's finished chunks, arrivals[N] the finished groups of ROWS_PER_GROUP rows and
    # arrivals[N + 1 + g] the finished rows of group g.
    lse_offset, token_losses_offset, denominator_offset, groups_offset, partials_offset, partials_stride, size = (
        _scratch_offsets(n_rows, n_chunks, reduce)
    )
    if statistics_out is None:
        loss = torch.empty(() if reduce else (n_rows,), dtype=torch.float32, device=device)
    else:
        lse_out, loss, sum_z = statistics_out
    rows_padded = -(-n_rows // 16) * 16
    n_partials = 5 if outputs else 3
    outputs_offset = partials_offset + n_partials * partials_stride
    n_outputs = (2 + vocab_parallel) if outputs else 0  # argmax, mean of z (, the slice's largest z)
    if outputs:
        size = outputs_offset + n_outputs * rows_padded
    allocate = torch.zeros if n_chunks > 1 or reduce or outputs else torch.empty
    arrivals = allocate(size, dtype=torch.int32, device=device)
    scratch = arrivals.view(torch.float32)
    lse = scratch[lse_offset : lse_offset + n_rows] if statistics_out is None else lse_out
    if reduce:
        token_losses = scratch[token_losses_offset : token_losses_offset + n_rows]
        denominator = scratch[denominator_offset : denominator_offset + 1]
    else:
        token_losses, denominator = loss, scratch  # the kernel writes no denominator without REDUCE
    if statistics_out is None:
        sum_z = torch.empty(n_rows, dtype=torch.float32, device=device) if vocab_parallel else lse
    if outputs:
        argmax = arrivals[outputs_offset : outputs_offset + n_rows]
        mean_z = scratch[outputs_offset + rows_padded : outputs_offset + rows_padded + n_rows]
        z_max = scratch[outputs_offset + 2 * rows_padded : outputs_offset + 2 * rows_padded + n_rows]
    vocab_parallel_outputs = (argmax, mean_z, z_max) if outputs and vocab_parallel else ()
    if n_rows == 0:
        if vocab_parallel:
            return lse, loss, sum_z, *vocab_parallel_outputs
        if reduce:
            loss.zero_()
            denominator.fill_(1.0)
        return (loss, lse, (denominator if reduce else None)) + ((argmax, mean_z) if outputs else ())
    denominator_mode, denominator_value, n_items_ptr = denominator_operands(reduction, n_items, denominator)
    flags = _flags(options)
    weight, weight_sum = class_weight_operands(weight, options, lse)
    args = (
        logits,
        batch_stride,
        row_stride,
        rows_per_batch,
        labels,
        token_losses,
        lse,
        sum_z,
        scratch,
        arrivals,
        loss,
        denominator,
        n_items_ptr,
        partials_offset,
        partials_stride,
        groups_offset,
        n_rows,
        vocab,
        chunk,
        n_chunks,
        options.ignore_index,
        options.logit_scaling,
        options.logit_softcapping,
        options.label_smoothing,
        options.z_loss,
        denominator_value,
        vocab_start,
        weight,
        weight_sum,
        block,  # the constexprs, in the kernel's order: BLOCK, CHUNKS_BLOCK, the four flags, REDUCE, ...
        _next_power_of_2(n_chunks),
        *flags,
        reduce,
        denominator_mode,
        GROUPS_BLOCK,
        ROWS_PER_GROUP,
        vocab_parallel,
        outputs,
        weight is not lse,
    )
    grid = (n_rows, n_chunks, 1)
    with on_device(logits):
        if not _forward_launcher.cached(grid, args, warps, stages):
            _guard_capture(
                ("forward", device, logits.dtype, labels.dtype, block, n_chunks > 1, reduce, denominator_mode, *flags)
                + (warps, stages, outputs, weight is not lse),
                logits,
            )
            _forward_launcher.launch(grid, args, warps, stages)
    if vocab_parallel:
        return lse, loss, sum_z, *vocab_parallel_outputs
    return (loss, lse, (denominator if reduce else None)) + ((argmax, mean_z) if outputs else ())


def backward(
    grad_loss,
    logits,
    labels,
    lse,
    grad,
    options,
    denominator=None,
    vocab_start=0,
    vocab_total=None,
    config=None,
    weight=None,
):
    """Writes d(sum_t grad_loss_t * loss_t / denominator)/d logits into `grad` (the shape of logits; it may be
    `logits` itself). grad_loss is per token (N,), or 0-d (one upstream scalar for all tokens); denominator a
    1-element tensor or None. Vocab-parallel mode (vocab_total given): the logits are columns
    [vocab_start, vocab_start + V) of vocab_total, lse the global logsumexp; labels outside [0, vocab_total) give
    NaN rows. config: a BackwardConfig (default backward_config(V)). weight: class weights as in `forward` (the
    same tensor the forward had; not in vocab-parallel mode)."""
    if weight is not None and vocab_total is not None:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    _checked(logits)
    vocab = logits.shape[-1]
    n_rows = labels.shape[0]
    if n_rows == 0:
        return grad
    batch_stride, row_stride, rows_per_batch = row_layout(logits)
    # In place (grad is the logits), the layout is the same one.
    layout = (batch_stride, row_stride, rows_per_batch) if grad is logits else row_layout(grad)
    grad_batch_stride, grad_row_stride, grad_rows_per_batch = layout
    if (
        grad_rows_per_batch != rows_per_batch
    ):  # one kernel argument splits both: express the one-batch side in the other's
        if grad_batch_stride == 0:
            grad_batch_stride = grad_row_stride * rows_per_batch
        elif batch_stride == 0:
            batch_stride, rows_per_batch = row_stride * grad_rows_per_batch, grad_rows_per_batch
        else:
            raise ValueError("grad and logits split their rows into batches differently")
    block, warps = backward_config(vocab) if config is None else config
    flags = _flags(options)
    weight, weight_sum = class_weight_operands(weight, options, lse)
    args = (
        logits,
        batch_stride,
        row_stride,
        grad,
        grad_batch_stride,
        grad_row_stride,
        rows_per_batch,
        labels,
        lse,
        grad_loss,
        grad_loss.stride(0) if grad_loss.dim() else 0,
        lse if denominator is None else denominator,
        vocab,
        options.ignore_index,
        options.logit_scaling,
        options.logit_softcapping,
        options.label_smoothing,
        options.z_loss,
        vocab_start,
        vocab if vocab_total is None else vocab_total,
        weight,
        weight_sum,
        block,  # the constexprs, in the kernel's order: BLOCK, the four flags, HAS_DENOMINATOR, VOCAB_PARALLEL, ...
        *flags,
        denominator is not None,
        vocab_total is not None,
        weight is not lse,
    )
    grid = (n_rows, _cdiv(vocab, block), 1)
    with on_device(logits):
        if not _backward_launcher.cached(grid, args, warps):
            _guard_capture(
                (
                    "backward",
                    logits.device,
                    logits.dtype,
                    grad.dtype,
                    grad_loss.dtype,
                    labels.dtype,
                    block,
                    warps,
                    denominator is not None,
                    *flags,
                    weight is not lse,
                ),
                logits,
            )
            _backward_launcher.launch(grid, args, warps)
    return grad


def denominator_operands(reduction, n_items, placeholder):
    """The in-kernel reduction's divisor as the kernels take it: (DENOMINATOR_MODE, its value, the n_items pointer).
    Mode 0 counts the kept tokens ("mean"), 1 divides by the value ("sum": 1, or a number n_items), 2 reads a tensor
    n_items on the device (no host synchronisation); the pointer is `placeholder` (any float32 tensor on the device)
    unless mode 2."""
    if n_items is None:
        return (0 if reduction == "mean" else 1), 1.0, placeholder
    if isinstance(n_items, torch.Tensor):
        return 2, 1.0, n_items.to(device=placeholder.device, dtype=torch.float32)
    return 1, float(n_items), placeholder


def class_weight_operands(weight, options, placeholder):
    """The kernels' (weight, weight sum) pointer arguments: the float32 weights and, with label smoothing, their
    sum as a 1-element device tensor (no host synchronisation). Without weights both are `placeholder`, a tensor
    the launch passes anyway, so the unweighted variant's arguments keep their types and alignment and
    `weight is placeholder` tells the variant apart."""
    if weight is None:
        return placeholder, placeholder
    weight = weight.to(torch.float32).contiguous()
    weight_sum = weight.sum().reshape(1) if options.label_smoothing > 0.0 else weight
    return weight, weight_sum


def lse_backward(grad_lse, logits, labels, lse, grad, options, vocab_total=None, config=None):
    """Writes d(sum_t grad_lse_t * lse_t) / d logits into `grad` (it may be `logits`): the gradient of the
    z_loss output. The backward kernel with neither smoothing nor z-loss and the label placed outside the columns
    (vocab_start = the vocabulary's size), so that no one-hot term is subtracted; bad labels give NaN rows as in
    `backward`. Vocab-parallel (vocab_total given): lse is the global logsumexp, the columns this rank's."""
    vocab = logits.shape[-1] if vocab_total is None else vocab_total
    options = options._replace(label_smoothing=0.0, z_loss=0.0)
    grad_lse = grad_lse.float().contiguous()
    return backward(grad_lse, logits, labels, lse, grad, options, vocab_start=vocab, vocab_total=vocab, config=config)


def scale_unless_one(tensor, factor):
    """tensor *= factor (a 0-d float32 device tensor) in place, without a host synchronisation; a factor of
    exactly 1 costs one launch and no memory traffic. tensor must be contiguous."""
    _checked(tensor)
    if tensor.numel():
        args = (tensor, tensor.numel(), factor, SCALE_BLOCK)
        grid = (_cdiv(tensor.numel(), SCALE_BLOCK), 1, 1)
        with on_device(tensor):
            if not _scale_launcher.cached(grid, args):
                _scale_launcher.launch(grid, args)
    return tensor


def _launch(launcher, grid, args, variant, tensor):
    """A launch through the cache, or Triton's generic path guarded against a first launch inside a capture."""
    with on_device(tensor):
        if not launcher.cached(grid, args):
            _guard_capture(variant, tensor)
            launcher.launch(grid, args)


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
    grid = (max(_cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    _launch(_maxima_launcher, grid, args, ("vocab-parallel maxima", buffer.device, check_widths), buffer)
    return statistics


def vocab_parallel_rescale(statistics):
    """After the MAX all-reduce: each rank's exp(lse_local - max) into the SUM operand (row 1)."""
    buffer, n_rows = statistics.buffer, statistics.n_rows
    args = (buffer, buffer.shape[1], n_rows, VOCAB_PARALLEL_BLOCK)
    grid = (max(_cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    _launch(_rescale_launcher, grid, args, ("vocab-parallel rescale", buffer.device), buffer)


def vocab_parallel_loss(statistics, labels, options, reduction, n_items, vocab_total):
    """After the SUM all-reduce: (loss, global lse (N,), divisor) of the contract, one launch. loss is the per-token
    float32 losses for "none" (divisor None), else a 0-d tensor of its own, and the divisor a 1-element view of the
    buffer (the backward's). lse is row 1 of the buffer, overwritten in place."""
    buffer, n_rows = statistics.buffer, statistics.n_rows
    reduce = reduction != "none"
    loss = torch.empty(() if reduce else (n_rows,), dtype=torch.float32, device=buffer.device)
    denominator_mode, denominator_value, n_items_ptr = denominator_operands(reduction, n_items, buffer)
    flags = _flags(options)
    args = (
        buffer, buffer.shape[1], labels, loss, loss, n_items_ptr, n_rows, vocab_total, options.ignore_index,
        options.label_smoothing, options.z_loss, denominator_value, statistics.check_widths, flags[2], flags[3],
        reduce, denominator_mode if reduce else 0, VOCAB_PARALLEL_BLOCK,
    )  # fmt: skip
    grid = (1 if reduce else max(_cdiv(n_rows, VOCAB_PARALLEL_BLOCK), 1), 1, 1)
    variant = ("vocab-parallel loss", buffer.device, labels.dtype, *args[12:17])
    _launch(_vocab_parallel_loss_launcher, grid, args, variant, buffer)
    lse = buffer[1, :n_rows]
    return loss, lse, (buffer[0, n_rows + 2 : n_rows + 3] if reduce else None)
