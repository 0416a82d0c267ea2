"""The options record of every loss and its checks, in JAX terms (CONTRACT.md): Options and Extras (static: part of
the jit and kernel cache keys), the constants (REDUCTIONS, BACKENDS, the dtypes, FLOAT32_TINY), every check of a
plain argument (at trace time: shapes, dtypes and Python values only), the class and token weights as constants,
the reduction's divisor, and where the arrays are: the "auto" backend's rule (placement, on_gpu, route).

The jnp formulas of the contract are core/reference.py's, the output records core/outputs.py's; this module imports
no other module of the package, and every other module may import it.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Options",
    "Extras",
    "NO_EXTRAS",
    "lse_differentiated",
    "REDUCTIONS",
    "BACKENDS",
    "KERNEL_DTYPES",
    "INPUT_DTYPES",
    "FLOAT32_TINY",
    "TRACED",
    "FLOAT_DTYPE_ERROR",
    "LABEL_DTYPE_ERROR",
    "LABEL_SHAPE_ERROR",
    "TRACED_LABELS_ERROR",
    "BAD_LABEL_ERROR",
    "as_array",
    "check_float_array",
    "check_labels",
    "WEIGHT_GRAD_UNSUPPORTED",
    "check_class_weight",
    "constant_weight",
    "constant_weight_fwd",
    "constant_weight_bwd",
    "check_temperature",
    "fold_temperature",
    "label_weights",
    "check_flag",
    "check_index_reduction_backend",
    "check_options",
    "check_extras",
    "check_n_items",
    "ignore_value",
    "validate_labels",
    "loss_divisor",
    "reduce_losses",
    "COMPILED",
    "INTERPRETED",
    "COMPILED_ELSE_REFERENCE",
    "placement",
    "on_gpu",
    "gpu_available",
    "route",
]


class Options(NamedTuple):
    """The loss options, in the contract's order; the same record (fields and order) as fastce_torch's Options."""

    ignore_index: int = -100
    logit_softcapping: float = 0.0
    logit_scaling: float = 0.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0


class Extras(NamedTuple):
    """Which extra outputs a call asked for (static: part of the jit and kernel cache keys). The kernels compute
    the argmax partials only for ``accuracy`` and the entropy partials only for ``entropy``; z_loss and lse come
    from the lse every variant computes."""

    z_loss: bool = False
    lse: bool = False
    accuracy: bool = False
    entropy: bool = False

    def __bool__(self):
        return any(self)


NO_EXTRAS = Extras()


def lse_differentiated(options: Options, returns: Extras) -> bool:
    """Whether the kernels' lse gets a cotangent: a returned z_loss with a nonzero coefficient (its gradient flows
    through lse; with z_loss=0 it is 0 * lse**2, whose gradient is 0)."""
    return returns.z_loss and options.z_loss != 0.0


REDUCTIONS = ("none", "mean", "sum")
BACKENDS = ("auto", "kernel", "reference")
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# float64 is accepted too and computed in float64 by the reference, whatever the backend says.
INPUT_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float64),)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126

# What a tracer raises when asked for its values or devices (public jax.errors, rather than isinstance checks on
# jax.core.Tracer, whose jax.core is shrinking).
TRACED = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)

FLOAT_DTYPE_ERROR = "{name} must be float32, bfloat16, float16 or float64, got {dtype}"
LABEL_DTYPE_ERROR = "labels must be int32 or int64, got {dtype}"
LABEL_SHAPE_ERROR = "labels must have {name}'s leading shape {lead}, got {shape}"
TRACED_LABELS_ERROR = (
    "validate_labels=True needs concrete labels, but labels is traced (jit/vmap/scan); validate outside the "
    "transformation or pass validate_labels=False (bad labels then give a NaN loss)."
)
BAD_LABEL_ERROR = "labels{position} = {label} is outside [0, {vocab}) and is not ignore_index={ignore_index}"


# ----------------------------------------------------------------------------------------------------------------
# Checks (at trace time: shapes, dtypes and Python values only).
# ----------------------------------------------------------------------------------------------------------------


def as_array(x, name: str):
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def check_float_array(x, name: str):
    """x as an array of one of INPUT_DTYPES."""
    x = as_array(x, name)
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(FLOAT_DTYPE_ERROR.format(name=name, dtype=x.dtype))
    return x


def check_labels(labels, leading_shape: tuple, ignore_index: int, name: str = "logits"):
    """labels as an int32/int64 array shaped ``leading_shape`` (that of ``name``); narrower integers widen to int32
    (losslessly), and a host int64 array that JAX would cut to int32 (x64 off) keeps its out-of-range labels out of
    range."""
    labels = as_array(labels, "labels")
    dtype = jnp.dtype(labels.dtype)
    if not jnp.issubdtype(dtype, jnp.integer) or (dtype.itemsize >= 4 and not jnp.issubdtype(dtype, jnp.signedinteger)):
        raise TypeError(LABEL_DTYPE_ERROR.format(dtype=labels.dtype))  # uint32/uint64 do not fit int32
    if tuple(labels.shape) != tuple(leading_shape):
        raise ValueError(LABEL_SHAPE_ERROR.format(name=name, lead=tuple(leading_shape), shape=tuple(labels.shape)))
    if dtype.itemsize < 4:
        labels = labels.astype(jnp.int32)
    return _narrow_host_int64(labels, ignore_index)


WEIGHT_GRAD_UNSUPPORTED = (
    "{}: gradients with respect to {} are not supported by fastce_jax; differentiate with respect to "
    "the other arguments only (or wrap the weights in jax.lax.stop_gradient)"
)


def check_class_weight(weight, vocab: int, name: str = "weight"):
    """Class weights (F.cross_entropy's weight=): None, or a floating-point (V,) array, returned as a float32 (float64
    when given in float64) array that carries no gradient: differentiating with respect to it raises ValueError."""
    if weight is None:
        return None
    weight = as_array(weight, name)
    if not jnp.issubdtype(jnp.dtype(weight.dtype), jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of class weights, got {weight.dtype}")
    if tuple(weight.shape) != (vocab,):
        raise ValueError(f"{name} must have shape ({vocab},) (one weight per class), got {tuple(weight.shape)}")
    if jnp.dtype(weight.dtype) != jnp.float64:
        weight = weight.astype(jnp.float32)
    return constant_weight(weight, name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def constant_weight(weight, name):
    return weight


def constant_weight_fwd(weight, name):
    if weight.perturbed:  # jax.grad / vjp asks for the weights' gradient
        what = "token weights" if name == "token_weights" else "class weights"
        raise ValueError(WEIGHT_GRAD_UNSUPPORTED.format(name, what))
    return weight.value, None


def constant_weight_bwd(name, residuals, g):
    return (None,)


constant_weight.defvjp(constant_weight_fwd, constant_weight_bwd, symbolic_zeros=True)


def check_temperature(temperature) -> float:
    """temperature as a float: a Python int/float > 0 and finite (a bool is a TypeError)."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a Python float > 0, got {temperature!r}")
    value = float(temperature)
    if not np.isfinite(value) or not value > 0.0:
        raise ValueError(f"temperature must be > 0 and finite, got {value}")
    return value


