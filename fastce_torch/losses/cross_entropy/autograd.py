"""The cross-entropy's autograd layer: the eager `CrossEntropyFunction` (one forward launch that also reduces
"mean"/"sum" in-kernel, one backward launch; its gradient differentiable again in plain torch) with `apply_function`,
its apply without torch.autograd.Function.apply's per-call host overhead; and the torch.library custom ops that
torch.compile traces instead (opaque to the compiler, with fake implementations for tracing and autograd formulas, so
a compiled graph has no break): the forward op gives per-token losses and lse (the reduction is plain torch the
compiler fuses), the outputs op the extra outputs' statistics too; the backward op is the kernel backward (with the
entropy's gradient in the same pass when asked)."""

import torch

from ...core.custom_ops import op_schema, records_of
from ...core.guards import differentiated_again, gradient_buffer, saved_logits, under_functorch, unwrapped
from ...core.options import VMAP_UNSUPPORTED, Options
from ...core.reference import entropy_gradient, logits_gradient, lse_gradient
from . import launch

__all__ = [
    "OPTIONS_SCHEMA",
    "CrossEntropyFunction",
    "apply_function",
    "backward_op",
    "forward_op",
    "forward_outputs_op",
]


def _differentiable_gradient(grad_output, logits, labels, denominator, options, weight=None):
    """The kernel backward's gradient in plain torch from the saved inputs: the contract's d loss / d logits,
    differentiable again (Hessian-vector products, gradient penalties)."""
    upstream = grad_output.float()
    if denominator.numel():
        upstream = upstream / denominator.reshape(())
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    grad = logits_gradient(upstream.expand(labels.shape), rows, labels, None, options, weight=weight)
    return grad.to(logits.dtype).reshape(logits.shape)


# No gradient for labels, reduction, n_items, inplace_backward, options, layout, extras, weight.
_NO_GRADS = (None,) * 8


def _float32_like(tensor):
    return torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)


