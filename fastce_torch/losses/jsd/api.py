"""Distillation losses between a student's and a teacher's next-token distributions (issue 38): `jsd`, TRL's
generalized Jensen-Shannon divergence, with forward KL (beta = 0) and reverse KL (beta = 1) at its ends.

Eager calls that need a gradient go through `JsdFunction` (the forward's launches, 2 or 3 for the mixture, the
reduction in a few O(N) ops, one backward launch); calls without one run the forward kernels alone and keep
nothing. Under torch.compile the
torch.library custom ops below give the compiler opaque per-row ops (the reduction is plain torch). float64 students
and backend="reference" (or "auto" off CUDA) use `reference_row_losses`, the same formula in plain torch.
The kernels are kernels/jsd_forward.py and kernels/jsd.py (with the launchers); the fused linear version is
linear/jsd.py.
"""

import math

import torch
from torch.autograd.function import once_differentiable

from . import contract, jsd_contract
from .jsd_contract import JsdOptions
from .kernels import jsd as jsd_kernels

JSD_OPTIONS_SCHEMA = contract.op_schema(JsdOptions)


# --- the formula in plain torch -----------------------------------------------------------------------------------


def _softcapped(x, cap):
    return x if cap == 0.0 else cap * torch.tanh(x / cap)


def _weighted_difference(p, a, b):
    """sum_j p_j (a_j - b_j) over the last dimension, 0 where p_j = 0 (a or b may be -inf there); masked before the
    product so that autograd's gradient stays finite too (a NaN p stays NaN)."""
    mass = p != 0
    return (p * (torch.where(mass, a, 0.0) - torch.where(mass, b, 0.0))).sum(-1)


def reference_row_losses(student, teacher, labels, options):
    """Per-row losses (leading shape) in plain torch, differentiable with respect to the student (the teacher is
    detached), computed in float32 (float64 for a float64 student). Ignored rows are zeroed before anything, so NaN
    there reaches neither the loss nor the gradient."""
    dtype = contract.compute_dtype(student.dtype)
    teacher = teacher[..., : student.shape[-1]].detach()
    if labels is not None:
        ignored = (labels == options.ignore_index).unsqueeze(-1)
        student = torch.where(ignored, 0.0, student)
        teacher = torch.where(ignored, 0.0, teacher)
    u_s = _softcapped(student.to(dtype), options.student_softcapping) / options.temperature
    u_t = _softcapped(teacher.to(dtype), options.teacher_softcapping) / options.temperature
    ls, lt = torch.log_softmax(u_s, -1), torch.log_softmax(u_t, -1)
    p_s, p_t = ls.exp(), lt.exp()
    beta = options.beta
    if beta == 0.0:
        loss = _weighted_difference(p_t, lt, ls)
    elif beta == 1.0:
        loss = _weighted_difference(p_s, ls, lt)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        loss = beta * _weighted_difference(p_t, lt, lm) + (1.0 - beta) * _weighted_difference(p_s, ls, lm)
    if labels is not None:
        loss = torch.where(labels == options.ignore_index, 0.0, loss)
    return loss


def row_divisor(labels, n_rows, reduction, ignore_index, device):
    """The reduction's divisor as a 0-d float32 device tensor (no host synchronisation): the counted rows, at least
    1, for "mean"; 1 for "sum"; None for "none"."""
    if reduction == "none":
        return None
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if labels is None:
        return torch.full((), float(max(n_rows, 1)), dtype=torch.float32, device=device)
    return (labels != ignore_index).sum().clamp_min(1).to(torch.float32)


def reduced(row_losses, divisor):
    return row_losses if divisor is None else row_losses.sum() / divisor.to(row_losses.dtype)


# --- the eager autograd Function ----------------------------------------------------------------------------------


def kernel_forward(student, teacher, labels, options):
    """Per-row (loss, lse_s, lse_t, kl) of 2-D logits from the forward kernels."""
    out = jsd_kernels.new_stats(student.shape[0], student.device)
    return jsd_kernels.jsd_forward(student, teacher, labels, options, out)


def kernel_backward(upstream, student, teacher, labels, stats, options):
    """d(sum_rows upstream * loss) / d student (student's dtype) from the forward's (lse_s, lse_t, kl)."""
    grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    return jsd_kernels.jsd_backward(upstream.float(), student, teacher, labels, stats, grad, options)