def fold_temperature(options: Options, temperature: float) -> Options:
    """The options with z = softcap(scale * x) / T folded in (exact algebra: softcap_c(s x) / T ==
    softcap_{c/T}((s/T) x)): scaling (or 1) / T and softcap / T (0 stays 0). T == 1 returns options unchanged, so
    the kernels compiled for it are today's."""
    if temperature == 1.0:
        return options
    scaling = (options.logit_scaling or 1.0) / temperature
    softcap = options.logit_softcapping / temperature
    for name, value in (("logit_scaling", scaling), ("logit_softcapping", softcap)):
        if not np.isfinite(value) or (value != 0.0 and abs(value) < FLOAT32_TINY):
            raise ValueError(f"temperature={temperature} makes the effective {name} {value}, outside float32's range")
    return options._replace(logit_scaling=scaling, logit_softcapping=softcap)


def label_weights(labels, weight, vocab: int):
    """w[y] per token (labels' shape), 0 where the label is not a class in [0, V)."""
    has_class = (labels >= 0) & (labels < vocab)
    return jnp.where(has_class, weight[jnp.where(has_class, labels, 0)], jnp.zeros((), weight.dtype))


def _narrow_host_int64(labels, ignore_index: int):
    """Without x64, JAX would cut a NumPy int64 array to int32, silently moving a label like 2**32 + 3 into the
    vocabulary as class 3. Such a label is out of range for every vocabulary, so it becomes INT32_MIN (or
    INT32_MAX when that is the ignore_index): still out of range, so still a NaN loss."""
    if not isinstance(labels, np.ndarray) or labels.dtype.itemsize <= 4 or jax.config.jax_enable_x64:
        return labels
    info = np.iinfo(np.int32)
    wide = (labels < info.min) | (labels > info.max)
    sentinel = info.min if ignore_index != info.min else info.max
    return np.where(wide, sentinel, labels).astype(np.int32)


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


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_index_reduction_backend(ignore_index, reduction, backend):
    """The keywords every loss takes besides its options: ignore_index an int, reduction and backend known names."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_options(
    *, ignore_index, reduction, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend, temperature=1.0
) -> Options:
    """The options as an Options record of Python numbers, the temperature folded into scaling and softcapping
    (fold_temperature); reduction and backend are checked, not stored."""
    check_index_reduction_backend(ignore_index, reduction, backend)
    softcap = _real(logit_softcapping, "logit_softcapping")
    if softcap < 0:
        raise ValueError(f"logit_softcapping must be >= 0, got {softcap}")
    smoothing = _real(label_smoothing, "label_smoothing")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {smoothing}")
    scaling = _real(logit_scaling, "logit_scaling")
    options = Options(int(ignore_index), softcap, scaling, smoothing, _real(z_loss, "z_loss"))
    return fold_temperature(options, check_temperature(temperature))


def check_extras(return_z_loss, return_lse, return_accuracy, return_entropy) -> Extras:
    """The return_* keywords as an Extras record (each must be a bool)."""
    return Extras(
        check_flag(return_z_loss, "return_z_loss"),
        check_flag(return_lse, "return_lse"),
        check_flag(return_accuracy, "return_accuracy"),
        check_flag(return_entropy, "return_entropy"),
    )


def check_n_items(n_items):
    """None, a Python number > 0, or a 0-d numeric array (possibly traced)."""
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


def ignore_value(dtype, ignore_index: int) -> int | None:
    """ignore_index, or None when no label of this dtype can equal it."""
    info = jnp.iinfo(dtype)
    return ignore_index if info.min <= ignore_index <= info.max else None


def validate_labels(labels, vocab: int, ignore_index: int) -> None:
    """Raise ValueError naming the first label neither in [0, vocab) nor ignore_index (concrete labels only)."""
    try:
        y = np.asarray(labels)
    except TRACED as e:
        raise ValueError(TRACED_LABELS_ERROR) from e
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            BAD_LABEL_ERROR.format(position=list(pos), label=int(y[pos]), vocab=vocab, ignore_index=ignore_index)
        )


# ----------------------------------------------------------------------------------------------------------------
# Reductions.
# ----------------------------------------------------------------------------------------------------------------


def loss_divisor(labels, reduction: str, n_items, ignore_index: int, dtype=jnp.float32, weight=None):
    """What the summed loss is divided by ("mean" / "sum"): n_items when given (for both), else 1 for "sum" and the
    number of non-ignored labels for "mean" (at least 1: all ignored gives 0 / 1 = 0); with class weights ("mean")
    the sum of the non-ignored labels' weights (1 where it is exactly 0); None for "none". Traced; no host sync."""
    if reduction == "none":
        return None
    if n_items is not None:
        return jnp.asarray(n_items).astype(dtype)
    if reduction == "sum":
        return jnp.ones((), dtype)
    ign = ignore_value(labels.dtype, ignore_index)
    if weight is not None:
        kept = label_weights(labels, weight, weight.shape[0]).astype(dtype)
        total = jnp.sum(kept if ign is None else jnp.where(labels == ign, 0.0, kept))
        return jnp.where(total == 0.0, 1.0, total).astype(dtype)
    count = labels.size if ign is None else jnp.sum(labels != ign)
    return jnp.maximum(count, 1).astype(dtype)


