"""The fused linear cross-entropy's autograd layer: two autograd Functions for eager calls ("mean"/"sum" with the
gradients computed in the forward; "none", which recomputes each chunk in the backward), the torch.library custom ops
that torch.compile traces instead, and the dispatch between them for an unsharded head."""

from typing import NamedTuple

import torch

from .. import contract, kernels
from ..contract import Options
from . import chunks
from .chunks import (
    Chunking,
    _differentiable_grads,
    autocast_or_common_dtype,
    chunked_backward,
    chunked_forward,
    reduced_in_one_chunk,
)

BACKWARD_TWICE = (
    "fastce_torch.linear_cross_entropy: backward through the same loss twice is not supported (its gradients are "
    "computed in the forward and handed over once); compute the loss again instead of retain_graph=True"
)


class _ReducedFunction(torch.autograd.Function):
    """ "mean"/"sum": the gradients are computed in the forward; backward scales them in place by the upstream
    scalar (nothing else holds them, so the caller's .grad takes them over without a copy)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, denominator, options, chunking, needs, extras=None, class_weight=None,
        reduction=None,
    ):  # fmt: skip
        """denominator: the divisor (1,), or None with reduction = (reduction, n_items) when one chunk holds every
        row (reduced_in_one_chunk: the kernel computes it)."""
        ctx.options, ctx.needs, ctx.extras, ctx.class_weight = options, needs, extras, class_weight
        if extras is not None:
            return _ReducedFunction._forward_outputs(ctx, hidden, weight, bias, labels, denominator, chunking)
        if denominator is None:
            loss, denominator, ctx.grads = reduced_in_one_chunk(
                hidden, weight, bias, labels, options, chunking, needs, *reduction
            )
        else:
            token_losses, _, ctx.grads = chunked_forward(
                hidden, weight, bias, labels, options, chunking, denominator, needs, class_weight=class_weight
            )
            loss = token_losses.sum() / denominator[0]
        # References, no copies: read only by a backward that must be differentiable again.
        ctx.save_for_backward(hidden, weight, bias, labels, denominator)
        return loss

    @staticmethod
    def _forward_outputs(ctx, hidden, weight, bias, labels, denominator, chunking):
        """With the extra outputs: (loss, lse, argmax, mean of z); lse is differentiable for the z_loss output."""
        ctx.kept = chunks._kept_rows(
            labels, ctx.options.ignore_index, chunking
        )  # for a backward recomputing the logits
        token_losses, lse, grads, argmax, mean_z = chunked_forward(
            hidden,
            weight,
            bias,
            labels,
            ctx.options,
            chunking,
            denominator,
            ctx.needs,
            outputs=True,
            kept=ctx.kept,
            class_weight=ctx.class_weight,
        )
        ctx.grads, ctx.chunking = grads, chunking
        ctx.save_for_backward(hidden, weight, bias, labels, denominator, lse)
        ctx.mark_non_differentiable(argmax, mean_z, *(() if ctx.extras.z_loss else (lse,)))
        ctx.set_materialize_grads(False)
        return token_losses.sum() / denominator[0], lse, argmax, mean_z

    @staticmethod
    def backward(ctx, grad_loss, *grad_outputs):
        if ctx.extras is not None:
            return _ReducedFunction._backward_outputs(ctx, grad_loss, grad_outputs[0])
        return (*_ReducedFunction._loss_grads(ctx, grad_loss, ctx.saved_tensors), *(None,) * 8)

    @staticmethod
    def _loss_grads(ctx, grad_loss, saved):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients computed in the forward are constants to autograd; these are not.
            hidden, weight, bias, labels, denominator = saved
            grad_rows = (grad_loss.float() / denominator[0]).expand(labels.shape)
            return _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, ctx.needs, class_weight=ctx.class_weight
            )
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(BACKWARD_TWICE)
        if grad_loss.dtype != torch.float32:
            grad_loss = grad_loss.to(torch.float32)
        for grad in grads:
            if grad is not None:
                kernels.scale_unless_one(grad, grad_loss)
        return grads

    @staticmethod
    def _backward_outputs(ctx, grad_loss, grad_lse):
        """The backward with extra outputs: the loss's gradients (computed in the forward) plus, when the z_loss
        output is differentiated, its part (through lse), recomputing each chunk's logits."""
        *saved, lse = ctx.saved_tensors
        hidden, weight, bias, labels, denominator = saved
        nones = (None,) * 8
        if grad_lse is None or not ctx.extras.z_loss:
            if grad_loss is None:
                return (None,) * 3 + nones
            return (*_ReducedFunction._loss_grads(ctx, grad_loss, saved), *nones)
        if torch.is_grad_enabled():
            grad_rows = None if grad_loss is None else (grad_loss.float() / denominator[0]).expand(labels.shape)
            grads = _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, ctx.needs, grad_lse, ctx.class_weight
            )
            return (*grads, *nones)
        lse_grads = chunked_backward(
            None, hidden, weight, bias, labels, lse, ctx.options, ctx.chunking, ctx.needs, grad_lse.detach(), ctx.kept
        )  # unweighted: grad_lse holds the class weights' factor
        if grad_loss is None:
            ctx.grads = None
            return (*lse_grads, *nones)
        loss_grads = _ReducedFunction._loss_grads(ctx, grad_loss, saved)
        grads = [a if b is None else (b if a is None else a + b) for a, b in zip(loss_grads, lse_grads)]
        return (*grads, *nones)


