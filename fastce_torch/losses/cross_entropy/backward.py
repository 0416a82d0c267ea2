"""The backward kernel (grid (N, cdiv(V, BLOCK)): recomputes z and writes the gradient in one pass, in place when the
caller passes the logits buffer as the gradient buffer)."""

import triton
import triton.language as tl

from ...core.kernel_helpers import row_offset, tanh

__all__ = ["backward_kernel"]


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
def backward_kernel(
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
    grad_entropy_ptr,
    mean_z_ptr,
    BLOCK: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_DENOMINATOR: tl.constexpr,
    VOCAB_PARALLEL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
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
    HAS_ENTROPY_GRAD: also the gradient of the entropy output, from grad_entropy_ptr (float32 (n_rows,), the
    upstream of each row's entropy H) and mean_z_ptr (float32 (n_rows,), mz = sum_j p_j z_j = lse - H; in
    vocab-parallel mode the global one): adds g_H p_j (mz - z_j) dz/dx in the same pass (0 where p_j = 0).
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

    logits_row = logits_ptr + row_offset(row, logits_batch_stride, logits_row_stride, rows_per_batch)
    # `!= 0` is a no-op compiled (the compare of an int1 with false folds away: same PTX) but makes the mask a bool
    # payload in Triton's interpreter, which splats the scalar `~ignored` to int64; Triton 3.9's interpreted masked
    # load rejects a non-bool mask ("mask has unsupported dtype").
    x = tl.load(logits_row + cols, mask=(in_row & ~ignored) != 0, other=0.0).to(tl.float32)
    if HAS_SCALING:
        x = x * scaling
    tanh_z = x  # unused without soft-capping
    if HAS_SOFTCAP:
        tanh_z = tanh(x / softcap)
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
    if HAS_ENTROPY_GRAD:  # dH/dz_j = p_j (mz - z_j); -inf logits (p_j = 0) contribute 0, not 0 * inf
        p = tl.exp(x - lse)
        dh = tl.where(p > 0, p * (tl.load(mean_z_ptr + row) - x), 0.0) * tl.load(grad_entropy_ptr + row)
        if HAS_SOFTCAP:
            dh = dh * (1.0 - tanh_z * tanh_z)
        if HAS_SCALING:
            dh = dh * scaling
        dx = tl.where(ignored, 0.0, dx + dh)
    grad_row = grad_ptr + row_offset(row, grad_batch_stride, grad_row_stride, rows_per_batch)
    tl.store(grad_row + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)
