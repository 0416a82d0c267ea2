"""The forward kernels of `jsd` / `linear_jsd`; the backward kernel is backward.py, the launchers launch.py.

Each row's V_s columns are split into S contiguous segments (the launcher picks S from N and V so that N * S
programs fill the GPU; launch.forward_segments) and each program (row, segment) walks its segment in BLOCK columns.
Everything here is in base 2: u2 = softcap(x) * log2(e) / T (one multiply, the temperature's), exp2 / log2 per
element (one MUFU instruction each), and the row's results are converted back to natural units once (* ln 2).

jsd_partials_kernel  grid (N, S), pass 1: the segment's online max and sum of exponentials of u2_s and u2_t and,
                      for the two KL modes, the weighted sum of the log-ratio (rescaled whenever a running max moves),
                      into the row's partials (float32 (N, K, S), K slots per segment; see PARTIAL_SLOTS).
jsd_mixture_kernel   grid (N, S), the mixture's pass 2: merges the row's pass-1 partials into both logsumexps (every
                      program of the row the same way), then the segment's sums of the two KL-to-mixture terms.
jsd_finish_kernel    grid (N,): merges the S partials of each row into loss, lse_s, lse_t and the backward's row
                      constant kl (the loss for beta = 1, KLs for the mixture, 0 for beta = 0).
So the endpoints read each row once (2 launches) and the mixture twice (3 launches). Rows whose label is
ignore_index are never read: their segments are empty and the finish writes 0.
"""

import triton
import triton.language as tl

from ...core.kernel_helpers import tanh
from ...core.launch import INTERPRETED

__all__ = [
    "LN2",
    "LOG2E",
    "LOG2E_IN_KERNEL",
    "PARTIAL_SLOTS",
    "jsd_finish_kernel",
    "jsd_mixture_kernel",
    "jsd_partials_kernel",
    "mixture_log2",
    "scaled_logits",
]

# Partial slots per segment: 0 max of u2_s, 1 sum of 2^(u2_s - shift), 2 max of u2_t, 3 sum of 2^(u2_t - shift);
# slot 4: the KL modes' weighted log-ratio sum, or the mixture's sum p_t (lt2 - lm2); slot 5: the mixture's
# sum p_s (ls2 - lm2).
PARTIAL_SLOTS = (5, 5, 6)  # per MODE
LOG2E = 1.4426950408889634
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)  # the kernels read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)  # float32 smallest normal
# The mixture's one log per element: the GPU's lg2.approx (one MUFU instruction, error about 2**-22, a
# NaN stays NaN) instead of tl.log2, which is libdevice's log2f (about 25 instructions per element: pass 2 was
# compute bound). Triton's interpreter runs no PTX: it takes tl.log2.
PTX_LOG2 = tl.constexpr(not INTERPRETED)


@triton.jit
def scaled_logits(row_ptr, cols, load_mask, in_row, softcap, scale, HAS_SOFTCAP: tl.constexpr):
    """u = softcap(x) * scale of a tile in float32 (scale: 1 / T, or log2(e) / T for base 2), -inf outside the row,
    and tanh(x / c) (for the chain rule; x itself without soft-capping)."""
    x = tl.load(row_ptr + cols, mask=load_mask, other=-float("inf")).to(tl.float32)
    tanh_x = x
    u = x * scale  # masked lanes stay -inf (scale > 0)
    if HAS_SOFTCAP:
        tanh_x = tanh(x / softcap)
        # Soft-capping maps -inf to -softcap: masked lanes are put back to -inf.
        u = tl.where(in_row, softcap * tanh_x * scale, -float("inf"))
    return u, tanh_x


@triton.jit
def _fast_log2(x):
    if PTX_LOG2:
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def mixture_log2(ls, lt, beta, one_minus_beta):
    """(p_s, p_t, lm) of base-2 log-probabilities ls, lt with lm = log2((1 - beta) p_s + beta p_t): two exp2 and one
    log per element (the forward's pass 2 and the backward share it). The mixture is floored at float32's smallest
    normal number with a select (the GPU's max would turn a NaN into the floor; a NaN row must stay NaN): where it
    underflows both p are below it and their terms are negligible, and lm stays finite (no p * inf)."""
    p_s = tl.exp2(ls)
    p_t = tl.exp2(lt)
    mixture = one_minus_beta * p_s + beta * p_t
    lm = _fast_log2(tl.where(mixture < FLOAT32_TINY, FLOAT32_TINY, mixture))
    return p_s, p_t, lm


