"""The distillation kernels of `jsd` / `linear_jsd` (issue 38) and their launchers.

Per row, with u = softcap(x) / T for the student (its first V_s columns) and the teacher (its first V_s columns),
ls = log softmax(u_s), lt = log softmax(u_t) (TRL's generalized JSD, issue 38):
  MODE 0 (beta == 0): loss = sum_j p_t (lt - ls)                      (forward KL)
  MODE 1 (beta == 1): loss = sum_j p_s (ls - lt)                      (reverse KL)
  MODE 2 (mixture):   lm = log((1 - beta) p_s + beta p_t),
                      loss = beta sum_j p_t (lt - lm) + (1 - beta) sum_j p_s (ls - lm)
Terms whose weight p is 0 contribute 0 (never 0 * inf); the tests are `p == 0`, so that a NaN p (a NaN row) stays
NaN in the loss and in every element of the gradient.

_jsd_forward_kernel  grid (N,): one program walks one row in BLOCK columns. Pass 1 keeps the online max and sum of
                     exponentials of both rows and, for the two KL modes, the weighted sum of the log-ratio (rescaled
                     whenever a running max moves), so the endpoints read each row once; the mixture reads it again
                     (pass 2, both logsumexps known). Writes per row: loss, lse_s, lse_t and the gradient's row
                     constant kl (the loss for MODE 1, sum p_s (ls - lm) for MODE 2, 0 for MODE 0).
_jsd_backward_kernel grid (N, cdiv(V_s, BLOCK)): d(upstream * loss) / d student logits of BLOCK columns from the
                     row's statistics, into a given buffer (which may be the student logits themselves: each tile is
                     read before it is written, by the same program).
Rows whose label is ignore_index are never read: loss and statistics 0, gradient 0. The teacher gets no gradient.
"""

import functools

import torch
import triton
import triton.language as tl

from ..contract import FLOAT32_TINY
from .common import _tanh
from .launch import Launcher, _cdiv, _checked, _guard_capture, _next_power_of_2, on_device

# One program per row for the forward: 4096 columns per iteration with 8 warps (16 float32 per thread per live
# tile; pass 1 holds about 7 such tiles). The backward's grid also splits rows into tiles (elementwise given the
# row statistics), 4096 columns with 8 warps. Not tuned on the H200 yet (bench/NOTES.md).
JSD_FORWARD_BLOCK, JSD_FORWARD_WARPS = 4096, 8
JSD_BACKWARD_BLOCK, JSD_BACKWARD_WARPS = 4096, 8
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


