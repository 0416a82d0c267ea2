"""Autograd guards shared by the autograd Functions (cross_entropy, linear_cross_entropy, the vocab-parallel path):
whether logits may be overwritten by an in-place backward, the error when consumed logits are needed again, and
which torch.func transforms a backward runs under."""

import torch

__all__ = [
    "LOGITS_REUSED",
    "differentiated_again",
    "functorch_transforms",
    "gradient_buffer",
    "is_intermediate",
    "saved_logits",
    "under_functorch",
    "unwrapped",
]

LOGITS_REUSED = (
    "fastce_torch.cross_entropy wrote its gradient into the logits' buffer (inplace_backward=True), and these "
    "logits were needed again: by a second backward through the same loss, by a second loss over the same logits, "
    "or by another op that saved them. Pass inplace_backward=False to keep the logits intact."
)


def is_intermediate(tensor):
    """True when the tensor's storage belongs to the autograd graph alone (not a leaf, not a view of one)."""
    base = tensor if tensor._base is None else tensor._base
    return tensor.requires_grad and not tensor.is_leaf and not base.is_leaf


def saved_logits(ctx):
    """ctx.saved_tensors, or LOGITS_REUSED when an in-place backward already overwrote the logits (a second backward)
    or another op changed them since the forward."""
    if ctx.consumed:
        raise RuntimeError(LOGITS_REUSED)
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if ctx.inplace_backward and "modified by an inplace operation" in str(error):
            raise RuntimeError(LOGITS_REUSED) from error
        raise


def gradient_buffer(ctx, logits):
    """Where the backward writes d loss / d logits: the logits themselves with ctx.inplace_backward, else a new
    tensor."""
    if not ctx.inplace_backward:
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    # The logits are about to hold the gradient: any other op that saved them for its own backward then fails
    # loudly ("modified by an inplace operation") instead of reading gradients as logits.
    torch.autograd.graph.increment_version(logits)
    ctx.consumed = True
    return logits


def functorch_transforms():
    """The torch.func transforms (grad, vjp, jvp, vmap, ...) the current call runs under, outermost first."""
    return [interpreter.key() for interpreter in torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()]


def under_functorch():
    return torch._C._functorch.maybe_current_level() is not None


def unwrapped(tensor):
    """The plain tensor inside torch.func's wrappers (grad/vjp run the backward on them; a kernel needs memory)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def differentiated_again(tensors):
    """Whether the gradient a backward returns will itself be differentiated, so it must be built from
    differentiable torch ops rather than by a kernel (whose output autograd would take for a constant): under
    create_graph=True (grad mode on inside backward) when the saved logits or the upstream gradient are tracked
    beneath the torch.func wrappers, or inside an outer torch.func transform that differentiates again (grad of
    grad, jvp of grad) or batches the cotangent (vmap: jacrev, per-example gradients)."""
    if torch.is_grad_enabled() and any(unwrapped(tensor).requires_grad for tensor in tensors[:2]):
        return True
    if not under_functorch():
        return False
    transforms = functorch_transforms()
    kind = torch._C._functorch.TransformType
    return kind.Vmap in transforms or sum(key in (kind.Grad, kind.Jvp) for key in transforms) > 1
