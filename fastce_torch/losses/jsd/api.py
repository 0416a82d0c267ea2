"""Distillation losses between a student's and a teacher's next-token distributions: `jsd`, TRL's generalized
Jensen-Shannon divergence, with forward KL (beta = 0) and reverse KL (beta = 1) at its ends.

Calls that need a gradient go through autograd.py (JsdFunction eagerly, the custom ops under torch.compile); calls
without one run the forward kernels alone and keep nothing. float64 students and backend="reference" (or "auto" off
CUDA) use reference.py's `reference_row_losses`, the same formula in plain torch. The kernels are forward.py and
backward.py, launched by launch.py; the fused linear version is linear_api.py.
"""

import torch

from ...core.options import KERNEL_DTYPE_REQUIRED, KERNEL_DTYPES, use_kernel
from .autograd import JsdFunction, jsd_forward_op, kernel_forward
from .options import check_jsd_labels, check_jsd_options, check_logits, row_divisor
from .reference import reduced, reference_row_losses

__all__ = ["jsd", "kernel_operands"]


def kernel_operands(student, teacher, labels):
    """2-D student (N, V_s) and teacher (N, V_t) rows with unit column stride (views where the layout allows, else
    one copy) and flat contiguous labels (or None); a float64 teacher (the student is not) is read as float32."""
    student = student.reshape(-1, student.shape[-1])
    teacher = teacher.reshape(-1, teacher.shape[-1])
    if student.stride(-1) != 1:
        student = student.contiguous()
    if teacher.dtype not in KERNEL_DTYPES:
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
    options = check_jsd_options(
        beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
    )
    check_logits(student_logits, teacher_logits)
    check_jsd_labels(labels, student_logits, "student_logits")
    leading = student_logits.shape[:-1]
    n_rows = leading.numel()
    if not use_kernel(student_logits, backend):
        rows = reference_row_losses(student_logits, teacher_logits, labels, options)
        return reduced(rows, row_divisor(labels, n_rows, reduction, ignore_index, student_logits.device))
    if student_logits.dtype not in KERNEL_DTYPES:
        raise TypeError(KERNEL_DTYPE_REQUIRED.format(student_logits.dtype))
    student, teacher, flat_labels = kernel_operands(student_logits, teacher_logits, labels)
    divisor = row_divisor(flat_labels, n_rows, reduction, ignore_index, student.device)
    if torch.compiler.is_compiling():
        loss = reduced(jsd_forward_op(student, teacher.detach(), flat_labels, *options)[0], divisor)
    elif torch.is_grad_enabled() and student.requires_grad:
        loss = JsdFunction.apply(student, teacher.detach(), flat_labels, options, divisor)
    else:  # nothing to differentiate: the forward kernel alone, nothing kept
        loss = reduced(kernel_forward(student, teacher, flat_labels, options)[0], divisor)
    return loss.view(leading) if divisor is None else loss
