"""The JSD's autograd layer: eager calls that need a gradient go through `JsdFunction` (the forward's launches, 2 or 3
for the mixture, the reduction in a few O(N) ops, one backward launch); under torch.compile the torch.library
custom ops below give the compiler opaque per-row ops (the reduction is plain torch). `kernel_forward` and
`kernel_backward` are the two kernel passes on 2-D rows (launch.py launches them)."""

import torch
from torch.autograd.function import once_differentiable

from ...core.custom_ops import op_schema
from . import launch
from .options import JsdOptions
from .reference import reduced

__all__ = [
    "JSD_OPTIONS_SCHEMA",
    "JsdFunction",
    "jsd_backward_op",
    "jsd_forward_op",
    "kernel_backward",
    "kernel_forward",
]

JSD_OPTIONS_SCHEMA = op_schema(JsdOptions)


def kernel_forward(student, teacher, labels, options):
    """Per-row (loss, lse_s, lse_t, kl) of 2-D logits from the forward kernels."""
    out = launch.new_stats(student.shape[0], student.device)
    return launch.jsd_forward(student, teacher, labels, options, out)


def kernel_backward(upstream, student, teacher, labels, stats, options):
    """d(sum_rows upstream * loss) / d student (student's dtype) from the forward's (lse_s, lse_t, kl)."""
    grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    return launch.jsd_backward(upstream.float(), student, teacher, labels, stats, grad, options)


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
