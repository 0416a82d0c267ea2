"""The backward kernel of `jsd` / `linear_jsd`, grid (N, cdiv(V_s, BLOCK)): d(upstream * loss) / d student logits of
BLOCK columns from the row's statistics (the forward's lse_s, lse_t and row constant kl), into a given buffer, which
may be the student logits themselves (each tile is read before it is written, by the same program). In base 2 as the
forward kernels (forward.py), whose helpers it shares. Rows whose label is ignore_index are never read: gradient 0.
"""

import triton
import triton.language as tl

from .forward import LN2, LOG2E_IN_KERNEL, mixture_log2, scaled_logits

__all__ = ["jsd_backward_kernel"]


@triton.jit
def jsd_backward_kernel(
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
    (1 - beta) p_s (ls - lm - kl) (MODE 2), 0 where p_s = 0; then / T and through the student's soft-capping. In base 2
    as the forward (u2 = u log2(e), exp2 and the mixture's one log per element: mixture_log2), the log-ratios times
    ln 2 once, in the row's factor. grad_ptr, grad_stride: where it goes (may be student_ptr). The other arguments
    are the forward's (lse_s, lse_t, kl in natural units)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < V
    load_mask = in_row
    if HAS_LABELS:
        kept = tl.load(labels_ptr + row) != ignore_index
        # `!= 0` makes the mask a bool payload in Triton's interpreter (which splats a scalar to int64); a no-op
        # compiled.
        load_mask = (in_row & kept) != 0
    scale = inv_temperature * LOG2E_IN_KERNEL
    u_s, tanh_s = scaled_logits(student_ptr + row * student_stride, cols, load_mask, in_row, s_softcap, scale,
                                 S_SOFTCAP)  # fmt: skip
    u_t, _ = scaled_logits(teacher_ptr + row * teacher_stride, cols, load_mask, in_row, t_softcap, scale,
                            T_SOFTCAP)  # fmt: skip
    ls = u_s - tl.load(lse_s_ptr + row) * LOG2E_IN_KERNEL
    lt = u_t - tl.load(lse_t_ptr + row) * LOG2E_IN_KERNEL
    g = tl.load(upstream_ptr + row * upstream_stride).to(tl.float32) * inv_temperature
    if MODE == 0:
        du = tl.exp2(ls) - tl.exp2(lt)
    elif MODE == 1:
        p_s = tl.exp2(ls)
        du = tl.where(p_s == 0.0, 0.0, p_s * (ls - lt - tl.load(kl_ptr + row) * LOG2E_IN_KERNEL))
        g = g * LN2
    else:
        p_s, _, lm = mixture_log2(ls, lt, beta, one_minus_beta)
        du = tl.where(p_s == 0.0, 0.0, p_s * (ls - lm - tl.load(kl_ptr + row) * LOG2E_IN_KERNEL))
        g = g * (one_minus_beta * LN2)
    dx = du * g
    if S_SOFTCAP:
        dx = dx * (1.0 - tanh_s * tanh_s)
    if HAS_LABELS:
        dx = tl.where(kept, dx, 0.0)
    tl.store(grad_ptr + row * grad_stride + cols, dx.to(grad_ptr.dtype.element_ty), mask=in_row)
