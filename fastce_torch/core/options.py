"""The options every loss shares and every check of an argument, in plain torch: the Options record (and Extras, the
return_* keywords), the constants (BACKENDS, REDUCTIONS, the dtypes, FLOAT32_TINY / FLOAT32_MAX), the error
messages shared word for word with fastce_jax, the reduction's divisor (loss_divisor) and the routing helpers
(use_kernel, compute_dtype, is_dtensor). The contract's formulas are reference.py; the output records outputs.py."""

import math
import sys
from typing import NamedTuple

import torch

__all__ = [
    "BACKENDS",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "FLOAT_DTYPE_ERROR",
    "INPUT_DTYPES",
    "KERNEL_DTYPES",
    "KERNEL_DTYPE_REQUIRED",
    "LABEL_DTYPES",
    "LABEL_DTYPE_ERROR",
    "LABEL_SHAPE_ERROR",
    "REDUCTIONS",
    "VMAP_UNSUPPORTED",
    "WEIGHT_GRAD_UNSUPPORTED",
    "Extras",
    "Options",
    "check_class_weight",
    "check_extras",
    "check_labels",
    "check_n_items",
    "check_options",
    "check_temperature",
    "checked_options",
    "compute_dtype",
    "dtype_name",
    "is_dtensor",
    "label_weights",
    "loss_divisor",
    "use_kernel",
    "validate_labels",
    "with_temperature",
]


class Options(NamedTuple):
    """The loss options, in the contract's order; the same record (fields and order) as fastce_jax's Options."""

    ignore_index: int = -100
    logit_softcapping: float = 0.0
    logit_scaling: float = 0.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0


REDUCTIONS = ("none", "mean", "sum")
BACKENDS = ("auto", "kernel", "reference")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INPUT_DTYPES = (*KERNEL_DTYPES, torch.float64)  # float64 is computed in float64 by plain torch
LABEL_DTYPES = (torch.int32, torch.int64)
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: options between 0 and this are refused
FLOAT32_MAX = torch.finfo(torch.float32).max

VMAP_UNSUPPORTED = (
    "fastce_torch.cross_entropy's kernels have no torch.func.vmap rule: a vmapped batch is only more rows, so "
    "flatten it into the rows instead (logits.reshape(-1, V), labels.reshape(-1), reduction='none', then reduce "
    "per example), or use backend='reference'"
)
KERNEL_DTYPE_REQUIRED = "logits must be float32, bfloat16, float16 or float64, got {}"
# The messages shared word for word with fastce_jax's contract.
FLOAT_DTYPE_ERROR = "{name} must be float32, bfloat16, float16 or float64, got {dtype}"
LABEL_DTYPE_ERROR = "labels must be int32 or int64, got {dtype}"
LABEL_SHAPE_ERROR = "labels must have {name}'s leading shape {lead}, got {shape}"


class Extras(NamedTuple):
    """Which extra outputs a call asks for (the return_* keywords), in CrossEntropyOutput's order."""

    z_loss: bool = False
    lse: bool = False
    accuracy: bool = False
    entropy: bool = False


# --- argument checks on plain values -----------------------------------------------------------------------------


