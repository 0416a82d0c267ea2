"""Triton kernels for the fused cross-entropy (see CONTRACT.md for the math).

Three kernels, each reading the logits at most once:
  _forward_chunk_kernel   grid (N, C): one program walks one chunk of one row, one exp per element,
                          and leaves that chunk's running max, sum of exp and sum of z in float32 partials.
  _forward_finish_kernel  grid (N,): combines a row's C partials into its logsumexp, reads the label logit
                          with one masked scalar load, writes the per-token loss and lse.
  _backward_kernel        grid (N, cdiv(V, BLOCK)): recomputes z, writes the gradient in one pass, in place
                          when the caller passes the logits buffer as the gradient buffer.
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
def _forward_chunk_kernel(
    logits_ptr, logits_row_stride, labels_ptr,
    max_ptr, sumexp_ptr, sumz_ptr,
    V, chunk_width, n_chunks, ignore_index, scaling, softcap,
    BLOCK: tl.constexpr, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUM_Z: tl.constexpr,
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
        if NEED_SUM_Z:
            run_sumz += tl.sum(tl.where(in_row, z, 0.0), 0)

    out = row * n_chunks + chunk
    tl.store(max_ptr + out, run_max)
    tl.store(sumexp_ptr + out, run_sum)
    if NEED_SUM_Z:
        tl.store(sumz_ptr + out, run_sumz)


@triton.jit
def _combine_partials(part_max, part_sum):
    """logsumexp of a row from its chunks' (max, sum of exp(z - max)) pairs."""
    row_max = tl.max(part_max, 0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    return shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), 0))