@triton.jit
def _shift(run_max):
    """The running max as an exponent shift: 0 while every value seen is -inf (-inf - -inf would be NaN)."""
    return tl.where(run_max == -float("inf"), 0.0, run_max)


@triton.jit
def _online_stats(run_max, u):
    """(new max, rescale factor of the old sum, new shift, 2^(u - new shift)) of one tile."""
    new_max = tl.maximum(run_max, tl.max(u, 0))
    shift = _shift(new_max)
    rescale = tl.exp2(run_max - shift)
    e = tl.exp2(u - shift)
    return new_max, rescale, shift, e


@triton.jit
def _online_kl(acc, w_sum, w_rescale, w_shift_move, o_shift_move, e_w, u_w, w_shift, u_o, o_shift):
    """The running sum_j e^(u_w_j - w_shift) ((u_w_j - w_shift) - (u_o_j - o_shift)) over the columns seen, for the
    weighting row w and the other row o: when the shifts move by (dw, do) every earlier term's log-ratio moves by
    -(dw - do) and its weight is rescaled, so the old sum becomes rescale * (acc - (dw - do) * w_sum) (w_sum: the
    old sum of e_w). Terms with e_w = 0 add 0. Divided by sum e_w at the end, it is sum p_w (log p_w - log p_o) up to
    the two log-sums (kept relative to the row maxima, so large logit offsets cancel exactly)."""
    acc = w_rescale * (acc - (w_shift_move - o_shift_move) * w_sum)
    ratio = (u_w - w_shift) - (u_o - o_shift)
    return acc + tl.sum(tl.where(e_w == 0.0, 0.0, e_w * ratio), 0)


@triton.jit
def _segment(labels_ptr, row, V, seg_width, ignore_index, HAS_LABELS: tl.constexpr):
    """Columns [start, stop) of program (row, segment): empty for an ignored row (never read)."""
    end = V
    if HAS_LABELS:
        end = tl.where(tl.load(labels_ptr + row) == ignore_index, 0, V)
    start = tl.program_id(1) * seg_width
    return start, tl.minimum(start + seg_width, end)


@triton.jit
def _segment_pass1(
    s_row, t_row, start, stop, s_softcap, t_softcap, scale, BLOCK: tl.constexpr, MODE: tl.constexpr,
    S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online (max, sum of 2^u) of u2_s and u2_t over columns [start, stop), and for MODE 0 / 1 the weighted
    log-ratio sum (_online_kl) with the teacher / the student as the weighting row."""
    s_max = -float("inf")
    s_sum = 0.0
    t_max = -float("inf")
    t_sum = 0.0
    acc = 0.0
    for first in tl.range(start, stop, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        in_row = cols < stop
        u_s, _ = scaled_logits(s_row, cols, in_row, in_row, s_softcap, scale, S_SOFTCAP)
        u_t, _ = scaled_logits(t_row, cols, in_row, in_row, t_softcap, scale, T_SOFTCAP)
        s_new, s_rescale, s_shift, e_s = _online_stats(s_max, u_s)
        t_new, t_rescale, t_shift, e_t = _online_stats(t_max, u_t)
        s_move = s_shift - _shift(s_max)
        t_move = t_shift - _shift(t_max)
        if MODE == 0:
            acc = _online_kl(acc, t_sum, t_rescale, t_move, s_move, e_t, u_t, t_shift, u_s, s_shift)
        elif MODE == 1:
            acc = _online_kl(acc, s_sum, s_rescale, s_move, t_move, e_s, u_s, s_shift, u_t, t_shift)
        s_sum = s_sum * s_rescale + tl.sum(e_s, 0)
        t_sum = t_sum * t_rescale + tl.sum(e_t, 0)
        s_max = s_new
        t_max = t_new
    return s_max, s_sum, t_max, t_sum, acc


@triton.jit
def _merged(row_parts, n_segments, slot, SEGMENTS_BLOCK: tl.constexpr):
    """(segment maxima, their shifts, row shift, rescale factors, merged sum) of one model's pass-1 partials (max in
    `slot`, sum in `slot + 1`). Padding segments are (-inf, 0): factor 0. The maxima's max may drop a NaN on the GPU;
    the NaN segment's sum is NaN and carries it."""
    segments = tl.arange(0, SEGMENTS_BLOCK)
    valid = segments < n_segments
    maxima = tl.load(row_parts + slot * n_segments + segments, mask=valid, other=-float("inf"))
    sums = tl.load(row_parts + (slot + 1) * n_segments + segments, mask=valid, other=0.0)
    shift = _shift(tl.max(maxima, 0))
    factors = tl.exp2(maxima - shift)
    return _shift(maxima), shift, factors, sums, tl.sum(factors * sums, 0)