class CrossEntropyFunction(torch.autograd.Function):
    """The eager path, reduction included, with the fewest host-side steps: one launch forward, one launch
    backward, and no autograd nodes besides this one (each costs host time per step). Outputs: the loss (it owns
    its storage), lse and the reduction's denominator (both non-differentiable, for the backward); with `extras`
    (the return_* keywords) also the per-row argmax and mean of z (non-differentiable), and lse differentiable when
    the z_loss output is asked."""

    @staticmethod
    def forward(logits, labels, reduction, n_items, inplace_backward, options, layout=None, extras=None, weight=None):
        # layout: launch.row_layout(logits), found by the caller while deciding whether to copy the logits.
        # weight: class weights (V,) or None.
        if extras is None:
            loss, lse, denominator = launch.forward(
                logits, labels, options, reduction, n_items, layout=layout, weight=weight
            )
            return loss, lse, (lse[:0] if denominator is None else denominator)
        # The extra outputs: argmax and the mean of z per row as well; lse is differentiable when the z_loss
        # output is asked (its gradient is that of z_loss * lse^2).
        loss, lse, denominator, argmax, mean_z = launch.forward(
            logits, labels, options, reduction, n_items, layout=layout, outputs=True, weight=weight
        )
        if extras.entropy:  # differentiable lse and mean_z of their own: not two views of one scratch buffer
            lse, mean_z = lse.clone(), mean_z.clone()
        return loss, lse, (lse[:0] if denominator is None else denominator), argmax, mean_z

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, labels, _, _, inplace_backward, options = inputs[:6]
        extras = inputs[7] if len(inputs) > 7 else None
        ctx.weight = inputs[8] if len(inputs) > 8 else None  # no gradient, so not saved as an input to check
        _, lse, denominator, *statistics = output
        ctx.z_grad = extras is not None and bool(extras.z_loss)
        # A differentiable entropy (lse - mean_z): lse and mean_z carry their true derivatives (see backward).
        ctx.entropy_grad = extras is not None and bool(extras.entropy)
        constant = [denominator, *statistics[: 1 if ctx.entropy_grad else 2]]  # argmax; mean_z unless entropy
        ctx.mark_non_differentiable(*constant, *(() if ctx.z_grad or ctx.entropy_grad else (lse,)))
        # The non-differentiable outputs never get a gradient: no zero-filled stand-ins for them.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels, lse, denominator, *statistics[1:] * ctx.entropy_grad)
        if under_functorch() or torch.autograd.forward_ad._current_level >= 0:  # forward mode may ask for jvp
            ctx.save_for_forward(logits, labels, lse, denominator)
        ctx.inplace_backward, ctx.options, ctx.consumed = inplace_backward, options, False
        ctx.needs_extras = extras

    @staticmethod
    def backward(ctx, grad_output, grad_lse, _grad_denominator=None, _grad_argmax=None, grad_mean_z=None):
        saved = saved_logits(ctx)
        saved, mean_z = saved[:4], (saved[4] if len(saved) > 4 else None)
        # The entropy H = lse - mz hands lse an upstream a and mz an upstream b = -g_H: d(a lse + b mz)/dz_j =
        # (a + b) p_j - b p_j (mz - z_j), the lse part with upstream a + b (0 unless the z_loss output is
        # differentiated too: lse has no other differentiable use) and the entropy part with g_H = -b.
        grad_entropy = None if grad_mean_z is None or not ctx.entropy_grad else -grad_mean_z
        if not ctx.z_grad:
            grad_lse = None
        elif grad_lse is not None and grad_mean_z is not None:
            grad_lse = grad_lse + grad_mean_z
        if grad_lse is None and grad_entropy is None:
            if grad_output is None:
                return None, *_NO_GRADS
            return CrossEntropyFunction._loss_backward(ctx, grad_output, saved)
        logits, labels, lse, denominator = saved
        tensors = tuple(t for t in (grad_output, grad_lse, grad_entropy, *saved) if t is not None)
        if not any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors)) and not torch.is_grad_enabled():
            denominator = denominator if denominator.numel() else None
            loss_or_entropy = grad_output is not None or grad_entropy is not None
            if grad_output is None:  # no loss upstream (and no divisor) for the pass that adds the entropy's part
                grad_output, denominator = torch.zeros((), dtype=torch.float32, device=logits.device), None
            entropy = {} if grad_entropy is None else dict(grad_entropy=grad_entropy, mean_z=mean_z)
            if grad_lse is None:  # the loss's and the entropy's parts in one pass, in place when allowed
                grad = gradient_buffer(ctx, logits)
                return launch.backward(
                    grad_output, logits, labels, lse, grad, ctx.options, denominator, weight=ctx.weight, **entropy
                ), *_NO_GRADS
            # With the z_loss output's part: each part in float32, rounded to the logits' dtype once.
            grad = launch.lse_backward(grad_lse, logits, labels, lse, _float32_like(logits), ctx.options)
            if loss_or_entropy:
                grad += launch.backward(
                    grad_output, logits, labels, lse, _float32_like(logits), ctx.options, denominator,
                    weight=ctx.weight, **entropy,
                )  # fmt: skip
            return grad.to(logits.dtype), *_NO_GRADS
        # Differentiated again, or under torch.func: plain torch from the intact logits, before the loss's part may
        # write in place.
        grad = 0
        if grad_lse is not None:
            grad = lse_gradient(grad_lse, logits, labels, ctx.options)
        if grad_entropy is not None:
            grad = grad + entropy_gradient(grad_entropy, logits, labels, ctx.options)
        if grad_output is None:
            return grad, *_NO_GRADS
        return CrossEntropyFunction._loss_backward(ctx, grad_output, saved)[0] + grad, *_NO_GRADS

    @staticmethod
    def _loss_backward(ctx, grad_output, saved):
        tensors = (grad_output, *saved)
        transformed = under_functorch()
        plain = not transformed and not any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors))
        if plain and not torch.is_grad_enabled():  # the first-order path: one kernel launch
            return CrossEntropyFunction._gradient(ctx, *tensors), *_NO_GRADS
        # Decided before anything is written in place: a gradient that is differentiated again is computed in plain
        # torch from the intact logits.
        if differentiated_again(tensors):
            grad_output, logits, labels, _, denominator = tensors
            if not transformed and not plain:
                # The function torch.func.vjp returned, called after the transform: its wrappers are dead, the
                # tracked tensors beneath them are what create_graph differentiates.
                with torch._C._DisableFuncTorch():
                    grad_output, logits, labels, denominator = map(
                        unwrapped, (grad_output, logits, labels, denominator)
                    )
                    grad = _differentiable_gradient(grad_output, logits, labels, denominator, ctx.options, ctx.weight)
                    return grad, *_NO_GRADS
            return _differentiable_gradient(
                grad_output, logits, labels, denominator, ctx.options, ctx.weight
            ), *_NO_GRADS
        if plain:
            return CrossEntropyFunction._gradient(ctx, *tensors), *_NO_GRADS
        # torch.func.grad / vjp run this backward on their wrapped tensors, inside the transform (grad) or after it
        # (the function vjp returns). Differentiated once, the kernel runs on the plain tensors with the transforms
        # switched off (anything allocated under them, Triton's interpreter copies included, would be a wrapper
        # without storage).
        with torch._C._DisableFuncTorch():
            grad = CrossEntropyFunction._gradient(ctx, *map(unwrapped, tensors))
        return grad, *_NO_GRADS

    @staticmethod
    def _gradient(ctx, grad_output, logits, labels, lse, denominator):
        grad = gradient_buffer(ctx, logits)
        denominator = denominator if denominator.numel() else None
        return launch.backward(
            grad_output, logits, labels, lse, grad, ctx.options, denominator=denominator, weight=ctx.weight
        )

    @staticmethod
    def jvp(ctx, logits_tangent, *unused_tangents):
        # Forward mode (torch.func.jvp, jacfwd, hessian): the loss's tangent is <d loss / d logits, tangent>, with
        # that gradient in differentiable plain torch, so transforms around this one differentiate it again.
        logits, labels, _, denominator = ctx.saved_tensors[:4]
        reduced = denominator.numel() > 0
        ones = torch.ones((() if reduced else labels.shape), dtype=torch.float32, device=logits.device)
        grad = _differentiable_gradient(ones, logits, labels, denominator, ctx.options, ctx.weight)
        product = (grad.float() * logits_tangent.float()).reshape(labels.shape[0], -1)
        loss_tangent = product.sum() if reduced else product.sum(-1)
        if ctx.needs_extras is None:
            return loss_tangent, None, None
        lse_tangent = mean_z_tangent = None
        ones = torch.ones(labels.shape, dtype=torch.float32, device=logits.device)

        def tangent(grad):
            return (grad.float() * logits_tangent.float()).reshape(labels.shape[0], -1).sum(-1)

        if ctx.z_grad or ctx.entropy_grad:
            lse_tangent = tangent(lse_gradient(ones, logits, labels, ctx.options))
        if ctx.entropy_grad:  # mz = lse - H
            mean_z_tangent = lse_tangent - tangent(entropy_gradient(ones, logits, labels, ctx.options))
        return loss_tangent, lse_tangent, None, None, mean_z_tangent

    @staticmethod
    def vmap(info, in_dims, *args):
        raise RuntimeError(VMAP_UNSUPPORTED)


