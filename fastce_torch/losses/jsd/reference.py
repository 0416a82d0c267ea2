"""The JSD's formula in plain torch (the path of float64 students and backend="reference"): per-row losses
differentiable with respect to the student, computed in float32 (float64 for a float64 student), and their
reduction."""

import math

import torch

from ...core.options import compute_dtype

__all__ = ["reduced", "reference_row_losses"]


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
    dtype = compute_dtype(student.dtype)
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


def reduced(row_losses, divisor):
    return row_losses if divisor is None else row_losses.sum() / divisor.to(row_losses.dtype)