class _PerTokenFunction(torch.autograd.Function):
    """ "none": the forward keeps lse; the backward recomputes the logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, options, chunking, extras=None, class_weight=None):
        ctx.options, ctx.chunking, ctx.extras, ctx.class_weight = options, chunking, extras, class_weight
        ctx.kept = chunks._kept_rows(labels, options.ignore_index, chunking)  # the backward's chunks are the forward's
        if extras is None:
            token_losses, lse, _ = chunked_forward(
                hidden, weight, bias, labels, options, chunking, kept=ctx.kept, class_weight=class_weight
            )
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            return token_losses
        # With the extra outputs: (losses, lse, argmax, mean of z); lse is differentiable for the z_loss output.
        token_losses, lse, _, argmax, mean_z = chunked_forward(
            hidden, weight, bias, labels, options, chunking, outputs=True, kept=ctx.kept, class_weight=class_weight
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.mark_non_differentiable(argmax, mean_z, *(() if extras.z_loss else (lse,)))
        ctx.set_materialize_grads(False)
        return token_losses, lse, argmax, mean_z

    @staticmethod
    def backward(ctx, grad_losses, *grad_outputs):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_lse = grad_outputs[0] if grad_outputs and ctx.extras.z_loss else None
        if grad_losses is None and grad_lse is None:
            return (None,) * 8
        if torch.is_grad_enabled():  # create_graph=True: a gradient that autograd can differentiate again
            grad_rows = None if grad_losses is None else grad_losses.float()
            grads = _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, needs, grad_lse, ctx.class_weight
            )
            return (*grads, None, None, None, None, None)
        grad_losses = None if grad_losses is None else grad_losses.detach().contiguous()
        grad_lse = None if grad_lse is None else grad_lse.detach()
        grads = chunked_backward(
            grad_losses,
            hidden,
            weight,
            bias,
            labels,
            lse,
            ctx.options,
            ctx.chunking,
            needs,
            grad_lse,
            ctx.kept,
            ctx.class_weight,
        )
        return (*grads, None, None, None, None, None)


# --- custom ops for torch.compile -----------------------------------------------------------------------------
# A custom op cannot return None: gradients that are not needed come back as empty tensors. Each op takes, after its
# tensors, the fields of Options, of Chunking and of _Needs, spelled out once by contract.op_schema.


class _Needs(NamedTuple):
    need_hidden: bool
    need_weight: bool
    need_bias: bool


_SETTINGS = ", ".join(contract.op_schema(record) for record in (Options, Chunking, _Needs))
_N_SETTINGS = len(Options._fields) + len(Chunking._fields) + len(_Needs._fields)


def _settings(settings):
    """(Options, Chunking, needs) from an op's trailing scalars."""
    n_options, n_chunking = len(Options._fields), len(Chunking._fields)
    chunking = Chunking(*settings[n_options : n_options + n_chunking])
    return Options(*settings[:n_options]), chunking, tuple(settings[n_options + n_chunking :])


def _split_class_weight(settings):
    """(the op's trailing scalars, its class weights or None): the ops take `Tensor? class_weight=None` last; a
    trailing tensor or None is that argument (the scalars before it are ints, floats and bools)."""
    if settings and (settings[-1] is None or isinstance(settings[-1], torch.Tensor)):
        return tuple(settings[:-1]), settings[-1]
    return tuple(settings), None


def _or_empty(tensor, like):
    return like.new_empty(0) if tensor is None else tensor


