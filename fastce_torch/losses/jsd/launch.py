"""The host side of the distillation kernels of `jsd` / `linear_jsd`: their tuned settings and launchers.

Per row, with u = softcap(x) / T for the student (its first V_s columns) and the teacher (its first V_s columns),
ls = log softmax(u_s), lt = log softmax(u_t) (TRL's generalized JSD):
  MODE 0 (beta == 0): loss = sum_j p_t (lt - ls)                      (forward KL)
  MODE 1 (beta == 1): loss = sum_j p_s (ls - lt)                      (reverse KL)
  MODE 2 (mixture):   lm = log((1 - beta) p_s + beta p_t),
                      loss = beta sum_j p_t (lt - lm) + (1 - beta) sum_j p_s (ls - lm)
Terms whose weight p is 0 contribute 0 (never 0 * inf); the tests are `p == 0`, so that a NaN p (a NaN row) stays
NaN in the loss and in every element of the gradient.

The forward kernels (forward.py) split each row into S segments of whole tiles, S from N and V (forward_segments):
grid (N, S) pass-1 partials, for the mixture a grid (N, S) pass 2, then a grid (N,) finish that merges a row's
partials into loss, lse_s, lse_t and the gradient's row constant kl (the loss for MODE 1, sum p_s (ls - lm) for
MODE 2, 0 for MODE 0). The endpoints read each row once, the mixture twice.
The backward kernel (backward.py), grid (N, cdiv(V_s, BLOCK)): d(upstream * loss) / d student logits of BLOCK
columns from the row's statistics, into a given buffer (which may be the student logits themselves).
Rows whose label is ignore_index are never read: loss and statistics 0, gradient 0. The teacher gets no gradient.
"""

import functools

import torch

from ...core.kernel_helpers import cdiv, next_power_of_2
from ...core.launch import Launcher, checked, launch_guarded, register_launchers
from ...core.options import FLOAT32_TINY
from .backward import jsd_backward_kernel
from .forward import LOG2E, PARTIAL_SLOTS, jsd_finish_kernel, jsd_mixture_kernel, jsd_partials_kernel

__all__ = [
    "FORWARD_KL",
    "JSD_BACKWARD_BLOCK",
    "JSD_BACKWARD_WARPS",
    "JSD_FINISH_WARPS",
    "JSD_FORWARD_BLOCK",
    "JSD_FORWARD_PROGRAMS",
    "JSD_FORWARD_WARPS",
    "MIXTURE",
    "REVERSE_KL",
    "backward_block",
    "backward_launcher",
    "finish_launcher",
    "forward_block",
    "forward_segments",
    "jsd_backward",
    "jsd_forward",
    "mixture_launcher",
    "mode_of",
    "new_stats",
    "partials_launcher",
]

# The forward: 4096 columns per iteration with 8 warps (16 float32 per thread per live tile; pass 1 holds about 7
# such tiles), each row split into segments so that a chunk of a few hundred rows still fills the GPU (one program
# per row left 384-row chunks at 2.0 TB/s for beta 0 on the H200, bench/NOTES.md 2026-12-04). The backward's grid
# also splits rows into tiles (elementwise given the row statistics), 4096 columns with 8 warps. Not tuned yet.
JSD_FORWARD_BLOCK, JSD_FORWARD_WARPS = 4096, 8
# Programs the forward aims for: 4 waves of 132 SMs (the H200's) x 4 resident programs per SM (8 warps of 64
# registers each, ptxas's count for the partials and mixture kernels: 4 x 16384 fill the register file). Fewer rows
# than this get split into more segments (forward_segments).
JSD_FORWARD_PROGRAMS = 4 * 132 * 4
JSD_FINISH_WARPS = 1
JSD_BACKWARD_BLOCK, JSD_BACKWARD_WARPS = 4096, 8
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


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
    return min(JSD_FORWARD_BLOCK if block is None else block, next_power_of_2(max(vocab, 1)))


def backward_block(vocab, block=None):
    return min(JSD_BACKWARD_BLOCK if block is None else block, next_power_of_2(max(vocab, 1)))


partials_launcher = Launcher(jsd_partials_kernel)
mixture_launcher = Launcher(jsd_mixture_kernel)
finish_launcher = Launcher(jsd_finish_kernel)
backward_launcher = Launcher(jsd_backward_kernel)
register_launchers(__name__, "partials_launcher", "mixture_launcher", "finish_launcher", "backward_launcher")


