"""Triton kernels for the fused cross-entropy (see CONTRACT.md for the math).

Two kernels, each reading the logits once (and a scaling kernel for linear_cross_entropy):
  _forward_kernel   grid (N, C): one program walks one chunk of one row, one exp per element, keeping the running
                    max, sum of exp and sum of z. With C > 1 each chunk publishes these partials and the row's last
                    chunk to finish combines them; then one masked scalar load reads the label logit, and the
                    per-token loss and logsumexp are written. For "mean"/"sum" the last row to finish in each
                    group of 64 rows sums the group, and the last group reduces the group sums, so a reduced
                    loss costs one launch and no framework ops.
  _backward_kernel  grid (N, cdiv(V, BLOCK)): recomputes z, writes the gradient in one pass, in place when the
                    caller passes the logits buffer as the gradient buffer.
Rows whose label is ignore_index are never read: their partials are empty and their gradient is written as zeros.
Row offsets are 64-bit, so N*V beyond 2**31 elements is fine.
"""

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


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
    logits_row_stride,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    max_ptr,
    sumexp_ptr,
    sumz_ptr,
    arrivals_ptr,
    group_partials_ptr,
    reduced_ptr,
    denominator_ptr,
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
    BLOCK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    REDUCE: tl.constexpr,
    DENOMINATOR: tl.constexpr,
    ROWS_BLOCK: tl.constexpr,
    ROWS_PER_GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)

    start = chunk * chunk_width
    end = tl.minimum(start + chunk_width, V)
    end = tl.where(label == ignore_index, start, end)  # an ignored row's logits are never read

    # Scalar running max and sum: the tile's max is taken first, so each element costs one exp.
    run_max = -float("inf")
    run_sum = 0.0
    run_sumz = 0.0
    for tile_start in tl.range(start, end, BLOCK):
        cols = tile_start + tl.arange(0, BLOCK)
        in_row = cols < end
        x = tl.load(row_ptr + cols, mask=in_row, other=-float("inf"))
        z = _transform(x, scaling, softcap, HAS_SCALING, HAS_SOFTCAP)
        z = tl.where(in_row, z, -float("inf"))  # soft-capping maps -inf to -softcap; masked lanes stay -inf
        new_max = tl.maximum(run_max, tl.max(z, 0))
        # While everything seen is -inf, shift by 0 instead (-inf - -inf would be NaN).
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift), 0)
        run_max = new_max
        if HAS_SMOOTHING:
            run_sumz += tl.sum(tl.where(in_row, z, 0.0), 0)

    shift = tl.where(run_max == -float("inf"), 0.0, run_max)
    lse = shift + tl.log(run_sum)
    sum_z = run_sumz
    is_last = True
    if n_chunks > 1:
        # Publish this chunk; the row's last chunk to arrive combines all of them in chunk order, so the result
        # does not depend on which program came last.
        slot = row * n_chunks + chunk
        tl.store(max_ptr + slot, run_max)
        tl.store(sumexp_ptr + slot, run_sum)
        tl.store(sumz_ptr + slot, run_sumz)
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
    if is_last:
        # The only data-dependent address: loaded only for a label inside [0, V).
        load_label = (label >= 0) & (label < V) & (label != ignore_index)
        z_label = _transform(
            tl.load(row_ptr + label, mask=load_label, other=0.0), scaling, softcap, HAS_SCALING, HAS_SOFTCAP
        )
        loss = _token_loss(
            z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
        )
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
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
                    tl.store(group_partials_ptr + n_groups + group, tl.sum((labels != ignore_index).to(tl.float32), 0))
                tl.debug_barrier()
                if tl.atomic_add(arrivals_ptr + n_rows, 1, sem="acq_rel") == n_groups - 1:
                    _reduce_losses(
                        group_partials_ptr,
                        reduced_ptr,
                        denominator_ptr,
                        n_groups,
                        denominator_value,
                        DENOMINATOR,
                        ROWS_BLOCK,
                    )


@triton.jit
def _reduce_losses(
    group_partials_ptr,
    reduced_ptr,
    denominator_ptr,
    n_groups,
    denominator_value,
    DENOMINATOR: tl.constexpr,
    ROWS_BLOCK: tl.constexpr,
):
    """reduced = [sum of losses / denominator, denominator] from the groups' [loss sums..., kept counts...].
    DENOMINATOR: 0 = the kept-token count (at least 1, so an all-ignored batch gives 0), 1 = denominator_value,
    2 = *denominator_ptr (a device scalar)."""
    total = 0.0
    count = 0.0
    for start in tl.range(0, n_groups, ROWS_BLOCK):
        groups = start + tl.arange(0, ROWS_BLOCK)
        in_batch = groups < n_groups
        total += tl.sum(tl.load(group_partials_ptr + groups, mask=in_batch, other=0.0, volatile=True), 0)
        if DENOMINATOR == 0:
            count += tl.sum(tl.load(group_partials_ptr + n_groups + groups, mask=in_batch, other=0.0, volatile=True), 0)
    if DENOMINATOR == 0:
        denominator = tl.maximum(count, 1.0)
    elif DENOMINATOR == 1:
        denominator = denominator_value
    else:
        denominator = tl.load(denominator_ptr).to(tl.float32)
    tl.store(reduced_ptr, total / denominator)
    tl.store(reduced_ptr + 1, denominator)


@triton.jit
def _backward_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
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
    BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_DENOMINATOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V

    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index
    lse = tl.load(lse_ptr + row)
    # Upstream gradient of this token's loss; stride 0 when it is one scalar broadcast over the rows.
    grad_loss = tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32)
    if HAS_DENOMINATOR:  # a reduced loss: d loss / d token loss = 1 / denominator
        grad_loss = grad_loss / tl.load(denominator_ptr)
    grad_loss = tl.where((label >= 0) & (label < V), grad_loss, float("nan"))

    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_row & ~ignored, other=0.0).to(tl.float32)
    if HAS_SCALING:
        x = x * scaling
    tanh_z = x  # unused without soft-capping
    if HAS_SOFTCAP:
        tanh_z = _tanh(x / softcap)
        x = softcap * tanh_z
    dx = _dloss_dlogits(
        tl.exp(x - lse),
        tanh_z,
        cols,
        label,
        lse,
        V,
        scaling,
        label_smoothing,
        z_loss,
        HAS_SCALING,
        HAS_SOFTCAP,
        HAS_SMOOTHING,
        HAS_Z_LOSS,
    )
    dx = tl.where(ignored, 0.0, dx * grad_loss)
    tl.store(grad_ptr + row * grad_row_stride + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _scale_unless_one_kernel(ptr, n_elements, factor_ptr, BLOCK: tl.constexpr):
    """ptr[:n_elements] *= *factor_ptr, and no memory traffic at all when the factor is exactly 1 (the usual
    upstream gradient of a loss), which the host cannot know without a synchronisation. Exact zeros stay zero
    whatever the factor (NaN, inf): an ignored token's gradient is 0, as the backward kernel writes it."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        x = tl.load(ptr + offsets, mask=in_range)
        scaled = tl.where(x == 0, 0.0, x.to(tl.float32) * factor)
        tl.store(ptr + offsets, scaled.to(ptr.dtype.element_ty), mask=in_range)