def _fake_grads(hidden, weight, bias, needs):
    """The gradients' shapes and dtypes for the compiler (an empty stand-in where one is not needed)."""
    need_hidden, need_weight, need_bias = needs
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
        hidden.new_empty((weight.shape[0],) if need_bias else (0,), dtype=bias.dtype if need_bias else hidden.dtype),
    )


@torch.library.custom_op(
    "fastce::linear_cross_entropy_reduced",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor denominator, "
    f"{_SETTINGS}, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _reduced_op(hidden, weight, bias, labels, denominator, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings)
    token_losses, _, grads = chunked_forward(
        hidden, weight, bias, labels, options, chunking, denominator, needs, class_weight=class_weight
    )
    loss = token_losses.sum() / denominator[0]
    return (loss, *(_or_empty(grad, hidden) for grad in grads))


@_reduced_op.register_fake
def _(hidden, weight, bias, labels, denominator, *settings):
    needs = _settings(_split_class_weight(settings)[0])[2]
    return (hidden.new_empty((), dtype=torch.float32), *_fake_grads(hidden, weight, bias, needs))


def _reduced_setup_context(ctx, inputs, output):
    ctx.needs = _settings(_split_class_weight(inputs[5:])[0])[2]
    ctx.save_for_backward(*output[1:])


def _reduced_backward(ctx, grad_loss, *unused_grads_of_grads):
    # Out of place under the compiler (it plans that memory itself); eager scales in place.
    # Exact zeros stay zero whatever the factor, as the eager scale kernel keeps them.
    grads = [
        torch.where(g == 0, 0, g * grad_loss.to(g.dtype)) if need else None
        for g, need in zip(ctx.saved_tensors, ctx.needs)
    ]
    return (*grads, None, None, *[None] * (_N_SETTINGS + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_reduced", _reduced_backward, setup_context=_reduced_setup_context
)


@torch.library.custom_op(
    "fastce::linear_cross_entropy_forward",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"{contract.op_schema(Options)}, {contract.op_schema(Chunking)}, Tensor? class_weight=None) -> (Tensor, Tensor)",
)
def _per_token_forward_op(hidden, weight, bias, labels, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, _ = _settings(settings)
    token_losses, lse, _ = chunked_forward(hidden, weight, bias, labels, options, chunking, class_weight=class_weight)
    return token_losses, lse


@_per_token_forward_op.register_fake
def _(hidden, weight, bias, labels, *settings):
    n_rows = hidden.shape[0]
    return hidden.new_empty(n_rows, dtype=torch.float32), hidden.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op(
    "fastce::linear_cross_entropy_backward",
    mutates_args=(),
    schema="(Tensor grad_losses, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor lse, "
    f"{_SETTINGS}, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor)",
)
def _per_token_backward_op(grad_losses, hidden, weight, bias, labels, lse, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings)
    grads = chunked_backward(
        grad_losses.contiguous(), hidden, weight, bias, labels, lse, options, chunking, needs, None, class_weight
    )
    return tuple(_or_empty(grad, hidden) for grad in grads)


@_per_token_backward_op.register_fake
def _(grad_losses, hidden, weight, bias, labels, lse, *settings):
    return _fake_grads(hidden, weight, bias, _settings(_split_class_weight(settings)[0])[2])


def _per_token_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, *settings = inputs
    ctx.settings, ctx.class_weight = _split_class_weight(settings)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])


def _per_token_backward(ctx, grad_losses, unused_grad_lse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    grads = _per_token_backward_op(
        grad_losses, hidden, weight, bias, labels, lse, *ctx.settings, *needs, ctx.class_weight
    )
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads, None, *[None] * (len(ctx.settings) + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_forward", _per_token_backward, setup_context=_per_token_setup_context
)


# With the extra outputs (any return_* keyword) under torch.compile every reduction takes the per-token ops below
# (the reduction in plain torch, the backward recomputing each chunk's logits): one op pair instead of a reduced
# variant of each.
@torch.library.custom_op(
    "fastce::linear_cross_entropy_forward_outputs",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"{contract.op_schema(Options)}, {contract.op_schema(Chunking)}, bool z_grad, Tensor? class_weight=None) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
)
def _outputs_forward_op(hidden, weight, bias, labels, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, _ = _settings(settings[:-1])
    token_losses, lse, _, argmax, mean_z = chunked_forward(
        hidden, weight, bias, labels, options, chunking, outputs=True, class_weight=class_weight
    )
    return token_losses, lse, argmax, mean_z


@_outputs_forward_op.register_fake
def _(hidden, weight, bias, labels, *settings):
    n_rows = hidden.shape[0]
    floats = [hidden.new_empty(n_rows, dtype=torch.float32) for _ in range(3)]
    return floats[0], floats[1], hidden.new_empty(n_rows, dtype=torch.int32), floats[2]


@torch.library.custom_op(
    "fastce::linear_cross_entropy_backward_outputs",
    mutates_args=(),
    schema="(Tensor grad_losses, Tensor grad_lse, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"Tensor lse, {_SETTINGS}, bool z_grad, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor)",
)
def _outputs_backward_op(grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings[:-1])
    grad_lse = grad_lse.contiguous() if settings[-1] else None
    grads = chunked_backward(
        grad_losses.contiguous(), hidden, weight, bias, labels, lse, options, chunking, needs, grad_lse, class_weight
    )
    return tuple(_or_empty(grad, hidden) for grad in grads)


@_outputs_backward_op.register_fake
def _(grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings):
    return _fake_grads(hidden, weight, bias, _settings(_split_class_weight(settings)[0][:-1])[2])


def _outputs_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, *settings = inputs
    ctx.settings, ctx.class_weight = _split_class_weight(settings)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])
    ctx.mark_non_differentiable(output[2], output[3])


