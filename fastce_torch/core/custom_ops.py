"""The torch.library custom ops of cross_entropy under torch.compile: opaque to the compiler, with fake
implementations for tracing and autograd formulas, so a compiled graph has no break (cross_entropy.py calls them
while compiling). The forward op gives per-token losses and lse (the reduction is plain torch the compiler fuses),
the outputs op the extra outputs' statistics too; the backward op is the kernel backward (with the entropy's
gradient in the same pass when asked)."""

import torch

from . import contract, kernels
from .contract import Options

# Each op takes the Options fields, in their order, after its tensors (contract.op_schema spells them out once).
OPTIONS_SCHEMA = contract.op_schema(Options)


@torch.library.custom_op(
    "fastce::cross_entropy_forward",
    mutates_args=(),
    schema=f"(Tensor logits, Tensor labels, {OPTIONS_SCHEMA}, Tensor? weight=None) -> (Tensor, Tensor)",
)
def forward_op(logits, labels, *settings):
    # settings: the Options fields, then the class weights (omitted or None without them).
    options, weight = _options_and_weight(settings)
    loss, lse, _ = kernels.forward(logits, labels, options, weight=weight)
    return loss, lse.clone()  # lse is a view of the launch's scratch buffer; an op's output owns its storage


def _options_and_weight(settings):
    """(Options, class weights or None) of a custom op's trailing arguments: the Options fields, then weight (a
    caller may leave it out: the op schema's default)."""
    count = len(Options._fields)
    return Options(*settings[:count]), (settings[count] if len(settings) > count else None)


@forward_op.register_fake
def _(logits, labels, *options):
    n_rows = labels.shape[0]
    return logits.new_empty(n_rows, dtype=torch.float32), logits.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op(
    "fastce::cross_entropy_backward",
    mutates_args=(),
    schema=f"(Tensor grad_loss, Tensor logits, Tensor labels, Tensor lse, {OPTIONS_SCHEMA}, Tensor? weight=None, "
    "Tensor? grad_entropy=None, Tensor? mean_z=None) -> Tensor",
)
def backward_op(grad_loss, logits, labels, lse, *settings):
    # settings: the Options fields, then the class weights, the entropy's upstream and mz per row (each may be
    # omitted or None).
    options, weight = _options_and_weight(settings[: len(Options._fields) + 1])
    grad_entropy, mean_z = (tuple(settings[len(Options._fields) + 1 :]) + (None, None))[:2]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return kernels.backward(
        grad_loss, logits, labels, lse, grad, options, weight=weight, grad_entropy=grad_entropy, mean_z=mean_z
    )


@backward_op.register_fake
def _(grad_loss, logits, labels, lse, *options):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output):
    logits, labels, *settings = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.options = settings  # the Options fields and the class weights


def _backward(ctx, grad_loss, grad_lse):
    # Under the compiler the gradient is a fresh tensor; the compiler plans that memory itself.
    logits, labels, lse = ctx.saved_tensors
    return backward_op(grad_loss, logits, labels, lse, *ctx.options), None, *[None] * (len(Options._fields) + 1)


torch.library.register_autograd("fastce::cross_entropy_forward", _backward, setup_context=_setup_context)


@torch.library.custom_op(
    "fastce::cross_entropy_forward_outputs",
    mutates_args=(),
    schema=f"(Tensor logits, Tensor labels, {OPTIONS_SCHEMA}, bool z_grad, Tensor? weight=None, "
    "bool entropy_grad=False) -> (Tensor, Tensor, Tensor, Tensor)",
)
def forward_outputs_op(logits, labels, *settings):
    """The forward with the extra outputs' statistics: (losses, lse, argmax, mean of z) per row. z_grad: lse is
    differentiated (the z_loss output asked). weight: class weights or None. entropy_grad: the entropy output is
    asked, so mean_z carries its gradient (the entropy is lse - mean_z)."""
    count = len(Options._fields)
    weight = settings[count + 1] if len(settings) > count + 1 else None
    loss, lse, _, argmax, mean_z = kernels.forward(
        logits, labels, Options(*settings[:count]), outputs=True, weight=weight
    )
    return loss, lse.clone(), argmax.clone(), mean_z.clone()  # views of the launch's scratch buffer


@forward_outputs_op.register_fake
def _(logits, labels, *settings):
    n_rows = labels.shape[0]
    floats = [logits.new_empty(n_rows, dtype=torch.float32) for _ in range(3)]
    return floats[0], floats[1], logits.new_empty(n_rows, dtype=torch.int32), floats[2]


def _outputs_setup_context(ctx, inputs, output):
    logits, labels, *settings = inputs
    count = len(Options._fields)
    ctx.options, ctx.z_grad = settings[:count], settings[count]
    ctx.weight = settings[count + 1] if len(settings) > count + 1 else None
    ctx.entropy_grad = bool(settings[count + 2]) if len(settings) > count + 2 else False
    ctx.mark_non_differentiable(output[2], *(() if ctx.entropy_grad else (output[3],)))
    ctx.save_for_backward(logits, labels, output[1], *output[3:] * ctx.entropy_grad)
    ctx.set_materialize_grads(False)  # an entropy returned but not differentiated costs nothing in the backward


def _outputs_backward(ctx, grad_loss, grad_lse, _grad_argmax=None, grad_mean_z=None):
    logits, labels, lse, *mean_z = ctx.saved_tensors
    # As CrossEntropyFunction.backward: mz's upstream b is -g_H, and the lse part's upstream is a + b.
    grad_entropy = None if grad_mean_z is None or not ctx.entropy_grad else -grad_mean_z
    if grad_lse is not None and grad_mean_z is not None:
        grad_lse = grad_lse + grad_mean_z
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    entropy = () if grad_entropy is None else (grad_entropy, mean_z[0])
    grad = backward_op(grad_loss, logits, labels, lse, *ctx.options, ctx.weight, *entropy)
    if ctx.z_grad and grad_lse is not None:  # the z_loss output's part, in plain torch for the compiler to fuse
        grad = grad + contract.lse_gradient(grad_lse, logits, labels, Options(*ctx.options))
    return grad, None, *[None] * (len(Options._fields) + 3)


torch.library.register_autograd(
    "fastce::cross_entropy_forward_outputs", _outputs_backward, setup_context=_outputs_setup_context
)
