"""@triton.jit helpers shared by the forward, backward and combine kernels: the logit transform (scaling, soft-capping),
row addressing, the combination of chunk partials, the per-token loss (plain and class-weighted) and d loss / d x."""

import triton
import triton.language as tl


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