def _outputs_backward(ctx, grad_losses, grad_lse, *unused):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    *settings, z_grad = ctx.settings
    if grad_losses is None:
        grad_losses = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse, z_grad = lse, False
    grads = _outputs_backward_op(
        grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings, *needs, z_grad, ctx.class_weight
    )
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads, None, *[None] * (len(ctx.settings) + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_forward_outputs", _outputs_backward, setup_context=_outputs_setup_context
)


def unsharded_outputs(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, class_weight=None
):
    """linear_cross_entropy with extra outputs: CrossEntropyOutput."""
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    vocab = weight.shape[0]
    if not contract.use_kernel(hidden, backend):
        logits = torch.nn.functional.linear(hidden, weight, bias)
        token_losses = contract.reference_token_losses(logits, labels, options, class_weight)
        loss = contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
        return contract.reference_outputs(logits, labels, options, extras, reduction, n_items, loss, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        token_losses, lse, argmax, mean_z = _outputs_forward_op(
            hidden_2d, weight, bias, labels_1d, *options, *chunking, extras.z_loss, class_weight
        )
        loss = contract.reduce_losses(
            token_losses.view(labels.shape), labels, reduction, n_items, ignore_index, class_weight
        )
    elif reduction == "none":
        token_losses, lse, argmax, mean_z = _PerTokenFunction.apply(
            hidden_2d, weight, bias, labels_1d, options, chunking, extras, class_weight
        )
        loss = token_losses.view(labels.shape)
    else:
        needs = gradients_needed(hidden, weight, bias)
        denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
        loss, lse, argmax, mean_z = _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, extras, class_weight
        )
    return contract.extra_outputs(
        loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, class_weight
    )


def gradients_needed(hidden, weight, bias):
    """Which of (hidden, weight, bias) the computation owes a gradient."""
    grad_enabled = torch.is_grad_enabled()
    return (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )


def unsharded_loss(hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight=None):
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    if not contract.use_kernel(hidden, backend):
        token_losses = contract.reference_token_losses(
            torch.nn.functional.linear(hidden, weight, bias), labels, options, class_weight
        )
        return contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        if compiling:
            token_losses = _per_token_forward_op(hidden_2d, weight, bias, labels_1d, *options, *chunking, class_weight)[
                0
            ]
        else:
            token_losses = _PerTokenFunction.apply(
                hidden_2d, weight, bias, labels_1d, options, chunking, None, class_weight
            )
        return token_losses.view(labels.shape)
    needs = gradients_needed(hidden, weight, bias)
    n_rows = hidden_2d.shape[0]
    one_chunk = 0 < n_rows <= chunks.rows_per_chunk(n_rows, weight.shape[0], hidden.element_size(), *chunking[:2])
    if not compiling and one_chunk and class_weight is None and not chunking.skip_ignored_rows:
        return _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, None, options, chunking, needs, None, None, (reduction, n_items)
        )
    denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
    if compiling:
        return _reduced_op(hidden_2d, weight, bias, labels_1d, denominator, *options, *chunking, *needs, class_weight)[
            0
        ]
    return _ReducedFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, None, class_weight
    )
