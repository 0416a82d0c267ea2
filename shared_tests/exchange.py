"""Moving tensors between torch and JAX through DLPack, with the known traps handled explicitly.

Facts for jax 0.10.2 (torch 2.13), each pinned by a test in test_dlpack.py so that an upgrade that changes one
shows up as a failure there rather than as silently wrong numbers elsewhere:

* float32 / bfloat16 / float16 / int32 tensors import zero-copy (same buffer; on the CPU only when the buffer is
  64-byte aligned, which fresh torch allocations are; a view at an unaligned offset is copied by jax).
* A tensor with requires_grad=True refuses export (BufferError "Can't export tensors that require gradient"):
  `to_jax` detaches first, which shares the storage, so it costs nothing.
* Rows with a stride larger than V (a view of a wider buffer) are rejected by jax ("Only DLPack tensors with
  trivial (compact) striding are supported"); compact permutations (a transpose) are accepted. fastce_torch reads
  strided rows in place, but for JAX `to_jax` makes the tensor contiguous first: ONE COPY of the logits, the only
  copy in the exchange. A JAX array has no strides, so no zero-copy route exists for such rows.
* int64 is silently truncated to int32 when jax_enable_x64 is off: torch.tensor([2**40]) arrives as 0, a valid
  class, so an out-of-range label (NaN by contract) would turn into a plausible loss. `labels_to_jax` checks the
  range and casts explicitly, raises OverflowError for a value that does not fit, and passes int64 through
  unchanged inside `jax.enable_x64(True)`.
* Arrays come back with `torch.from_dlpack(jax_array)`, zero-copy.
Everything stays on the tensor's device: with CUDA tensors there is no host round trip.
jax is imported where a function needs it, not with this module: the torch-only gloo ranks that import shared
checks (fastce_torch/tests/*_check.py) then start without paying jax's import (seconds a process).
"""

import numpy as np
import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def x64_enabled():
    """Whether JAX keeps 64-bit integers right now (the global flag or an enclosing jax.enable_x64(True))."""
    import jax

    return jax.dtypes.canonicalize_dtype(np.int64) == np.int64


def to_jax(tensor):
    """A torch tensor as a JAX array on the same device: zero-copy for a contiguous, aligned tensor; detached
    first (export refuses tensors that require grad); made contiguous first when its rows are strided (a copy:
    JAX arrays cannot describe strides). int64 tensors must go through `labels_to_jax`."""
    import jax

    if tensor.dtype == torch.int64:
        raise TypeError("int64 tensors must go through labels_to_jax (jax without x64 would truncate them)")
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    try:
        # copy=False makes jax raise instead of copying behind our back where zero-copy was expected.
        return jax.dlpack.from_dlpack(tensor, copy=False)
    except ValueError:
        # The CPU client copies buffers that are not 64-byte aligned (views at odd offsets): allow that copy.
        return jax.dlpack.from_dlpack(tensor)


def labels_to_jax(labels):
    """Integer labels as a JAX array without silent wrapping.

    int32: zero-copy. int64 inside jax.enable_x64(True): zero-copy, int64 kept. int64 otherwise: every value must
    fit int32 (checked on the device: one reduction and one synchronisation), then an explicit cast to int32 (a
    copy of N integers); a value that does not fit raises OverflowError naming it, instead of arriving wrapped.
    """
    import jax

    labels = labels.detach()
    if labels.dtype == torch.int32:
        return to_jax(labels)
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
    labels = labels.contiguous()
    if x64_enabled():
        return jax.dlpack.from_dlpack(labels)
    if labels.numel():
        low, high = torch.aminmax(labels)
        if int(low) < INT32_MIN or int(high) > INT32_MAX:
            flat = labels.reshape(-1)
            bad = int(((flat < INT32_MIN) | (flat > INT32_MAX)).nonzero()[0, 0])
            position = list(torch.unravel_index(torch.tensor(bad), labels.shape))
            raise OverflowError(
                f"labels{[int(i) for i in position]} = {int(flat[bad])} does not fit int32, and jax without x64 "
                f"would silently wrap it (to {int(flat[bad].to(torch.int32))}); run under jax.enable_x64(True) "
                f"or map such labels to ignore_index / an out-of-range int32 value first"
            )
    return to_jax(labels.to(torch.int32))


def to_torch(array):
    """A JAX array as a torch tensor on the same device (zero-copy)."""
    return torch.from_dlpack(array)


def same_buffer(array, tensor):
    """True when the JAX array and the torch tensor are one allocation (the exchange copied nothing)."""
    return array.unsafe_buffer_pointer() == tensor.data_ptr()