@triton.jit
def _merged_kl(row_parts, n_segments, w_slot, o_slot, SEGMENTS_BLOCK: tl.constexpr):
    """The segments' weighted log-ratio sums (slot 4) merged as _online_kl merges tiles, with w the weighting model's
    partials (max in w_slot) and o the other's: (acc, sum of the weighting model's exponentials)."""
    w_shifts, w_shift, w_factors, w_sums, w_total = _merged(row_parts, n_segments, w_slot, SEGMENTS_BLOCK)
    o_shifts, o_shift, _, _, _ = _merged(row_parts, n_segments, o_slot, SEGMENTS_BLOCK)
    segments = tl.arange(0, SEGMENTS_BLOCK)
    accs = tl.load(row_parts + 4 * n_segments + segments, mask=segments < n_segments, other=0.0)
    moves = (w_shift - w_shifts) - (o_shift - o_shifts)
    return tl.sum(w_factors * (accs - moves * w_sums), 0), w_total


@triton.jit
def _log2_sum_exp2(row_parts, n_segments, slot, SEGMENTS_BLOCK: tl.constexpr):
    """One model's base-2 logsumexp and log2 of its sum of exponentials from the row's pass-1 partials."""
    _, shift, _, _, total = _merged(row_parts, n_segments, slot, SEGMENTS_BLOCK)
    log_sum = tl.log2(total)
    return shift + log_sum, log_sum


@triton.jit
def jsd_partials_kernel(
    student_ptr,
    student_stride,
    teacher_ptr,
    teacher_stride,
    labels_ptr,
    partials_ptr,
    V,
    seg_width,
    ignore_index,
    log2e_over_temperature,
    s_softcap,
    t_softcap,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
):
    """Program (row, segment): pass 1 over columns [segment * seg_width, + seg_width) of the row, into slots 0-4
    (slots 0-3 for the mixture) of partials_ptr (N, K, S) float32, S = the grid's second dimension.

    student_ptr, student_stride / teacher_ptr, teacher_stride: the logits' rows (unit column stride); only the first
        V columns of either are read. labels_ptr: (n_rows,) int labels (HAS_LABELS; a row whose label is
        ignore_index is never read). seg_width: a multiple of BLOCK. log2e_over_temperature: log2(e) / T.
    s_softcap, t_softcap: the soft-capping of each side (S_SOFTCAP / T_SOFTCAP switch it on).
    """
    row = tl.program_id(0).to(tl.int64)
    n_segments = tl.num_programs(1)
    start, stop = _segment(labels_ptr, row, V, seg_width, ignore_index, HAS_LABELS)
    s_max, s_sum, t_max, t_sum, acc = _segment_pass1(
        student_ptr + row * student_stride, teacher_ptr + row * teacher_stride, start, stop, s_softcap, t_softcap,
        log2e_over_temperature, BLOCK, MODE, S_SOFTCAP, T_SOFTCAP,
    )  # fmt: skip
    slots = 5 if MODE < 2 else 6
    parts = partials_ptr + row * (slots * n_segments) + tl.program_id(1)
    tl.store(parts, s_max)
    tl.store(parts + n_segments, s_sum)
    tl.store(parts + 2 * n_segments, t_max)
    tl.store(parts + 3 * n_segments, t_sum)
    if MODE < 2:
        tl.store(parts + 4 * n_segments, acc)


