"""The forward kernel, grid (N, C): program (row, chunk) walks one chunk of one row, one exp per element, keeping
the running max, sum of exp and sum of z. With C > 1 each chunk publishes these partials and the row's last chunk to
finish combines them; then one masked scalar load reads the label logit, and the per-token loss and logsumexp are
written. For "mean"/"sum" the last row to finish in each group of ROWS_PER_GROUP rows sums the group, and the last
group reduces the group sums, so a reduced loss costs one launch and no framework ops.

The kernel is a body of @triton.jit helpers, one per stage (the chunk's pass, the chunks' combination, the slice's
statistics or the label's loss, the in-kernel reduction), which Triton's compiler inlines: bench/tools/same_ptx.py
checks that the instructions are those of the one-function kernel they were split from.
"""

import triton
import triton.language as tl

from ...core.kernel_helpers import row_offset, transform

__all__ = ["forward_kernel", "token_loss"]


@triton.jit
def _combine_partials(part_max, part_sum):
    """logsumexp of a row from its chunks' (max, sum of exp(z - max)) pairs."""
    row_max = tl.max(part_max, 0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    return shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), 0))


@triton.jit
def token_loss(
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
    over V columns: NaN for a label outside [0, V), 0 for ignore_index (core/reference.token_loss_from_statistics)."""
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
def _chunk_pass(
    row_ptr,
    weight_ptr,
    start,
    end,
    scaling,
    softcap,
    BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    OUTPUTS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """The online pass over columns [start, end) of a row: (running max, sum of exp(z - max), sum of z (with class
    weights sum of w z), first column of the max, sum of exp(z - max) z); the last two only with OUTPUTS."""
    # Scalar running max and sum: the tile's max is taken first, so each element costs one exp.
    run_max = -float("inf")
    run_sum = 0.0
    run_sumz = 0.0
    run_argmax = start
    run_sumez = 0.0
    for tile_start in tl.range(start, end, BLOCK):
        cols = tile_start + tl.arange(0, BLOCK)
        in_row = cols < end
        x = tl.load(row_ptr + cols, mask=in_row, other=-float("inf"))
        z = transform(x, scaling, softcap, HAS_SCALING, HAS_SOFTCAP)
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
    return run_max, run_sum, run_sumz, run_argmax, run_sumez


@triton.jit
def _combined_chunks(
    max_ptr,
    sumexp_ptr,
    sumz_ptr,
    argmax_part_ptr,
    sumez_ptr,
    row,
    n_chunks,
    V,
    CHUNKS_BLOCK: tl.constexpr,
    OUTPUTS: tl.constexpr,
):
    """The row's (lse, sum of z, argmax, mean of z, largest z) from its chunks' published partials, read in chunk
    order, so the result does not depend on which chunk came last; the last three only with OUTPUTS (which reads
    the argmax partials at argmax_part_ptr, int32, and the sums of exp(z - max) z at sumez_ptr)."""
    slots = row * n_chunks + tl.arange(0, CHUNKS_BLOCK)
    slot_mask = tl.arange(0, CHUNKS_BLOCK) < n_chunks
    lse = _combine_partials(
        tl.load(max_ptr + slots, mask=slot_mask, other=-float("inf"), volatile=True),
        tl.load(sumexp_ptr + slots, mask=slot_mask, other=0.0, volatile=True),
    )
    sum_z = tl.sum(tl.load(sumz_ptr + slots, mask=slot_mask, other=0.0, volatile=True), 0)
    argmax = 0
    mean_z = 0.0
    z_max = 0.0
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
    return lse, sum_z, argmax, mean_z, z_max


@triton.jit
def _slice_statistics(
    row_ptr, loss_ptr, lse_ptr, sum_z_out_ptr, row, label, lse, sum_z, V, vocab_start, ignore_index, scaling, softcap,
    HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Vocab-parallel mode: this rank's share of the row, the label logit only where the label column is one of its
    own (0 elsewhere, so the ranks' values sum to the label logit), the local lse and sum of z. The loss is the
    caller's, after the ranks combine these."""
    local_label = label - vocab_start
    owned = (local_label >= 0) & (local_label < V) & (label != ignore_index)
    z_label = transform(
        tl.load(row_ptr + local_label, mask=owned, other=0.0), scaling, softcap, HAS_SCALING, HAS_SOFTCAP
    )
    tl.store(loss_ptr + row, tl.where(owned, z_label, 0.0))
    tl.store(lse_ptr + row, lse)
    tl.store(sum_z_out_ptr + row, sum_z)


@triton.jit
def _label_loss(
    row_ptr, weight_ptr, weight_sum_ptr, label, lse, sum_z, V, ignore_index, scaling, softcap, label_smoothing,
    z_loss, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    """The row's per-token loss from its lse, its sum of z and its label's logit (class-weighted with HAS_WEIGHT)."""
    # The only data-dependent address: loaded only for a label inside [0, V).
    load_label = (label >= 0) & (label < V) & (label != ignore_index)
    z_label = transform(
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
        loss = token_loss(
            z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
        )
    return loss


@triton.jit
def _reduce_in_groups(
    labels_ptr, loss_ptr, arrivals_ptr, group_partials_ptr, reduced_ptr, denominator_out_ptr, n_items_ptr, weight_ptr,
    row, n_rows, V, ignore_index, denominator_value, DENOMINATOR: tl.constexpr, GROUPS_BLOCK: tl.constexpr,
    ROWS_PER_GROUP: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    """After the row's loss is stored: in this same launch, in a fixed order (deterministic), the last row to finish
    in each group of ROWS_PER_GROUP rows sums the group's losses (and counts its kept tokens) while other rows still
    run; the last group to finish reduces the group sums. One pass over all N losses by the batch's last row instead
    left a serial chain of loads after everything else: +13% at V=32000 (bench/NOTES.md)."""
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
                tl.store(group_partials_ptr + n_groups + group, tl.sum((labels != ignore_index).to(tl.float32), 0))
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
def forward_kernel(
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
    reduced_ptr: the 0-d reduced loss (REDUCE). denominator_out_ptr: the divisor it used (REDUCE). n_items_ptr: a
        device n_items (DENOMINATOR == 2). n_rows, V (this launch's columns), chunk_width, n_chunks: the grid's extent.
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
    the loss is weighted as F.cross_entropy's (`_weighted_token_loss`), the sum-of-z partial becomes sum_c w_c z_c
    (a class of weight 0 adds nothing, even at z = -inf), and "mean" divides by sum_t w[y_t]. Not with VOCAB_PARALLEL.
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # The float32 scratch: the chunks' three partials (max, sum of exp, sum of z; partials_stride apart) and the row
    # groups' loss sums then kept counts, at offsets the launcher keeps multiples of 16 elements.
    max_ptr = scratch_ptr + partials_offset
    sumexp_ptr = max_ptr + partials_stride
    sumz_ptr = sumexp_ptr + partials_stride
    argmax_part_ptr = arrivals_ptr  # without OUTPUTS: stand-ins, never read
    sumez_ptr = sumz_ptr
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
    row_ptr = logits_ptr + row_offset(row, logits_batch_stride, logits_row_stride, rows_per_batch)
    label = tl.load(labels_ptr + row).to(tl.int64)
    start = chunk * chunk_width
    end = tl.minimum(start + chunk_width, V)
    end = tl.where(label == ignore_index, start, end)  # an ignored row's logits are never read
    run_max, run_sum, run_sumz, run_argmax, run_sumez = _chunk_pass(
        row_ptr, weight_ptr, start, end, scaling, softcap, BLOCK, HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, OUTPUTS,
        HAS_WEIGHT,
    )  # fmt: skip
    shift = tl.where(run_max == -float("inf"), 0.0, run_max)
    lse = shift + tl.log(run_sum)
    sum_z = run_sumz
    if OUTPUTS:
        argmax = run_argmax
        mean_z = run_sumez / run_sum
        z_max = run_max
    is_last = True
    if n_chunks > 1:
        # Publish this chunk; the row's last chunk to arrive combines all of them.
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
            lse, sum_z, argmax, mean_z, z_max = _combined_chunks(
                max_ptr, sumexp_ptr, sumz_ptr, argmax_part_ptr, sumez_ptr, row, n_chunks, V, CHUNKS_BLOCK, OUTPUTS
            )
    if VOCAB_PARALLEL and is_last:
        _slice_statistics(
            row_ptr, loss_ptr, lse_ptr, sum_z_out_ptr, row, label, lse, sum_z, V, vocab_start, ignore_index, scaling,
            softcap, HAS_SCALING, HAS_SOFTCAP,
        )  # fmt: skip
        if OUTPUTS:
            tl.store(argmax_out_ptr + row, (argmax + vocab_start).to(tl.int32))
            tl.store(mean_z_out_ptr + row, mean_z)
            tl.store(z_max_out_ptr + row, z_max)
    elif is_last:
        loss = _label_loss(
            row_ptr, weight_ptr, weight_sum_ptr, label, lse, sum_z, V, ignore_index, scaling, softcap,
            label_smoothing, z_loss, HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS, HAS_WEIGHT,
        )  # fmt: skip
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
        if OUTPUTS:
            tl.store(argmax_out_ptr + row, argmax.to(tl.int32))
            tl.store(mean_z_out_ptr + row, mean_z)
        if REDUCE:
            _reduce_in_groups(
                labels_ptr, loss_ptr, arrivals_ptr, group_partials_ptr, reduced_ptr, denominator_out_ptr, n_items_ptr,
                weight_ptr, row, n_rows, V, ignore_index, denominator_value, DENOMINATOR, GROUPS_BLOCK,
                ROWS_PER_GROUP, HAS_WEIGHT,
            )  # fmt: skip


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