def _rows(tensor):
    """(tensor, its row stride) for a 2-D tensor with unit column stride."""
    if tensor.dim() != 2 or (tensor.stride(1) != 1 and tensor.shape[1] > 1):
        raise ValueError(f"the JSD kernels take 2-D logits with unit column stride, got {tuple(tensor.stride())}")
    return tensor, tensor.stride(0)


def forward_segments(n_rows, vocab, block):
    """(S, segment width) of the forward at N = n_rows, V = vocab, tile width block: a row's tiles are split into S
    segments of equal whole tiles (the last one ragged) so that N * S programs reach JSD_FORWARD_PROGRAMS when N
    alone does not (a linear_jsd chunk of a few hundred rows), never more segments than tiles; S = 1 from
    JSD_FORWARD_PROGRAMS rows on. S depends on N: a row's float32 rounding (not its value) depends on its batch."""
    tiles = max(cdiv(vocab, block), 1)
    wanted = min(max(cdiv(JSD_FORWARD_PROGRAMS, n_rows), 1), tiles)
    width = cdiv(tiles, wanted) * block
    return max(cdiv(vocab, width), 1), width


def jsd_forward(student, teacher, labels, options, out, block=None):
    """Writes per row into out = (loss, lse_s, lse_t, kl) (four float32 (N,) tensors): the loss of student (N, V_s)
    against the first V_s columns of teacher (N, V_t >= V_s), the two logsumexps of u = softcap(x) / T and the
    backward's row constant. labels: (N,) int tensor or None (every row counts). options: JsdOptions (options.py).
    block: the tile width (default JSD_FORWARD_BLOCK). The segments' partials live in a scratch of
    N * S * (5 or 6) floats: at most 24 bytes per row from JSD_FORWARD_PROGRAMS rows on (S = 1), under 100 KiB
    below. Returns out."""
    checked(student)
    n_rows, vocab = student.shape
    if n_rows == 0:
        return out
    mode, beta, one_minus_beta, inv_t, s_cap, t_cap = _scalars(options)
    student, s_stride = _rows(student)
    teacher, t_stride = _rows(teacher)
    block = forward_block(vocab, block)
    segments, width = forward_segments(n_rows, vocab, block)
    segments_block = next_power_of_2(max(cdiv(vocab, block), 1))  # V alone decides: one compiled variant per V
    partials = torch.empty(n_rows, PARTIAL_SLOTS[mode], segments, dtype=torch.float32, device=student.device)
    has_labels = labels is not None
    labels = labels if has_labels else partials
    flags = (has_labels, s_cap > 0.0, t_cap > 0.0)
    rows = (student, s_stride, teacher, t_stride, labels, partials, vocab, width, options.ignore_index)
    grid = (n_rows, segments, 1)
    caps = (LOG2E * inv_t, s_cap, t_cap)
    common = ("jsd", student.device, student.dtype, teacher.dtype, block, *flags)
    launch_guarded(
        partials_launcher, grid, (*rows, *caps, block, mode, *flags), common + (mode,), student, JSD_FORWARD_WARPS
    )
    if mode == MIXTURE:
        args = (*rows, beta, one_minus_beta, *caps, block, segments_block, *flags)
        launch_guarded(mixture_launcher, grid, args, common + (segments_block,), student, JSD_FORWARD_WARPS)
    args = (labels, partials, *out, segments, options.ignore_index, beta, one_minus_beta, segments_block, mode,
            has_labels)  # fmt: skip
    variant = ("jsd_finish", student.device, segments_block, mode, has_labels)
    launch_guarded(finish_launcher, (n_rows, 1, 1), args, variant, student, JSD_FINISH_WARPS)
    return out


def jsd_backward(upstream, student, teacher, labels, stats, grad, options, block=None):
    """Writes d(sum_rows g_row * loss_row) / d student into grad (N, V_s) (it may be `student` itself) from the
    forward's stats = (lse_s, lse_t, kl); upstream: float32 per row (N,) or 0-d (one g for every row). Returns
    grad."""
    checked(student)
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
    grid = (n_rows, cdiv(vocab, block), 1)
    variant = ("jsd_backward", student.device, student.dtype, teacher.dtype, grad.dtype, block, mode, has_labels)
    launch_guarded(backward_launcher, grid, args, variant + args[-2:], student, JSD_BACKWARD_WARPS)
    return grad


def new_stats(n_rows, device):
    """Four float32 (N,) buffers for jsd_forward's out (loss, lse_s, lse_t, kl), one allocation."""
    return torch.empty(4, n_rows, dtype=torch.float32, device=device).unbind(0)
