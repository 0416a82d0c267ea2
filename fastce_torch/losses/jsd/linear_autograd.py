"""linear_jsd's autograd layer: two autograd Functions for eager calls ("mean" / "sum" with the gradients computed
in the forward; "none", which recomputes each chunk's logits in the backward) and the torch.library custom ops that
torch.compile traces instead (their plumbing is core/custom_ops.py). The chunk loops they run are linear_chunks.py.

- "mean" / "sum" with a gradient to compute: the backward kernel overwrites the chunk's student logits with
  d loss / d logits (upstream 1 / divisor, a device scalar: no host synchronisation), and d h_s[chunk] = g W_s,
  d W_s += g^T h_s, d b_s += column sums follow at once; the autograd backward only scales them by the upstream
  scalar (as linear_cross_entropy does), so a second backward through the same loss raises.
- "none": the forward keeps lse_s, lse_t and the row constant (3 N floats); the backward recomputes both chunks'
  logits and runs the backward kernel with the per-row upstream (the eager Function hands its forward's kept rows to
  its backward; the custom op finds them again).
"""

import torch
from torch.autograd.function import once_differentiable

from ...core.custom_ops import Needs, fake_grads, op_schema, or_empty, records_of, scaled_grads
from ...linear.engine import Chunking
from ...linear.scale import scale_grads
from .linear_chunks import chunked_backward, chunked_forward, kept_rows_of
from .options import JsdOptions
from .reference import reduced

__all__ = ["BACKWARD_TWICE", "PerRowJsd", "ReducedJsd", "per_row_backward_op", "per_row_forward_op", "reduced_op"]


BACKWARD_TWICE = (
    "fastce_torch.linear_jsd: backward through the same loss twice is not supported (its gradients are computed in "
    "the forward and handed over once); compute the loss again instead of retain_graph=True"
)


class ReducedJsd(torch.autograd.Function):
    """ "mean" / "sum": the gradients are computed in the forward; backward scales them in place by the upstream
    scalar (nothing else holds them) and hands them over once."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, labels, options, divisor, chunking, needs):
        upstream = divisor.reciprocal()
        (loss, *_), ctx.grads = chunked_forward(
            (h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, upstream, needs
        )
        return reduced(loss, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(BACKWARD_TWICE)
        return (*scale_grads(grads, grad_loss.to(torch.float32)), *[None] * 8)


class PerRowJsd(torch.autograd.Function):
    """ "none": the forward keeps the per-row statistics; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, labels, options, chunking):
        ctx.kept = kept_rows_of(labels, options, chunking)  # the backward's chunks are the forward's
        (loss, *stats), _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, kept=ctx.kept)
        ctx.options, ctx.chunking = options, chunking
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[:2], b_s is not None and ctx.needs_input_grad[2])
        grads = chunked_backward(
            grad_rows.to(torch.float32), (h_s, w_s, b_s), (h_t, w_t, b_t), labels, stats, ctx.options,
            ctx.chunking, needs, ctx.kept,
        )  # fmt: skip
        return (*grads, *[None] * 6)


# --- custom ops for torch.compile -----------------------------------------------------------------------------------
# A custom op cannot return None: gradients that are not needed come back as empty tensors.

_HEADS = "Tensor h_s, Tensor w_s, Tensor? b_s, Tensor h_t, Tensor w_t, Tensor? b_t, Tensor? labels"
_SETTINGS = op_schema(JsdOptions, Chunking)
_NEEDS = op_schema(Needs)


def _settings(settings):
    """A custom op's trailing arguments: (options, chunking, the rest: the needs where the op has them)."""
    return records_of(settings, JsdOptions, Chunking)


@torch.library.custom_op(
    "fastce::linear_jsd_reduced",
    mutates_args=(),
    schema=f"({_HEADS}, Tensor divisor, {_SETTINGS}, {_NEEDS}) -> (Tensor, Tensor, Tensor, Tensor)",
)
def reduced_op(h_s, w_s, b_s, h_t, w_t, b_t, labels, divisor, *settings):
    options, chunking, needs = _settings(settings)
    (loss, *_), grads = chunked_forward(
        (h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, divisor.reciprocal(), needs
    )
    return (reduced(loss, divisor), *(or_empty(grad, h_s) for grad in grads))


@reduced_op.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, labels, divisor, *settings):
    return (h_s.new_empty((), dtype=torch.float32), *fake_grads(h_s, w_s, b_s, settings[-3:]))


def _reduced_setup_context(ctx, inputs, output):
    ctx.needs, ctx.n_inputs = inputs[-3:], len(inputs)
    ctx.save_for_backward(*output[1:])


def _reduced_backward(ctx, grad_loss, *unused):
    grads = scaled_grads(ctx.saved_tensors, ctx.needs, grad_loss)
    return (*grads, *[None] * (ctx.n_inputs - 3))


torch.library.register_autograd("fastce::linear_jsd_reduced", _reduced_backward, setup_context=_reduced_setup_context)


@torch.library.custom_op(
    "fastce::linear_jsd_forward",
    mutates_args=(),
    schema=f"({_HEADS}, {_SETTINGS}) -> (Tensor, Tensor, Tensor, Tensor)",
)
def per_row_forward_op(h_s, w_s, b_s, h_t, w_t, b_t, labels, *settings):
    options, chunking, _ = _settings(settings)
    out, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking)
    return tuple(t.clone() for t in out)  # each output owns its storage


@per_row_forward_op.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, labels, *settings):
    return tuple(h_s.new_empty(h_s.shape[0], dtype=torch.float32) for _ in range(4))


@torch.library.custom_op(
    "fastce::linear_jsd_backward",
    mutates_args=(),
    schema=f"(Tensor upstream, {_HEADS}, Tensor lse_s, Tensor lse_t, Tensor kl, {_SETTINGS}, {_NEEDS}) -> "
    "(Tensor, Tensor, Tensor)",
)
def per_row_backward_op(upstream, h_s, w_s, b_s, h_t, w_t, b_t, labels, lse_s, lse_t, kl, *settings):
    options, chunking, needs = _settings(settings)
    # skip_ignored_rows: the kept rows found again (a second synchronisation; an op hands over tensors only).
    grads = chunked_backward(
        upstream.to(torch.float32), (h_s, w_s, b_s), (h_t, w_t, b_t), labels, (lse_s, lse_t, kl), options,
        chunking, needs,
    )  # fmt: skip
    return tuple(or_empty(grad, h_s) for grad in grads)


@per_row_backward_op.register_fake
def _(upstream, h_s, w_s, b_s, h_t, w_t, b_t, labels, lse_s, lse_t, kl, *settings):
    return fake_grads(h_s, w_s, b_s, settings[-3:])


def _per_row_setup_context(ctx, inputs, output):
    ctx.settings = inputs[7:]
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*inputs[:7], *output[1:])


def _per_row_backward(ctx, grad_rows, *unused):
    h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats = ctx.saved_tensors
    needs = (*ctx.needs_input_grad[:2], b_s is not None and ctx.needs_input_grad[2])
    grads = per_row_backward_op(grad_rows, h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats, *ctx.settings, *needs)
    return (*[grad if need else None for grad, need in zip(grads, needs)], *[None] * (4 + len(ctx.settings)))


torch.library.register_autograd("fastce::linear_jsd_forward", _per_row_backward, setup_context=_per_row_setup_context)