@triton.jit
def _scaled_logits(row_ptr, cols, load_mask, in_row, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """u = softcap(x) / T of a tile in float32, -inf outside the row, and tanh(x / c) (for the chain rule; x itself
    without soft-capping)."""
    x = tl.load(row_ptr + cols, mask=load_mask, other=-float("inf")).to(tl.float32)
    tanh_x = x
    if HAS_SOFTCAP:
        tanh_x = _tanh(x / softcap)
        x = softcap * tanh_x
    # Soft-capping maps -inf to -softcap: masked lanes are put back to -inf.
    return tl.where(in_row, x * inv_temperature, -float("inf")), tanh_x


@triton.jit
def _shift(run_max):
    """The running max as an exponent shift: 0 while every value seen is -inf (-inf - -inf would be NaN)."""
    return tl.where(run_max == -float("inf"), 0.0, run_max)


@triton.jit
def _online_stats(run_max, u):
    """(new max, rescale factor of the old sum, new shift, exp(u - new shift)) of one tile."""
    new_max = tl.maximum(run_max, tl.max(u, 0))
    shift = _shift(new_max)
    rescale = tl.exp(run_max - shift)
    e = tl.exp(u - shift)
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
def _mixture_terms(u_s, u_t, lse_s, lse_t, beta, one_minus_beta):
    """Per column: (p_s, p_t, ls, lt, lm) with lm = log((1 - beta) p_s + beta p_t): three exponentials / logarithms
    per element instead of four for logaddexp. The mixture is floored at float32's smallest normal number: where it
    underflows both p are below it (their terms are negligible), and lm stays finite (no p * inf)."""
    ls = u_s - lse_s
    lt = u_t - lse_t
    p_s = tl.exp(ls)
    p_t = tl.exp(lt)
    mixture = one_minus_beta * p_s + beta * p_t
    # A select, not tl.maximum: the GPU's max returns the floor for a NaN, and a NaN row must stay NaN.
    lm = tl.log(tl.where(mixture < 1.1754943508222875e-38, 1.1754943508222875e-38, mixture))
    return p_s, p_t, ls, lt, lm


@triton.jit
def _row_pass1(
    s_row, t_row, end, s_softcap, t_softcap, inv_temperature, BLOCK: tl.constexpr, MODE: tl.constexpr,
    S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online (max, sum of exp) of u_s and u_t over columns [0, end), and for MODE 0 / 1 the weighted log-ratio sum
    (_online_kl) with the teacher / the student as the weighting row."""
    s_max = -float("inf")
    s_sum = 0.0
    t_max = -float("inf")
    t_sum = 0.0
    acc = 0.0
    for start in tl.range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < end
        u_s, _ = _scaled_logits(s_row, cols, in_row, in_row, s_softcap, inv_temperature, S_SOFTCAP)
        u_t, _ = _scaled_logits(t_row, cols, in_row, in_row, t_softcap, inv_temperature, T_SOFTCAP)
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
def _row_pass2(
    s_row, t_row, end, lse_s, lse_t, s_softcap, t_softcap, inv_temperature, beta, one_minus_beta,
    BLOCK: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The mixture's (sum p_t (lt - lm), sum p_s (ls - lm)) over columns [0, end), both logsumexps known."""
    kl_t = 0.0
    kl_s = 0.0
    for start in tl.range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < end
        u_s, _ = _scaled_logits(s_row, cols, in_row, in_row, s_softcap, inv_temperature, S_SOFTCAP)
        u_t, _ = _scaled_logits(t_row, cols, in_row, in_row, t_softcap, inv_temperature, T_SOFTCAP)
        p_s, p_t, ls, lt, lm = _mixture_terms(u_s, u_t, lse_s, lse_t, beta, one_minus_beta)
        kl_t += tl.sum(tl.where(p_t == 0.0, 0.0, p_t * (lt - lm)), 0)
        kl_s += tl.sum(tl.where(p_s == 0.0, 0.0, p_s * (ls - lm)), 0)
    return kl_t, kl_s


@triton.jit
def _jsd_forward_kernel(
    student_ptr,
    student_stride,
    teacher_ptr,
    teacher_stride,
    labels_ptr,
    loss_ptr,
    lse_s_ptr,
    lse_t_ptr,
    kl_ptr,
    V,
    ignore_index,
    beta,
    one_minus_beta,
    inv_temperature,
    s_softcap,
    t_softcap,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
):
    """Program `row`: the row's loss and statistics (see the module docstring).

    student_ptr, student_stride / teacher_ptr, teacher_stride: the logits' rows (unit column stride); only the first
        V columns of either are read. labels_ptr: (n_rows,) int labels (HAS_LABELS; a row whose label is
        ignore_index is never read). loss_ptr, lse_s_ptr, lse_t_ptr, kl_ptr: (n_rows,) float32 outputs.
    beta, one_minus_beta: the mixture's weights (MODE 2). inv_temperature: 1 / T.
    s_softcap, t_softcap: the soft-capping of each side (S_SOFTCAP / T_SOFTCAP switch it on).
    """
    row = tl.program_id(0).to(tl.int64)
    end = V
    if HAS_LABELS:
        label = tl.load(labels_ptr + row)
        end = tl.where(label == ignore_index, 0, V)  # an ignored row is never read
    s_row = student_ptr + row * student_stride
    t_row = teacher_ptr + row * teacher_stride
    s_max, s_sum, t_max, t_sum, acc = _row_pass1(
        s_row, t_row, end, s_softcap, t_softcap, inv_temperature, BLOCK, MODE, S_SOFTCAP, T_SOFTCAP
    )
    log_s_sum = tl.log(s_sum)
    log_t_sum = tl.log(t_sum)
    lse_s = _shift(s_max) + log_s_sum
    lse_t = _shift(t_max) + log_t_sum
    if MODE == 0:
        loss = acc / t_sum - log_t_sum + log_s_sum
        kl = 0.0
    elif MODE == 1:
        loss = acc / s_sum - log_s_sum + log_t_sum
        kl = loss
    else:
        kl_t, kl = _row_pass2(
            s_row, t_row, end, lse_s, lse_t, s_softcap, t_softcap, inv_temperature, beta, one_minus_beta,
            BLOCK, S_SOFTCAP, T_SOFTCAP,
        )  # fmt: skip
        loss = beta * kl_t + one_minus_beta * kl
    kept = end > 0
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    tl.store(lse_s_ptr + row, tl.where(kept, lse_s, 0.0))
    tl.store(lse_t_ptr + row, tl.where(kept, lse_t, 0.0))
    tl.store(kl_ptr + row, tl.where(kept, kl, 0.0))


@triton.jit
def _jsd_backward_kernel(
    student_ptr,
    student_stride,
    teacher_ptr,
    teacher_stride,
    grad_ptr,
    grad_stride,
    labels_ptr,
    lse_s_ptr,
    lse_t_ptr,
    kl_ptr,
    upstream_ptr,
    upstream_stride,
    V,
    ignore_index,
    beta,
    one_minus_beta,
    inv_temperature,
    s_softcap,
    t_softcap,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
):
    """Program (row, tile): d(g_row * loss_row) / d x_s of BLOCK columns, g_row = upstream_ptr[row * upstream_stride]
    (stride 0: one scalar for every row). d/du_s is p_s - p_t (MODE 0), p_s (ls - lt - kl) (MODE 1),
    (1 - beta) p_s (ls - lm - kl) (MODE 2), 0 where p_s = 0; then / T and through the student's soft-capping.
    grad_ptr, grad_stride: where it goes (may be student_ptr). The other arguments are the forward's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V
    load_mask = in_row
    if HAS_LABELS:
        kept = tl.load(labels_ptr + row) != ignore_index
        # `!= 0` makes the mask a bool payload in Triton's interpreter (which splats a scalar to int64); a no-op
        # compiled.
        load_mask = (in_row & kept) != 0
    u_s, tanh_s = _scaled_logits(student_ptr + row * student_stride, cols, load_mask, in_row, s_softcap,
                                 inv_temperature, S_SOFTCAP)  # fmt: skip
    u_t, _ = _scaled_logits(teacher_ptr + row * teacher_stride, cols, load_mask, in_row, t_softcap, inv_temperature,
                            T_SOFTCAP)  # fmt: skip
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    if MODE == 0:
        du = tl.exp(u_s - lse_s) - tl.exp(u_t - lse_t)
    elif MODE == 1:
        ls = u_s - lse_s
        p_s = tl.exp(ls)
        du = tl.where(p_s == 0.0, 0.0, p_s * (ls - (u_t - lse_t) - tl.load(kl_ptr + row)))
    else:
        p_s, _, ls, _, lm = _mixture_terms(u_s, u_t, lse_s, lse_t, beta, one_minus_beta)
        du = tl.where(p_s == 0.0, 0.0, one_minus_beta * p_s * (ls - lm - tl.load(kl_ptr + row)))
    g = tl.load(upstream_ptr + row * upstream_stride).to(tl.float32) * inv_temperature
    dx = du * g
    if S_SOFTCAP:
        dx = dx * (1.0 - tanh_s * tanh_s)
    if HAS_LABELS:
        dx = tl.where(kept, dx, 0.0)
    tl.store(grad_ptr + row * grad_stride + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)


# --- the host side ----------------------------------------------------------------------------------------------


def mode_of(beta):
    """The kernels' MODE for beta: 0 forward KL (beta 0), 1 reverse KL (beta 1), 2 the mixture."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE


@functools.lru_cache(maxsize=256)
def _scalars(options):
    """(MODE, beta, 1 - beta, 1 / T, student softcap, teacher softcap): beta below float32's normal range is passed
    as 0 (the interpreter would type it float64; its share of the loss is below 2**-126 of a term anyway)."""
    beta = float(options.beta)
    mode = mode_of(beta)
    return (
        mode, beta if beta >= FLOAT32_TINY else 0.0, 1.0 - beta, 1.0 / options.temperature,
        float(options.student_softcapping), float(options.teacher_softcapping),
    )  # fmt: skip


def forward_block(vocab, block=None):
    """The forward's tile width at V = vocab (block, or JSD_FORWARD_BLOCK, capped at V rounded up to a power of 2)."""
    return min(JSD_FORWARD_BLOCK if block is None else block, _next_power_of_2(max(vocab, 1)))


def backward_block(vocab, block=None):
    return min(JSD_BACKWARD_BLOCK if block is None else block, _next_power_of_2(max(vocab, 1)))


forward_launcher = Launcher(_jsd_forward_kernel)
backward_launcher = Launcher(_jsd_backward_kernel)


def _rows(tensor):
    """(tensor, its row stride) for a 2-D tensor with unit column stride."""
    if tensor.dim() != 2 or (tensor.stride(1) != 1 and tensor.shape[1] > 1):
        raise ValueError(f"the JSD kernels take 2-D logits with unit column stride, got {tuple(tensor.stride())}")
    return tensor, tensor.stride(0)


def jsd_forward(student, teacher, labels, options, out, block=None):
    """Writes per row into out = (loss, lse_s, lse_t, kl) (four float32 (N,) tensors): the loss of student (N, V_s)
    against the first V_s columns of teacher (N, V_t >= V_s), the two logsumexps of u = softcap(x) / T and the
    backward's row constant. labels: (N,) int tensor or None (every row counts). options: jsd_contract.JsdOptions.
    block: the tile width (default JSD_FORWARD_BLOCK). Returns out."""
    _checked(student)
    n_rows, vocab = student.shape
    if n_rows == 0:
        return out
    mode, beta, one_minus_beta, inv_t, s_cap, t_cap = _scalars(options)
    student, s_stride = _rows(student)
    teacher, t_stride = _rows(teacher)
    block = forward_block(vocab, block)
    loss, lse_s, lse_t, kl = out
    has_labels = labels is not None
    args = (
        student, s_stride, teacher, t_stride, labels if has_labels else loss, loss, lse_s, lse_t, kl, vocab,
        options.ignore_index, beta, one_minus_beta, inv_t, s_cap, t_cap,
        block, mode, has_labels, s_cap > 0.0, t_cap > 0.0,
    )  # fmt: skip
    grid = (n_rows, 1, 1)
    variant = ("jsd_forward", student.device, student.dtype, teacher.dtype, block, mode, has_labels, *args[-2:])
    _launch(forward_launcher, grid, args, JSD_FORWARD_WARPS, variant, student)
    return out


def jsd_backward(upstream, student, teacher, labels, stats, grad, options, block=None):
    """Writes d(sum_rows g_row * loss_row) / d student into grad (N, V_s) (it may be `student` itself) from the
    forward's stats = (lse_s, lse_t, kl); upstream: float32 per row (N,) or 0-d (one g for every row). Returns
    grad."""
    _checked(student)
    n_rows, vocab = student.shape
    if n_rows == 0 or vocab == 0:
        return grad
    mode, beta, one_minus_beta, inv_t, s_cap, t_cap = _scalars(options)
    student, s_stride = _rows(student)
    teacher, t_stride = _rows(teacher)
    grad, g_stride = _rows(grad)
    block = backward_block(vocab, block)
    lse_s, lse_t, kl = stats
    has_labels = labels is not None
    args = (
        student, s_stride, teacher, t_stride, grad, g_stride, labels if has_labels else lse_s, lse_s, lse_t, kl,
        upstream, upstream.stride(0) if upstream.dim() else 0, vocab, options.ignore_index, beta, one_minus_beta,
        inv_t, s_cap, t_cap,
        block, mode, has_labels, s_cap > 0.0, t_cap > 0.0,
    )  # fmt: skip
    grid = (n_rows, _cdiv(vocab, block), 1)
    variant = ("jsd_backward", student.device, student.dtype, teacher.dtype, grad.dtype, block, mode, has_labels)
    _launch(backward_launcher, grid, args, JSD_BACKWARD_WARPS, variant + args[-2:], student)
    return grad


def _launch(launcher, grid, args, warps, variant, tensor):
    with on_device(tensor):
        if not launcher.cached(grid, args, warps):
            _guard_capture(variant, tensor)
            launcher.launch(grid, args, warps)


def new_stats(n_rows, device):
    """Four float32 (N,) buffers for jsd_forward's out (loss, lse_s, lse_t, kl), one allocation."""
    return torch.empty(4, n_rows, dtype=torch.float32, device=device).unbind(0)