@triton.jit
def _token_loss(z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss,
                HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
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
def _dloss_dlogits(p, tanh_z, cols, label, lse, V, scaling, label_smoothing, z_loss,
                   HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                   HAS_Z_LOSS: tl.constexpr):
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
def _forward_finish_kernel(
    logits_ptr, logits_row_stride, labels_ptr,
    max_ptr, sumexp_ptr, sumz_ptr, loss_ptr, lse_ptr,
    V, n_chunks, ignore_index, scaling, softcap, label_smoothing, z_loss,
    CHUNKS_BLOCK: tl.constexpr, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = row * n_chunks + tl.arange(0, CHUNKS_BLOCK)
    chunk_mask = tl.arange(0, CHUNKS_BLOCK) < n_chunks
    lse = _combine_partials(tl.load(max_ptr + chunks, mask=chunk_mask, other=-float("inf")),
                            tl.load(sumexp_ptr + chunks, mask=chunk_mask, other=0.0))
    sum_z = 0.0
    if HAS_SMOOTHING:
        sum_z = tl.sum(tl.load(sumz_ptr + chunks, mask=chunk_mask, other=0.0), 0)
    label = tl.load(labels_ptr + row).to(tl.int64)
    # The only data-dependent address: loaded only for a label inside [0, V).
    load_label = (label >= 0) & (label < V) & (label != ignore_index)
    x_label = tl.load(logits_ptr + row * logits_row_stride + label, mask=load_label, other=0.0)
    z_label = _transform(x_label, scaling, softcap, HAS_SCALING, HAS_SOFTCAP)
    loss = _token_loss(z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss, HAS_SMOOTHING,
                       HAS_Z_LOSS)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(
    logits_ptr, logits_row_stride, grad_ptr, grad_row_stride, labels_ptr, lse_ptr,
    grad_loss_ptr, grad_loss_stride,
    V, ignore_index, scaling, softcap, label_smoothing, z_loss,
    BLOCK: tl.constexpr, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V

    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index
    lse = tl.load(lse_ptr + row)
    # Upstream gradient of this token's loss; stride 0 when it is one scalar broadcast over the rows.
    grad_loss = tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32)
    grad_loss = tl.where((label >= 0) & (label < V), grad_loss, float("nan"))

    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_row & ~ignored, other=0.0).to(tl.float32)
    if HAS_SCALING:
        x = x * scaling
    tanh_z = x  # unused without soft-capping
    if HAS_SOFTCAP:
        tanh_z = _tanh(x / softcap)
        x = softcap * tanh_z
    dx = _dloss_dlogits(tl.exp(x - lse), tanh_z, cols, label, lse, V, scaling, label_smoothing, z_loss,
                        HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS)
    dx = tl.where(ignored, 0.0, dx * grad_loss)
    tl.store(grad_ptr + row * grad_row_stride + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _forward_with_grad_kernel(
    logits_ptr, logits_row_stride, grad_ptr, grad_row_stride, labels_ptr, loss_ptr, grad_scale_ptr,
    sync_ptr, max_ptr, sumexp_ptr, sumz_ptr,
    V, n_chunks, ignore_index, scaling, softcap, label_smoothing, z_loss,
    CHUNK: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    """Loss and gradient with the logits read once: each program holds one CHUNK of a row in registers,
    publishes that chunk's (max, sum of exp, sum of z), waits until every chunk of its row has, then writes its
    part of the gradient (scaled by *grad_scale_ptr) from registers. grid = (N * n_chunks,).

    Waiting on other programs needs them to be running. Programs take tickets (sync_ptr[0]) in the order they
    actually start, and a ticket's row and chunk follow from it, so a program only waits for siblings with nearby
    tickets: every lower ticket has started, and a higher one starts as soon as any slot frees, which holds while
    n_chunks is far below what the GPU runs at once (the launcher checks). sync_ptr[1 + row] counts arrivals.
    """
    ticket = tl.atomic_add(sync_ptr, 1)
    row = (ticket // n_chunks).to(tl.int64)
    chunk = ticket % n_chunks
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < V
    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index

    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_row & ~ignored, other=0.0).to(tl.float32)
    if HAS_SCALING:
        x = x * scaling
    tanh_z = x  # unused without soft-capping
    if HAS_SOFTCAP:
        tanh_z = _tanh(x / softcap)
        x = softcap * tanh_z
    z = tl.where(in_row, x, -float("inf"))
    z_label = tl.sum(tl.where(cols == label, z, 0.0), 0)  # from registers: the label's column may be overwritten
    chunk_max = tl.max(z, 0)
    shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    exp_z = tl.exp(z - shift)
    chunk_sum = tl.sum(exp_z, 0)
    chunk_sumz = 0.0
    if HAS_SMOOTHING:
        chunk_sumz = tl.sum(tl.where(in_row, z, 0.0), 0)

    lse = shift + tl.log(chunk_sum)
    sum_z = chunk_sumz
    if (n_chunks > 1) & (label != ignore_index):
        slot = row * n_chunks + chunk
        tl.store(max_ptr + slot, chunk_max)
        tl.store(sumexp_ptr + slot, chunk_sum)
        tl.store(sumz_ptr + slot, chunk_sumz)
        tl.debug_barrier()  # every thread's stores precede the release below
        arrived = tl.atomic_add(sync_ptr + 1 + row, 1, sem="release") + 1
        while arrived < n_chunks:
            arrived = tl.atomic_add(sync_ptr + 1 + row, 0, sem="acquire")
        tl.debug_barrier()
        slots = row * n_chunks + tl.arange(0, CHUNKS_BLOCK)
        slot_mask = tl.arange(0, CHUNKS_BLOCK) < n_chunks
        lse = _combine_partials(tl.load(max_ptr + slots, mask=slot_mask, other=-float("inf"), volatile=True),
                                tl.load(sumexp_ptr + slots, mask=slot_mask, other=0.0, volatile=True))
        if HAS_SMOOTHING:
            sum_z = tl.sum(tl.load(sumz_ptr + slots, mask=slot_mask, other=0.0, volatile=True), 0)

    grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
    grad_scale = tl.where((label >= 0) & (label < V), grad_scale, float("nan"))
    dx = _dloss_dlogits(exp_z * tl.exp(shift - lse), tanh_z, cols, label, lse, V, scaling, label_smoothing, z_loss,
                        HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS)
    dx = tl.where(ignored, 0.0, dx * grad_scale)
    tl.store(grad_ptr + row * grad_row_stride + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)

    # The chunk holding the label writes the token's loss (chunk 0 when the label is ignored or out of range).
    label_chunk = tl.where((label >= 0) & (label < V), label // CHUNK, 0)
    if chunk == label_chunk:
        loss = _token_loss(z_label, label, lse, sum_z, V, ignore_index, label_smoothing, z_loss, HAS_SMOOTHING,
                           HAS_Z_LOSS)
        tl.store(loss_ptr + row, loss)


@triton.jit
def _scale_kernel(grad_ptr, grad_row_stride, scale_ptr, n_rows, V, BLOCK: tl.constexpr):
    """grad *= *scale_ptr, in place, unless the scale is exactly 1 (the usual loss.backward()): then every program
    returns after one scalar load, so the common case costs one tiny launch and no pass over the gradient.
    A persistent grid walks the (row, tile) pairs."""
    scale = tl.load(scale_ptr).to(tl.float32)
    tiles_per_row = tl.cdiv(V, BLOCK)
    n_tiles = n_rows * tiles_per_row
    if scale != 1.0:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            row = (tile // tiles_per_row).to(tl.int64)
            cols = (tile % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
            ptrs = grad_ptr + row * grad_row_stride + cols
            g = tl.load(ptrs, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(ptrs, (g * scale).to(grad_ptr.dtype.element_ty), mask=cols < V)