class JsdFunction(torch.autograd.Function):
    """Eager: the per-row losses from one launch, reduced in plain torch inside the Function (divisor None for
    "none"); the backward is one launch. The teacher is an input only to be read: its gradient is None."""

    @staticmethod
    def forward(ctx, student, teacher, labels, options, divisor):
        loss, *stats = kernel_forward(student, teacher, labels, options)
        ctx.options = options
        ctx.save_for_backward(student, teacher, labels, divisor, *stats)
        return reduced(loss, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        student, teacher, labels, divisor, *stats = ctx.saved_tensors
        upstream = grad_output.float() if divisor is None else grad_output.float() / divisor
        return kernel_backward(upstream, student, teacher, labels, stats, ctx.options), None, None, None, None


# --- the custom ops torch.compile traces ---------------------------------------------------------------------------


@torch.library.custom_op(
    "fastce::jsd_forward",
    mutates_args=(),
    schema=f"(Tensor student, Tensor teacher, Tensor? labels, {JSD_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, "
    "Tensor)",
)
def jsd_forward_op(student, teacher, labels, *options):
    # Each output owns its storage (not four views of one buffer).
    return tuple(t.clone() for t in kernel_forward(student, teacher, labels, JsdOptions(*options)))


@jsd_forward_op.register_fake
def _(student, teacher, labels, *options):
    return tuple(student.new_empty(student.shape[0], dtype=torch.float32) for _ in range(4))


@torch.library.custom_op(
    "fastce::jsd_backward",
    mutates_args=(),
    schema="(Tensor upstream, Tensor student, Tensor teacher, Tensor? labels, Tensor lse_s, Tensor lse_t, Tensor kl, "
    f"{JSD_OPTIONS_SCHEMA}) -> Tensor",
)
def jsd_backward_op(upstream, student, teacher, labels, lse_s, lse_t, kl, *options):
    return kernel_backward(upstream, student, teacher, labels, (lse_s, lse_t, kl), JsdOptions(*options))


@jsd_backward_op.register_fake
def _(upstream, student, teacher, labels, lse_s, lse_t, kl, *options):
    return torch.empty(student.shape, dtype=student.dtype, device=student.device)


def _setup_context(ctx, inputs, output):
    student, teacher, labels, *options = inputs
    ctx.options = options
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(student, teacher, labels, *output[1:])


def _backward(ctx, grad_loss, *unused):
    student, teacher, labels, *stats = ctx.saved_tensors
    grad = jsd_backward_op(grad_loss, student, teacher, labels, *stats, *ctx.options)
    return grad, None, None, *[None] * len(ctx.options)


torch.library.register_autograd("fastce::jsd_forward", _backward, setup_context=_setup_context)


# --- the function -------------------------------------------------------------------------------------------------


def kernel_operands(student, teacher, labels):
    """2-D student (N, V_s) and teacher (N, V_t) rows with unit column stride (views where the layout allows, else
    one copy) and flat contiguous labels (or None); a float64 teacher (the student is not) is read as float32."""
    student = student.reshape(-1, student.shape[-1])
    teacher = teacher.reshape(-1, teacher.shape[-1])
    if student.stride(-1) != 1:
        student = student.contiguous()
    if teacher.dtype not in contract.KERNEL_DTYPES:
        teacher = teacher.to(torch.float32)
    if teacher.stride(-1) != 1:
        teacher = teacher.contiguous()
    return student, teacher, None if labels is None else labels.reshape(-1).contiguous()


def jsd(
    student_logits,
    teacher_logits,
    labels=None,
    *,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
    backend="auto",
):
    """TRL's generalized Jensen-Shannon divergence between the student's and the teacher's distributions per token.

    student_logits (..., V_s), teacher_logits (..., V_t) with the same leading shape, labels (leading shape, int32
    or int64) or None. With u = softcap(x) / temperature (softcap c: c tanh(x / c), 0 = off; each side its own c),
    p_s = softmax(u_s), p_t = softmax(u_t): beta = 0 gives KL(p_t || p_s) (forward KL), beta = 1 KL(p_s || p_t)
    (reverse KL), otherwise beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 - beta) p_s + beta p_t.

    Labels are only a mask: rows whose label is ignore_index count for nothing (loss 0, gradient 0, never read);
    labels=None counts every row. reduction: "mean" over the counted rows (an all-ignored batch gives 0), "sum", or
    "none" (the leading shape). Returns float32 (float64 for a float64 student).

    The teacher is a constant: it gets no gradient, whether or not it requires grad. A teacher vocabulary larger
    than the student's (a padded head) is compared on its first V_s columns, the teacher's softmax taken over those
    columns: exact when the extra columns are -inf (or carry no probability mass); V_t < V_s is an error.
    NaN in a row's logits gives that row a NaN loss and gradient; other rows are unaffected.

    backend: "auto" (the Triton kernels for CUDA tensors, plain torch elsewhere), "kernel" (always the kernels; on the
    CPU Triton's interpreter), "reference" (plain torch). float64 students are computed in float64 in plain torch.
    """
    options = jsd_contract.check_jsd_options(
        beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
    )
    jsd_contract.check_logits(student_logits, teacher_logits)
    jsd_contract.check_jsd_labels(labels, student_logits, "student_logits")
    leading = student_logits.shape[:-1]
    n_rows = leading.numel()
    if not contract.use_kernel(student_logits, backend):
        rows = reference_row_losses(student_logits, teacher_logits, labels, options)
        return reduced(rows, row_divisor(labels, n_rows, reduction, ignore_index, student_logits.device))
    if student_logits.dtype not in contract.KERNEL_DTYPES:
        raise TypeError(contract.KERNEL_DTYPE_REQUIRED.format(student_logits.dtype))
    student, teacher, flat_labels = kernel_operands(student_logits, teacher_logits, labels)
    divisor = row_divisor(flat_labels, n_rows, reduction, ignore_index, student.device)
    if torch.compiler.is_compiling():
        loss = reduced(jsd_forward_op(student, teacher.detach(), flat_labels, *options)[0], divisor)
    elif torch.is_grad_enabled() and student.requires_grad:
        loss = JsdFunction.apply(student, teacher.detach(), flat_labels, options, divisor)
    else:  # nothing to differentiate: the forward kernel alone, nothing kept
        loss = reduced(kernel_forward(student, teacher, flat_labels, options)[0], divisor)
    return loss.view(leading) if divisor is None else loss