@triton.jit
def jsd_mixture_kernel(
    student_ptr,
    student_stride,
    teacher_ptr,
    teacher_stride,
    labels_ptr,
    partials_ptr,
    V,
    seg_width,
    ignore_index,
    beta,
    one_minus_beta,
    log2e_over_temperature,
    s_softcap,
    t_softcap,
    BLOCK: tl.constexpr,
    SEGMENTS_BLOCK: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
):
    """Program (row, segment), the mixture's pass 2: with lm2 = log2((1 - beta) 2^ls2 + beta 2^lt2) (one log per
    element, used by both terms; mixture_log2), the segment's sum p_t (lt2 - lm2) and sum p_s (ls2 - lm2) into
    slots 4 and 5. Terms whose p is 0 add 0. The other arguments are jsd_partials_kernel's."""
    row = tl.program_id(0).to(tl.int64)
    n_segments = tl.num_programs(1)
    row_parts = partials_ptr + row * (6 * n_segments)
    lse_s = _log2_sum_exp2(row_parts, n_segments, 0, SEGMENTS_BLOCK)[0]
    lse_t = _log2_sum_exp2(row_parts, n_segments, 2, SEGMENTS_BLOCK)[0]
    start, stop = _segment(labels_ptr, row, V, seg_width, ignore_index, HAS_LABELS)
    s_row = student_ptr + row * student_stride
    t_row = teacher_ptr + row * teacher_stride
    kl_t = 0.0
    kl_s = 0.0
    for first in tl.range(start, stop, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        in_row = cols < stop
        u_s, _ = scaled_logits(s_row, cols, in_row, in_row, s_softcap, log2e_over_temperature, S_SOFTCAP)
        u_t, _ = scaled_logits(t_row, cols, in_row, in_row, t_softcap, log2e_over_temperature, T_SOFTCAP)
        ls = u_s - lse_s
        lt = u_t - lse_t
        p_s, p_t, lm = mixture_log2(ls, lt, beta, one_minus_beta)
        kl_t += tl.sum(tl.where(p_t == 0.0, 0.0, p_t * (lt - lm)), 0)
        kl_s += tl.sum(tl.where(p_s == 0.0, 0.0, p_s * (ls - lm)), 0)
    parts = row_parts + tl.program_id(1)
    tl.store(parts + 4 * n_segments, kl_t)
    tl.store(parts + 5 * n_segments, kl_s)


@triton.jit
def jsd_finish_kernel(
    labels_ptr,
    partials_ptr,
    loss_ptr,
    lse_s_ptr,
    lse_t_ptr,
    kl_ptr,
    n_segments,
    ignore_index,
    beta,
    one_minus_beta,
    SEGMENTS_BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
):
    """Program `row`: the row's loss, lse_s, lse_t (natural units) and kl from its n_segments partials (the module
    docstring); 0 for an ignored row. loss_ptr, lse_s_ptr, lse_t_ptr, kl_ptr: (n_rows,) float32 outputs."""
    row = tl.program_id(0).to(tl.int64)
    slots = 5 if MODE < 2 else 6
    row_parts = partials_ptr + row * (slots * n_segments)
    lse_s, log_s_sum = _log2_sum_exp2(row_parts, n_segments, 0, SEGMENTS_BLOCK)
    lse_t, log_t_sum = _log2_sum_exp2(row_parts, n_segments, 2, SEGMENTS_BLOCK)
    if MODE == 0:
        acc, t_sum = _merged_kl(row_parts, n_segments, 2, 0, SEGMENTS_BLOCK)
        loss = (acc / t_sum - log_t_sum + log_s_sum) * LN2
        kl = 0.0
    elif MODE == 1:
        acc, s_sum = _merged_kl(row_parts, n_segments, 0, 2, SEGMENTS_BLOCK)
        loss = (acc / s_sum - log_s_sum + log_t_sum) * LN2
        kl = loss
    else:
        segments = tl.arange(0, SEGMENTS_BLOCK)
        valid = segments < n_segments
        kl_t = tl.sum(tl.load(row_parts + 4 * n_segments + segments, mask=valid, other=0.0), 0) * LN2
        kl = tl.sum(tl.load(row_parts + 5 * n_segments + segments, mask=valid, other=0.0), 0) * LN2
        loss = beta * kl_t + one_minus_beta * kl
    kept = True
    if HAS_LABELS:
        kept = tl.load(labels_ptr + row) != ignore_index
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    tl.store(lse_s_ptr + row, tl.where(kept, lse_s * LN2, 0.0))
    tl.store(lse_t_ptr + row, tl.where(kept, lse_t * LN2, 0.0))
    tl.store(kl_ptr + row, tl.where(kept, kl, 0.0))
