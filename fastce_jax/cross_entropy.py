"""Fused cross-entropy for JAX: argument checks, the pure-jnp reference, the
custom_vjp around the Pallas kernels, and the public ``cross_entropy``.

The loss contract is CONTRACT.md at the repository root.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from fastce_jax import kernels, sharding
from fastce_jax.kernels import Options

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # the kernels' dtypes
# float64 logits are accepted too, and computed in float64 by the reference (see _cross_entropy).
LOGITS_DTYPES = FLOAT_DTYPES + (jnp.dtype(jnp.float64),)
REDUCTIONS = ("none", "sum", "mean")
BACKENDS = ("auto", "kernel", "reference")
# What a tracer raises when asked for its values or devices (public jax.errors,
# rather than isinstance checks on jax.core.Tracer, whose jax.core is shrinking).
_TRACED = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


# ----------------------------------------------------------------------------
# Argument checks (all at trace time: they only look at shapes, dtypes and
# Python values).
# ----------------------------------------------------------------------------


def _as_array(x, name: str):
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value != 0.0 and abs(value) < FLOAT32_TINY:
        raise ValueError(
            f"{name}={value} is below float32's normal range (the kernels compute in float32); use 0 to disable it"
        )
    return value


def _check_n_items(n_items):
    if n_items is None:
        return None
    if isinstance(n_items, bool):
        raise TypeError(f"n_items must be an int or a 0-d array, got {n_items!r}")
    if isinstance(n_items, numbers.Real):
        if not n_items > 0:
            raise ValueError(f"n_items must be > 0, got {n_items}")
        return n_items
    if not hasattr(n_items, "shape") or not hasattr(n_items, "dtype"):
        raise TypeError(f"n_items must be an int or a 0-d array, got {type(n_items).__name__}")
    if tuple(n_items.shape) != ():
        raise ValueError(f"n_items must be 0-d, got shape {tuple(n_items.shape)}")
    if not (jnp.issubdtype(n_items.dtype, jnp.integer) or jnp.issubdtype(n_items.dtype, jnp.floating)):
        raise TypeError(f"n_items must be numeric, got dtype {n_items.dtype}")
    return n_items


def _check_args(
    logits,
    labels,
    *,
    ignore_index,
    reduction,
    n_items,
    logit_softcapping,
    logit_scaling,
    label_smoothing,
    z_loss,
    backend,
    inplace_backward,
    validate_labels,
):
    logits = _as_array(logits, "logits")
    labels = _as_array(labels, "labels")
    if jnp.dtype(logits.dtype) not in LOGITS_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
    if jnp.dtype(labels.dtype).itemsize >= 4 and not jnp.issubdtype(
        labels.dtype, jnp.signedinteger
    ):  # uint32/uint64 do not fit int32
        raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits' leading shape {tuple(logits.shape[:-1])}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    softcap = _real(logit_softcapping, "logit_softcapping")
    if softcap < 0:
        raise ValueError(f"logit_softcapping must be >= 0, got {softcap}")
    smoothing = _real(label_smoothing, "label_smoothing")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {smoothing}")
    scaling = _real(logit_scaling, "logit_scaling")
    z_loss = _real(z_loss, "z_loss")
    for name, flag in (("inplace_backward", inplace_backward), ("validate_labels", validate_labels)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    n_items = _check_n_items(n_items)
    # Narrow integer labels widen losslessly; int32/int64 pass through so that
    # an int64 label beyond 2**31 is never wrapped into the vocabulary.
    if jnp.dtype(labels.dtype).itemsize < 4:
        labels = labels.astype(jnp.int32)
    labels = _narrow_host_int64(labels, int(ignore_index))
    return logits, labels, n_items, int(ignore_index), scaling, softcap, smoothing, z_loss


def _check_shift(shift) -> int:
    """shift as an int: True is 1, False 0; position t of the sequence (labels' last axis) is then scored against
    label t + shift."""
    if not isinstance(shift, numbers.Integral):
        raise TypeError(f"shift must be a non-negative int (True means 1), got {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    return int(shift)


def _shifted_labels(labels, shift: int, ignore_index: int):
    """labels[..., shift:] followed by `shift` ignore_index columns (all ignore_index when shift >= the sequence
    length), and the length of the kept part. The kernels then run on the full, unsliced logits: their last `shift`
    positions are ignored rows (a zero gradient), so the loss equals that of (logits[..., :-shift, :],
    labels[..., shift:]) without slicing the logits (a logits-sized copy, and a padded gradient). O(N) integers."""
    if labels.ndim < 1:
        raise ValueError("shift needs labels with a sequence axis (their last), got 0-d labels")
    if kernels._ignore_index_for(labels, ignore_index) is None:
        raise ValueError(
            f"shift pads the labels with ignore_index ({ignore_index}), which {labels.dtype} labels cannot hold; "
            "pass an ignore_index in int32's range"
        )
    xp = np if isinstance(labels, np.ndarray) else jnp  # host labels stay on the host (validate_labels reads them)
    kept = labels[..., shift:]
    pad = xp.full((*labels.shape[:-1], labels.shape[-1] - kept.shape[-1]), ignore_index, labels.dtype)
    return xp.concatenate((kept, pad), axis=-1), kept.shape[-1]


def _narrow_host_int64(labels, ignore_index: int):
    """Without x64, JAX would cut a NumPy int64 array to int32, silently moving
    a label like 2**32 + 3 into the vocabulary as class 3. Such a label is out
    of range for every vocabulary, so it becomes INT32_MIN (or INT32_MAX when
    that is the ignore_index): still out of range, so still a NaN loss."""
    if not isinstance(labels, np.ndarray) or labels.dtype.itemsize <= 4 or jax.config.jax_enable_x64:
        return labels
    info = np.iinfo(np.int32)
    wide = (labels < info.min) | (labels > info.max)
    sentinel = info.min if ignore_index != info.min else info.max
    return np.where(wide, sentinel, labels).astype(np.int32)


def _validate_labels_eagerly(labels, vocab: int, ignore_index: int):
    try:
        y = np.asarray(labels)
    except _TRACED as e:
        raise ValueError(
            "validate_labels=True needs concrete labels, but labels is traced "
            "(jit/vmap/scan); validate outside the transformation or pass "
            "validate_labels=False (bad labels then give a NaN loss)."
        ) from e
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"labels{list(pos)} = {int(y[pos])} is outside [0, {vocab}) and is not ignore_index={ignore_index}"
        )


def _placement(x) -> bool | None:
    """Whether x lives on GPUs; None when x is traced (jit, grad, vmap): where a traced computation runs is only
    known when it is lowered (committed CPU arrays under jit run on the CPU even on a GPU machine)."""
    if isinstance(x, jax.Array):
        try:
            return all(d.platform == "gpu" for d in x.devices())
        except _TRACED:
            return None
    return jax.default_backend() == "gpu"  # a NumPy array goes to the default device


def _on_gpu(x) -> bool:
    """_placement, with a traced x assumed to run on the default backend (linear_cross_entropy's rule)."""
    on_gpu = _placement(x)
    return jax.default_backend() == "gpu" if on_gpu is None else on_gpu


def _interpret(x) -> bool:
    """Pallas interpret mode wherever the arrays are not on a GPU (linear_cross_entropy's rule)."""
    return not _on_gpu(x)


def _gpu_available() -> bool:
    """Whether this process has a GPU backend at all (if not, nothing can be lowered for one)."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# Where the kernels run: compiled (GPU), interpreted (Pallas interpret=True), or, for backend="auto" under a trace
# in a process with a GPU backend, decided when the computation is lowered (jax.lax.platform_dependent: the compiled
# kernels on cuda/rocm, the reference elsewhere).
COMPILED, INTERPRETED, COMPILED_ELSE_REFERENCE = "compiled", "interpreted", "compiled_else_reference"


def _route(x, backend: str) -> str:
    """The path for logits x: "reference" or one of the kernel modes above."""
    if backend == "reference":
        return "reference"
    on_gpu = _placement(x)
    if on_gpu is None and not _gpu_available():
        on_gpu = False  # traced on a machine without GPUs: it can only run on the CPU (or another non-GPU device)
    if backend == "auto":
        return {True: COMPILED, False: "reference", None: COMPILED_ELSE_REFERENCE}[on_gpu]
    # backend="kernel" asks for the kernels: traced in a GPU process, the compiled ones (staging out interpret
    # mode as well would fail where it cannot be traced, e.g. inside shard_map with check_vma=True).
    return INTERPRETED if on_gpu is False else COMPILED


# ----------------------------------------------------------------------------
# Pure-jnp reference (differentiable by plain autodiff).
# ----------------------------------------------------------------------------


def _compute_dtype(dtype):
    """The dtype the loss is computed and returned in: float64 for float64 logits, float32 for every other dtype."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _reference_token_losses(logits, labels, options: Options):
    """Per-token losses of logits (..., V), labels (...) (no reshape, so any sharding of the leading axes stays
    where it is): float32 math and losses, float64 for float64 logits."""
    vocab = logits.shape[-1]
    in_range = (labels >= 0) & (labels < vocab)
    ign = kernels._ignore_index_for(labels, options.ignore_index)
    ignored = (labels == ign) if ign is not None else jnp.zeros_like(in_range)
    # Zero ignored rows *before* any math, so their gradient is exactly 0 even
    # when the row holds NaN/inf (0 * NaN would otherwise leak through).
    x = jnp.where(ignored[..., None], jnp.zeros((), logits.dtype), logits)
    z = kernels._transform(x.astype(_compute_dtype(x.dtype)), options.logit_scaling, options.logit_softcapping)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    # Same convention as the kernels: shift an all -inf row by 0; +inf gives NaN.
    m = jnp.where(m == -jnp.inf, 0.0, m)
    lse = m[..., 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    loss = jnp.zeros_like(lse)
    if options.label_smoothing != 1.0:
        y_safe = jnp.where(in_range, labels, 0).astype(jnp.int32)
        z_y = jnp.take_along_axis(z, y_safe[..., None], axis=-1)[..., 0]
        loss = loss + (1.0 - options.label_smoothing) * (lse - z_y)
    if options.label_smoothing != 0.0:
        loss = loss + options.label_smoothing * (lse - jnp.mean(z, axis=-1))
    if options.z_loss != 0.0:
        loss = loss + options.z_loss * lse * lse
    # Multiply (not where) so an out-of-range row's gradient is NaN too.
    loss = loss * jnp.where(in_range, 1.0, jnp.nan)
    return jnp.where(ignored, 0.0, loss)


# ----------------------------------------------------------------------------
# custom_vjp around the kernels.
# ----------------------------------------------------------------------------


# The launchers, each with a jvp rule that is the jvp of the reference: first derivatives go through the custom_vjp
# below and run the kernels; differentiating *through* a launcher (only higher-order autodiff does: grad of grad,
# jax.hessian, jvp of grad) gets the reference's exact derivative instead of failing inside Pallas.
@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _forward(logits, labels, options: Options, interpret: bool):
    return sharding.forward(logits, labels, options, interpret=interpret)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _backward(logits, labels, lse, g, options: Options, inplace: bool, interpret: bool):
    return sharding.backward(logits, labels, lse, g, options, inplace=inplace, interpret=interpret)


def _reference_forward(logits, labels, options: Options):
    # The reference backward recomputes from the logits; the lse slot only keeps both branches' outputs alike.
    loss = _reference_token_losses(logits, labels, options)
    return loss, jnp.zeros_like(loss)


def _reference_backward(logits, labels, g, options: Options):
    _, vjp = jax.vjp(lambda x: _reference_token_losses(x, labels, options), logits)
    return vjp(g.astype(jnp.float32))[0]


def _forward_jvp(options, interpret, primals, tangents):
    logits, labels = primals
    loss, lse = _forward(logits, labels, options, interpret)
    _, loss_dot = jax.jvp(lambda x: _reference_token_losses(x, labels, options), (logits,), (tangents[0],))
    # lse is read only by _backward, whose rule recomputes it from the logits (their tangent carries its change).
    return (loss, lse), (loss_dot, jnp.zeros_like(lse))


def _backward_jvp(options, inplace, interpret, primals, tangents):
    logits, labels, lse, g = primals
    dlogits = _backward(logits, labels, lse, g, options, inplace, interpret)
    # lse is a function of the logits: the reference backward recomputes it, so lse's own tangent is not added.
    _, dlogits_dot = jax.jvp(
        lambda x, w: _reference_backward(x, labels, w, options), (logits, g), (tangents[0], tangents[3])
    )
    return dlogits, dlogits_dot


_forward.defjvp(_forward_jvp)
_backward.defjvp(_backward_jvp)


def _route_forward(logits, labels, options: Options, mode: str):
    if mode in (COMPILED, INTERPRETED):
        return _forward(logits, labels, options, mode == INTERPRETED)

    def compiled(x, y):
        return _forward(x, y, options, False)

    def elsewhere(x, y):
        return _reference_forward(x, y, options)

    return jax.lax.platform_dependent(logits, labels, cuda=compiled, rocm=compiled, default=elsewhere)


def _route_backward(logits, labels, lse, g, options: Options, inplace: bool, mode: str):
    if mode in (COMPILED, INTERPRETED):
        return _backward(logits, labels, lse, g, options, inplace, mode == INTERPRETED)

    def compiled(x, y, lse, g):
        return _backward(x, y, lse, g, options, inplace, False)

    def elsewhere(x, y, lse, g):
        return _reference_backward(x, y, g, options)

    return jax.lax.platform_dependent(logits, labels, lse, g, cuda=compiled, rocm=compiled, default=elsewhere)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _kernel_token_losses(logits, labels, options: Options, inplace: bool, mode: str):
    return _kernel_fwd(logits, labels, options, inplace, mode)[0]


def _kernel_fwd(logits, labels, options: Options, inplace: bool, mode: str):
    # logits (..., V) and labels (...) keep their shape here so that a sharding
    # of any leading axis reaches sharding.py without a reshape across devices.
    loss, lse = _route_forward(logits, labels, options, mode)
    # Residuals: only what the backward reads.  logits stays in its own dtype
    # (no float32 copy); lse is N floats.
    return loss, (logits, labels, lse)


def _kernel_bwd(options: Options, inplace: bool, mode: str, residuals, g):
    logits, labels, lse = residuals
    # g is the per-token upstream factor: 1/denominator (broadcast) for
    # "mean", 1 for "sum", the caller's cotangent for "none".
    dlogits = _route_backward(logits, labels, lse, g, options, inplace, mode)
    return dlogits, None


_kernel_token_losses.defvjp(_kernel_fwd, _kernel_bwd)


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def _reduce(losses, labels, reduction: str, n_items, ignore_index: int):
    if reduction == "none":
        return losses.reshape(labels.shape)
    total = jnp.sum(losses)
    if n_items is not None:  # overrides the denominator of "mean" and "sum" alike
        return total / jnp.asarray(n_items).astype(losses.dtype)
    if reduction == "sum":
        return total
    ign = kernels._ignore_index_for(labels, ignore_index)
    count = labels.size if ign is None else jnp.sum(labels != ign)
    # Every token ignored: 0 / 1 = 0, and the kernels zero those rows' gradient.
    return total / jnp.maximum(count, 1).astype(losses.dtype)


def _cross_entropy(logits, labels, kwargs):
    (logits, labels, n_items, ignore_index, scaling, softcap, smoothing, z_loss) = _check_args(logits, labels, **kwargs)
    vocab = logits.shape[-1]
    if kwargs["validate_labels"]:
        _validate_labels_eagerly(labels, vocab, ignore_index)
    route = _route(logits, kwargs["backend"])
    options = Options(ignore_index, softcap, scaling, smoothing, z_loss)
    logits = jnp.asarray(logits)
    if logits.dtype == jnp.float64:
        # The kernels compute in float32: float64 logits (which exist only with x64 on; without it jnp.asarray made
        # them float32 above) go to the reference, computed in float64, whatever the backend says.
        route = "reference"
    if route != "reference" and labels.size > 0:
        inplace = bool(kwargs["inplace_backward"])
        losses = _kernel_token_losses(logits, jnp.asarray(labels), options, inplace, route)
    else:  # "reference", or no tokens at all (an empty grid has no kernel)
        losses = _reference_token_losses(jnp.asarray(logits), jnp.asarray(labels), options)
    return _reduce(losses, jnp.asarray(labels), kwargs["reduction"], n_items, ignore_index)


def cross_entropy(
    logits,
    labels,
    *,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    inplace_backward=True,
    validate_labels=False,
    shift=0,
):
    """Cross-entropy of ``logits`` (..., V) against integer ``labels`` (...).

    Per token, with z the (scaled, softcapped) logits and lse = logsumexp(z):
    ``(1 - eps)(lse - z_y) + eps (lse - mean(z)) + z_loss * lse**2``; see
    CONTRACT.md for every rule (ignore_index, NaN for out-of-range labels,
    -inf logits, reductions, n_items).

    Args:
      logits: float32/bfloat16/float16 array (..., V); float64 (with x64 on) is computed in float64 by the
        jnp reference whatever ``backend`` says (a float64 loss and gradient).
      labels: int32/int64 array shaped like ``logits.shape[:-1]``.
      ignore_index: label value whose tokens get loss 0 and gradient 0.
      reduction: "mean" (over non-ignored tokens, or over ``n_items``), "sum"
        or "none" (per-token losses shaped like ``labels``).
      n_items: optional denominator for "mean" and "sum": a Python number > 0 or a 0-d
        (possibly traced) array, e.g. transformers' ``num_items_in_batch``.
      logit_softcapping: t > 0 applies ``z = t * tanh(z / t)`` (Gemma 2).
      logit_scaling: s != 0 applies ``z = s * z`` first (Cohere).
      label_smoothing: eps in [0, 1].
      z_loss: coefficient of ``lse**2``.
      backend: "auto" (kernels for GPU arrays, the jnp reference elsewhere),
        "kernel" (Pallas kernels always; interpret mode off GPU) or "reference".
        Under jit/grad/vmap in a process with a GPU backend, "auto" decides
        when the computation is lowered, by the platform it runs on
        (``jax.lax.platform_dependent``); "kernel" there means the compiled
        kernels.  Reverse mode runs the kernels; derivatives of those
        derivatives (grad of grad, jax.hessian, jvp of grad) are the
        reference's, exact. Forward mode on the loss itself (jax.jvp,
        jax.linearize, jax.jacfwd) raises JAX's TypeError for a custom_vjp
        function: use backend="reference" for it.
      inplace_backward: let the backward kernel's output alias the logits
        residual (``input_output_aliases``); XLA reuses that buffer when the
        logits are dead after the backward (e.g. computed inside the same jit),
        and otherwise inserts a copy.  False never aliases.
      validate_labels: eagerly raise ValueError naming the first label that is
        neither in [0, V) nor ``ignore_index``.  Needs concrete labels: under
        jit/vmap it raises ValueError instead of validating.
      shift: k >= 0 (True = 1) scores position t against label t + k along labels' last (sequence) axis: the
        loss of ``cross_entropy(logits[..., :-k, :], labels[..., k:])`` ("none": shaped like ``labels[..., k:]``)
        without slicing the logits; the kernels run on the full logits with the last k positions ignored. k >= the
        sequence length leaves no token (as the slice does).

    Returns:
      float32 loss (scalar, or shaped like ``labels`` for reduction="none"); float64 for float64 logits.
      Its gradient w.r.t. logits has logits' dtype.
    """
    kwargs = dict(
        ignore_index=ignore_index,
        reduction=reduction,
        n_items=n_items,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
        inplace_backward=inplace_backward,
        validate_labels=validate_labels,
    )
    if shift := _check_shift(shift):
        labels = _check_args(logits, labels, **kwargs)[1]
        labels, kept = _shifted_labels(labels, shift, int(ignore_index))
        loss = _cross_entropy(logits, labels, kwargs)
        return loss[..., :kept] if reduction == "none" else loss
    return _cross_entropy(logits, labels, kwargs)


def cross_entropy_reference(logits, labels, **options):
    """Pure-jnp ``cross_entropy``: the same keywords (``backend`` is ignored),
    differentiable by plain autodiff; float32 math (float64 for float64 logits),
    so it materialises (N, V) float32 values."""
    return cross_entropy(logits, labels, **dict(options, backend="reference"))