def reduce_losses(token_losses, labels, reduction: str, n_items, ignore_index: int, weight=None):
    """The reduced loss of per-token losses shaped like labels (or flat); weight: class weights or None."""
    if reduction == "none":
        return token_losses.reshape(labels.shape)
    divisor = loss_divisor(labels, reduction, n_items, ignore_index, token_losses.dtype, weight)
    return jnp.sum(token_losses) / divisor


# ----------------------------------------------------------------------------------------------------------------
# Where the arrays are (the "auto" backend's rule).
# ----------------------------------------------------------------------------------------------------------------

# Where the kernels run: compiled (GPU), interpreted (Pallas interpret=True), or, for backend="auto" under a trace
# in a process with a GPU backend, decided when the computation is lowered (jax.lax.platform_dependent: the compiled
# kernels on cuda/rocm, the reference elsewhere).
COMPILED, INTERPRETED, COMPILED_ELSE_REFERENCE = "compiled", "interpreted", "compiled_else_reference"


def placement(x) -> bool | None:
    """Whether x lives on GPUs; None when x is traced (jit, grad, vmap): where a traced computation runs is only
    known when it is lowered (committed CPU arrays under jit run on the CPU even on a GPU machine)."""
    if isinstance(x, jax.Array):
        try:
            return all(d.platform == "gpu" for d in x.devices())
        except TRACED:
            return None
    return jax.default_backend() == "gpu"  # a NumPy array goes to the default device


def on_gpu(x) -> bool:
    """placement, with a traced x assumed to run on the default backend (linear_cross_entropy's rule)."""
    where = placement(x)
    return jax.default_backend() == "gpu" if where is None else where


def gpu_available() -> bool:
    """Whether this process has a GPU backend at all (if not, nothing can be lowered for one)."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def route(x, backend: str) -> str:
    """The path for logits x: "reference" or one of the kernel modes above (COMPILED, INTERPRETED,
    COMPILED_ELSE_REFERENCE)."""
    if backend == "reference":
        return "reference"
    where = placement(x)
    if where is None and not gpu_available():
        where = False  # traced on a machine without GPUs: it can only run on the CPU (or another non-GPU device)
    if backend == "auto":
        return {True: COMPILED, False: "reference", None: COMPILED_ELSE_REFERENCE}[where]
    # backend="kernel" asks for the kernels: traced in a GPU process, the compiled ones (staging out interpret
    # mode as well would fail where it cannot be traced, e.g. inside shard_map with check_vma=True).
    return INTERPRETED if where is False else COMPILED