def apply_function(function, logits, labels, reduction, n_items, *rest):
    """function.apply(logits, labels, reduction, n_items, *rest) without torch.autograd.Function.apply's per-call
    inspect.signature binding (~15 us of host time, bench/NOTES.md), which only fills in default arguments: every
    argument is passed here, positionally. Under torch.func transforms the full path runs. As Function.apply does, a
    dead torch.func wrapper (left over from a finished transform) is passed as its plain tensor; only logits, labels
    and a tensor n_items can be one (torch's unwrap_dead_wrappers over all the arguments costs ~4 us, this ~0.4)."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(logits, labels, reduction, n_items, *rest)
    if isinstance(n_items, torch.Tensor):
        n_items = _unwrap_if_dead(n_items)
    return super(torch.autograd.Function, function).apply(
        _unwrap_if_dead(logits), _unwrap_if_dead(labels), reduction, n_items, *rest
    )


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


# --- the custom ops torch.compile traces ----------------------------------------------------------------------------

# Each op takes the Options fields, in their order, after its tensors (op_schema spells them out once).
OPTIONS_SCHEMA = op_schema(Options)


@torch.library.custom_op(
    "fastce::cross_entropy_forward",
    mutates_args=(),
    schema=f"(Tensor logits, Tensor labels, {OPTIONS_SCHEMA}, Tensor? weight=None) -> (Tensor, Tensor)",
)
def forward_op(logits, labels, *settings):
    # settings: the Options fields, then the class weights (omitted or None without them).
    options, weight = _options_and_weight(settings)
    loss, lse, _ = launch.forward(logits, labels, options, weight=weight)
    return loss, lse.clone()  # lse is a view of the launch's scratch buffer; an op's output owns its storage


def _options_and_weight(settings):
    """(Options, class weights or None) of a custom op's trailing arguments: the Options fields, then weight (a
    caller may leave it out: the op schema's default)."""
    options, rest = records_of(settings, Options)
    return options, (rest[0] if rest else None)


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
    return launch.backward(
        grad_loss, logits, labels, lse, grad, options, weight=weight, grad_entropy=grad_entropy, mean_z=mean_z
    )


@backward_op.register_fake
def _(grad_loss, logits, labels, lse, *options):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _forward_op_setup_context(ctx, inputs, output):
    logits, labels, *settings = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.options = settings  # the Options fields and the class weights


def _forward_op_backward(ctx, grad_loss, grad_lse):
    # Under the compiler the gradient is a fresh tensor; the compiler plans that memory itself.
    logits, labels, lse = ctx.saved_tensors
    return backward_op(grad_loss, logits, labels, lse, *ctx.options), None, *[None] * (len(Options._fields) + 1)


torch.library.register_autograd(
    "fastce::cross_entropy_forward", _forward_op_backward, setup_context=_forward_op_setup_context
)


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
    loss, lse, _, argmax, mean_z = launch.forward(
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
        grad = grad + lse_gradient(grad_lse, logits, labels, Options(*ctx.options))
    return grad, None, *[None] * (len(Options._fields) + 3)


torch.library.register_autograd(
    "fastce::cross_entropy_forward_outputs", _outputs_backward, setup_context=_outputs_setup_context
)