def _is_finite(value):
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) dynamo cannot trace math.isfinite (a graph
    # break, an error with fullgraph=True), while float comparisons fold to constants. NaN fails both.
    return -math.inf < value < math.inf


def dtype_name(tensor):
    """A tensor's dtype as fastce_jax's messages name it ("float32", not "torch.float32"); another value's type."""
    if isinstance(tensor, torch.Tensor):
        return str(tensor.dtype).removeprefix("torch.")
    return type(tensor).__name__


def check_labels(labels, name, shape, device):
    """labels must be int32/int64 with the leading shape of `name`'s `shape` (its last dimension is V) on `device`."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in LABEL_DTYPES:
        raise TypeError(LABEL_DTYPE_ERROR.format(dtype=dtype_name(labels)))
    if len(shape) < 1 or tuple(labels.shape) != tuple(shape[:-1]):
        raise ValueError(LABEL_SHAPE_ERROR.format(name=name, lead=tuple(shape[:-1]), shape=tuple(labels.shape)))
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but {name} on {device}")


def check_n_items(n_items):
    if isinstance(n_items, bool) or not (n_items is None or isinstance(n_items, (int, float, torch.Tensor))):
        raise TypeError(f"n_items must be a number or a 0-d tensor, got {n_items!r}")
    if isinstance(n_items, torch.Tensor) and n_items.dim() != 0:
        raise ValueError(f"n_items must be 0-d, got shape {tuple(n_items.shape)}")
    if isinstance(n_items, (int, float)) and not n_items > 0:
        raise ValueError(f"n_items must be positive, got {n_items}")


def check_options(ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend):
    """Checks the keywords every loss takes and returns the loss options as Options (floats as floats)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_n_items(n_items)
    if not _is_finite(logit_softcapping) or logit_softcapping < 0:
        raise ValueError(f"logit_softcapping must be >= 0 (0 disables it), got {logit_softcapping}")
    if not _is_finite(logit_scaling):
        raise ValueError(f"logit_scaling must be finite (0 disables it), got {logit_scaling}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not _is_finite(z_loss):
        raise ValueError(f"z_loss must be finite, got {z_loss}")
    options = Options(
        ignore_index, float(logit_softcapping), float(logit_scaling), float(label_smoothing), float(z_loss)
    )
    for name in Options._fields[1:]:
        value = getattr(options, name)
        if value != 0.0 and abs(value) < FLOAT32_TINY:
            raise ValueError(
                f"{name}={value} is below float32's normal range (the kernels compute in float32); use 0 to disable it"
            )
    return options


# Options already checked, for calls with plain keyword values (exact int / float / str types, no n_items): the
# checks are a pure function of those values, and values equal under == give the same Options (-0.0 and 0.0, or 1
# and 1.0, only differ where every kernel treats them alike). Bounded: past its size, calls just check again. Not
# used while torch.compile traces.
_OPTIONS_CACHE = {}
_OPTIONS_CACHE_SIZE = 64
_PLAIN_TYPES = frozenset((int, float))


def checked_options(
    ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
):
    """check_options through a small cache of the Options already checked (cross_entropy's per-call checks)."""
    key = (ignore_index, reduction, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend)
    plain = (
        n_items is None
        and not torch.compiler.is_compiling()  # no dict side effects for dynamo to trace
        and type(ignore_index) is int
        and type(reduction) is str
        and type(backend) is str
        and type(logit_softcapping) in _PLAIN_TYPES
        and type(logit_scaling) in _PLAIN_TYPES
        and type(label_smoothing) in _PLAIN_TYPES
        and type(z_loss) in _PLAIN_TYPES
    )
    if plain:
        options = _OPTIONS_CACHE.get(key)
        if options is not None:
            return options
    options = check_options(
        ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
    )
    if plain and len(_OPTIONS_CACHE) < _OPTIONS_CACHE_SIZE:
        _OPTIONS_CACHE[key] = options
    return options


def check_extras(return_z_loss, return_lse, return_accuracy, return_entropy):
    """The return_* keywords as Extras; each must be a bool."""
    extras = Extras(return_z_loss, return_lse, return_accuracy, return_entropy)
    for name, value in zip(Extras._fields, extras):
        if not isinstance(value, bool):
            raise TypeError(f"return_{name} must be a bool, got {value!r}")
    return extras


WEIGHT_GRAD_UNSUPPORTED = (
    "{} requires grad: gradients with respect to class weights are not supported by fastce; pass a tensor "
    "without requires_grad (e.g. weight.detach())"
)


def check_class_weight(weight, vocab, device, name="weight"):
    """Class weights (F.cross_entropy's weight=): None, or a floating-point 1-D tensor of length V on `device`,
    not requiring grad (fastce computes no gradient for them). Negative and zero weights are allowed, as in torch."""
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor of class weights, got {getattr(weight, 'dtype', type(weight))}"
        )
    if weight.dim() != 1 or weight.shape[0] != vocab:
        raise ValueError(f"{name} must have shape ({vocab},) (one weight per class), got {tuple(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"{name} is on {weight.device} but the logits on {device}")
    if weight.requires_grad:
        raise ValueError(WEIGHT_GRAD_UNSUPPORTED.format(name))
    return weight


def label_weights(labels, weight, vocab):
    """w[y] per token (labels' shape, weight's dtype), 0 where the label is not a class (ignored, out of range)."""
    has_class = (labels >= 0) & (labels < vocab)
    return torch.where(has_class, weight[torch.where(has_class, labels, 0).long()], 0.0)


def check_temperature(temperature):
    """temperature as a float: a Python int or float, > 0 and finite (bool and other types: TypeError)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float > 0, got {temperature!r}")
    if not (_is_finite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    return float(temperature)


def with_temperature(options, temperature):
    """Options whose transform is softcap(scaling * x) / temperature, folded into the existing options (exact
    algebra: softcap_c(s x) / T = softcap_{c/T}((s/T) x)): scaling (s or 1) / T, softcapping c / T (0 stays 0).
    temperature == 1 returns `options` itself (the same kernel variants as without it). Raises ValueError naming
    temperature when a folded option leaves float32's normal range (the kernels compute in float32)."""
    if temperature == 1.0:
        return options
    scaling = (options.logit_scaling or 1.0) / temperature
    softcap = options.logit_softcapping / temperature
    for value in (scaling, softcap):
        if value != 0.0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
            raise ValueError(
                f"temperature={temperature} folds logit_scaling / logit_softcapping to {value}, outside float32's "
                "normal range (the kernels compute in float32)"
            )
    return options._replace(logit_scaling=scaling, logit_softcapping=softcap)


def validate_labels(labels, vocab, ignore_index):
    """Eager, opt-in (it synchronises): raise on the first label outside [0, V) that is not ignore_index."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"labels{list(position)} = {int(labels[position])} is outside [0, {vocab}) "
            f"and is not ignore_index ({ignore_index})"
        )


# --- routing -------------------------------------------------------------------------------------------------------


def use_kernel(tensor, backend):
    """Whether the kernels compute this call. float64 never reaches them (they compute in float32): whatever
    `backend` says, it goes to the plain-torch formulas (reference.py), which compute in float64."""
    if tensor.dtype == torch.float64:
        return False
    return backend == "kernel" or (backend == "auto" and tensor.is_cuda)


def compute_dtype(dtype):
    """The dtype the loss is computed and returned in: float64 for float64 logits, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_dtensor(tensor):
    """Whether `tensor` is a DTensor (the vocab-parallel DTensor paths in distributed/ take it)."""
    # A DTensor can only exist once torch.distributed.tensor was imported; checking sys.modules first keeps the
    # common path free of that import.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def loss_divisor(labels, reduction, n_items, ignore_index, dtype=torch.float32, weight=None):
    """What the summed loss is divided by: a 0-d tensor on labels' device (no host synchronisation), None for
    "none". n_items when given; for "mean" the kept-token count, at least 1 (an all-ignored batch gives 0 with a
    zero gradient), with class weights the sum of the kept tokens' w[y] (1 where it is exactly 0); for "sum" 1."""
    if reduction == "none":
        return None
    if n_items is not None:
        if isinstance(n_items, torch.Tensor):
            return n_items.to(device=labels.device, dtype=dtype)
        return torch.full((), float(n_items), dtype=dtype, device=labels.device)
    if reduction == "mean":
        if weight is not None:
            kept = torch.where(labels != ignore_index, label_weights(labels, weight, weight.shape[0]), 0.0)
            total = kept.to(dtype).sum()
            return torch.where(total == 0.0, 1.0, total).to(dtype)
        return (labels != ignore_index).sum().clamp_min(1).to(dtype)
    return torch.ones((), dtype=dtype, device=labels.device)
