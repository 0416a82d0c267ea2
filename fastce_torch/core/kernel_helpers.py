"""The @triton.jit helpers that more than one kernel module uses (the cross-entropy and JSD row kernels, the
vocab-parallel combine kernels): tanh (the soft-capping's), the logit transform (scaling, then soft-capping) and the
row offset of a (batch, row) layout; and the host's integer helpers of every launcher (cdiv, next_power_of_2)."""

import triton
import triton.language as tl

__all__ = ["cdiv", "next_power_of_2", "row_offset", "tanh", "transform"]


@triton.jit
def tanh(x):
    # libdevice's tanh is not available in Triton's interpreter; this form is exact enough and never overflows.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def transform(x, scaling, softcap, HAS_SCALING: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """x -> z in float32: optional scaling (Cohere), then optional soft-capping (Gemma 2)."""
    z = x.to(tl.float32)
    if HAS_SCALING:
        z = z * scaling
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def row_offset(row, batch_stride, row_stride, rows_per_batch):
    """Element offset of flat row `row` in a (batch, rows_per_batch, V) view with arbitrary batch and row strides
    (a 2-D (N, V) tensor is one batch), so strided 3-D logits such as logits[:, :-1] need no copy. int64."""
    return (row // rows_per_batch) * batch_stride + (row % rows_per_batch) * row_stride


# Plain integer helpers: triton.cdiv / next_power_of_2 go through Triton's jit dispatch (~10 us each on the host).
def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 << max(n - 1, 0).bit_length()
