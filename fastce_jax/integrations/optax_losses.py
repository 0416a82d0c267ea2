"""optax's integer-label cross-entropy on fastce's kernels: a drop-in for
``optax.softmax_cross_entropy_with_integer_labels(logits, labels, axis=-1, where=None)`` (optax 0.2.8's semantics),
the function every JAX training library calls for the LM loss.

    from fastce_jax import softmax_cross_entropy_with_integer_labels
    losses = softmax_cross_entropy_with_integer_labels(logits, labels)      # per example, as optax
    loss = losses.sum() / mask.sum()  # or fastce_jax.cross_entropy(logits, labels, where=mask): the masked mean

What is optax's, and what differs:
- Per-example losses shaped like labels: ``logsumexp(logits) - logits[label]`` along ``axis`` (an int, or a tuple
  of axes flattened into one class axis, a label then being a flat index into that slice, as optax does).
- Labels in [-V, 0) count from the end (optax's take_along_axis wraps them); a label >= V or < -V gives NaN (optax
  gives NaN there too: its gather fills out-of-bounds reads with NaN), never an out-of-bounds read.
- ``where`` shaped like labels: False examples give 0 (and no gradient). ``where`` shaped like logits (per class):
  the logsumexp runs over the kept classes only, the label's logit is read whether kept or not (optax's formula),
  and an example with no kept class gives 0.
- The result is float32 (float64 for float64 logits), whatever the logits' dtype: optax returns the logits' dtype
  (bfloat16 logits give bfloat16 losses there); the kernels compute in float32 and keep it.
- Reverse mode (jax.grad, vjp) runs the kernels; forward mode (jax.jvp, jax.jacfwd) raises JAX's TypeError for a
  custom_vjp function on the kernel path (backend="reference" supports it), CONTRACT.md.

Costs: classes on the last axis (axis=-1, the LM case) go to the kernels as they are; another axis is one
transposed copy of the logits first (the kernels read a row of classes contiguously), and a per-class ``where`` one
masked copy (-inf on the left-out classes). A per-example ``where`` is folded into the labels (O(N)).
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from ..core.options import as_array, check_float_array, check_labels
from ..losses.cross_entropy.api import cross_entropy

__all__ = ["softmax_cross_entropy_with_integer_labels"]


def _class_axes(axis, ndim: int) -> tuple:
    """axis (an int or a tuple of ints) as a tuple of non-negative axes of an ndim array."""
    is_int = lambda a: isinstance(a, numbers.Integral) and not isinstance(a, bool)  # noqa: E731
    axes = (axis,) if is_int(axis) else axis
    if not isinstance(axes, tuple) or not all(is_int(a) for a in axes):
        raise ValueError(f"axis must be an int or a tuple of ints, got {axis!r}")
    if not axes or any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axis {axis!r} is out of range for logits with {ndim} dimensions")
    canonical = tuple(int(a) % ndim for a in axes)
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"axis {axis!r} repeats an axis")
    return canonical


def _classes_last(array, class_axes: tuple):
    """array with the class axes moved last (in the order given) and flattened into one; the others in order."""
    batch_axes = tuple(a for a in range(array.ndim) if a not in class_axes)
    if class_axes == (array.ndim - 1,):
        return array
    moved = jnp.transpose(array, batch_axes + class_axes)
    return moved.reshape(moved.shape[: len(batch_axes)] + (-1,))


def _checked_labels(labels, batch_shape: tuple, vocab: int):
    """labels as int32 / int64 shaped batch_shape, [-V, 0) wrapped to [0, V) as optax's gather does; labels that
    are out of range stay out of range (a NaN loss), unsigned ones included."""
    labels = as_array(labels, "labels")
    dtype = jnp.dtype(labels.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"labels must be an integer array, got {labels.dtype}")
    if tuple(labels.shape) != tuple(batch_shape):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits' shape without axis {batch_shape}")
    if not jnp.issubdtype(dtype, jnp.signedinteger):  # uint: anything >= V is out of range alike
        labels = jnp.minimum(jnp.asarray(labels), vocab).astype(jnp.int32)
    # A NumPy int64 label beyond int32 (x64 off) becomes INT32_MAX (out of range) rather than wrapping into range.
    labels = jnp.asarray(check_labels(labels, batch_shape, int(np.iinfo(np.int32).min)))
    return jnp.where(labels < 0, labels + vocab, labels)


def _checked_where(where, shape: tuple, what: str):
    where = as_array(where, "where")
    if jnp.dtype(where.dtype) != jnp.bool_:
        raise TypeError(f"where must be a bool array, got {where.dtype}")
    try:
        return jnp.broadcast_to(jnp.asarray(where), shape)
    except ValueError as e:
        raise ValueError(f"where shape {tuple(where.shape)} does not fit {what} {shape}") from e


def _per_class_where(logits, labels, kept, ignore: int, backend: str):
    """optax's per-class mask: lse over the kept classes minus the label's logit, 0 where no class is kept. The
    kernels score a kept class k instead (the label itself when kept, else the first kept one: the same lse) and
    the difference logits[k] - logits[label] is added in jnp (O(N) gathers)."""
    vocab = logits.shape[-1]
    any_kept = jnp.any(kept, axis=-1)
    in_range = (labels >= 0) & (labels < vocab)
    safe = jnp.where(in_range, labels, 0)[..., None]
    label_kept = in_range & jnp.take_along_axis(kept, safe, axis=-1)[..., 0]
    scored = jnp.where(label_kept, labels, jnp.argmax(kept, axis=-1).astype(labels.dtype))
    masked = jnp.where(kept, logits, jnp.asarray(-jnp.inf, logits.dtype))
    losses = cross_entropy(
        masked, jnp.where(any_kept, scored, ignore), reduction="none", ignore_index=ignore, backend=backend
    )
    z = logits.astype(losses.dtype)
    z_label = jnp.where(in_range, jnp.take_along_axis(z, safe, axis=-1)[..., 0], jnp.nan)
    z_scored = jnp.take_along_axis(z, scored[..., None], axis=-1)[..., 0]
    return losses + jnp.where(any_kept & ~label_kept, z_scored - z_label, 0.0)


def softmax_cross_entropy_with_integer_labels(logits, labels, axis=-1, where=None, *, backend="auto"):
    """optax.softmax_cross_entropy_with_integer_labels on fastce's kernels (the module docstring says what
    differs: a float32 result, no forward mode on the kernel path).

    Args:
      logits: float32 / bfloat16 / float16 / float64 array of unnormalised log-probabilities.
      labels: integer array shaped like logits without ``axis``; a label in [-V, 0) counts from the end, one
        >= V or < -V gives NaN.
      axis: the class axis (an int), or a tuple of axes flattened into one class axis.
      where: None; a bool array shaped like labels (False examples give 0, no gradient); or one shaped like
        (broadcastable to) logits: the classes left out of the softmax, 0 for an example with none kept.
      backend: fastce_jax.cross_entropy's ("auto": the kernels for GPU arrays, the jnp reference elsewhere).

    Returns:
      Per-example losses shaped like labels, float32 (float64 for float64 logits).
    """
    logits = check_float_array(logits, "logits")
    if logits.ndim < 1:
        raise ValueError("logits must have at least one (class) axis, got a 0-d array")
    class_axes = _class_axes(axis, logits.ndim)
    per_class = where is not None and jnp.ndim(where) == logits.ndim
    kept = None
    if per_class:
        kept = _classes_last(_checked_where(where, logits.shape, "logits' shape"), class_axes)
    logits = _classes_last(jnp.asarray(logits), class_axes)
    labels = _checked_labels(labels, logits.shape[:-1], logits.shape[-1])
    ignore = int(jnp.iinfo(labels.dtype).min)  # no wrapped label is this (a label >= -V after wrapping, V >= 1)
    if per_class:
        return _per_class_where(logits, labels, kept, ignore, backend)
    if where is not None:
        labels = jnp.where(_checked_where(where, labels.shape, "labels' shape"), labels, ignore)
    return cross_entropy(logits, labels, reduction="none", ignore_index=ignore, backend=backend)
