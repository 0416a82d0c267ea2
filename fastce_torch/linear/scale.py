"""The gradients' scaling by the upstream scalar of a reduced loss, on the device: the chunk loops of every linear loss
compute a reduced loss's gradients in the forward, and their backward multiplies them by the loss's upstream gradient
in place (scale_unless_one), with no memory traffic at all when that scalar is exactly 1 (the usual case), which the
host cannot know without a synchronisation."""

import triton
import triton.language as tl

from ..core.kernel_helpers import cdiv
from ..core.launch import Launcher, checked, on_device, register_launchers

__all__ = ["SCALE_BLOCK", "scale_grads", "scale_launcher", "scale_unless_one", "scale_unless_one_kernel"]

SCALE_BLOCK = 4096  # elements per program of scale_unless_one_kernel


@triton.jit
def scale_unless_one_kernel(tensor_ptr, n_elements, factor_ptr, BLOCK: tl.constexpr):
    """tensor_ptr[:n_elements] *= *factor_ptr, and no memory traffic at all when the factor is exactly 1 (the usual
    upstream gradient of a loss), which the host cannot know without a synchronisation. Exact zeros stay zero
    whatever the factor (NaN, inf): an ignored token's gradient is 0, as the backward kernel writes it."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        x = tl.load(tensor_ptr + offsets, mask=in_range)
        scaled = tl.where(x == 0, 0.0, x.to(tl.float32) * factor)
        tl.store(tensor_ptr + offsets, scaled.to(tensor_ptr.dtype.element_ty), mask=in_range)


scale_launcher = Launcher(scale_unless_one_kernel)
register_launchers(__name__, "scale_launcher")


def scale_unless_one(tensor, factor):
    """tensor *= factor (a 0-d float32 device tensor) in place, without a host synchronisation; a factor of
    exactly 1 costs one launch and no memory traffic. tensor must be contiguous."""
    checked(tensor)
    if tensor.numel():
        args = (tensor, tensor.numel(), factor, SCALE_BLOCK)
        grid = (cdiv(tensor.numel(), SCALE_BLOCK), 1, 1)
        with on_device(tensor):
            if not scale_launcher.cached(grid, args):
                scale_launcher.launch(grid, args)
    return tensor


def scale_grads(grads, factor):
    """scale_unless_one of each gradient that is not None (a reduced linear loss's backward)."""
    for grad in grads:
        if grad is not None:
            scale_unless_one(grad, factor)
    return grads
