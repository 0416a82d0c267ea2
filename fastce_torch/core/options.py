"""The contract of fastce_torch in plain torch, shared by every entry point (cross_entropy, linear_cross_entropy,
the vocab-parallel path in sharding.py): the options record and its checks, the reduction's divisor, the per-token
loss and its gradient in framework ops (the reference, the vocab-parallel statistics and linear's plain path all
use the same formulas), the error messages; the autograd guards live in guards.py (re-exported here)."""

import math
from typing import NamedTuple

import torch

from .guards import (  # noqa: F401  (re-exported: the other layers reach them as contract.*)
    LOGITS_REUSED,
    differentiated_again,
    functorch_transforms,
    gradient_buffer,
    is_intermediate,
    saved_logits,
    under_functorch,
    unwrapped,
)


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


class CrossEntropyOutput(NamedTuple):
    """What cross_entropy / linear_cross_entropy return when any return_* keyword is True (None where not asked):
    loss as without them (z-loss term included); z_loss the z-loss term reduced like the loss (differentiable);
    lse the per-token logsumexp of the transformed logits (-inf where ignored); accuracy per token ("none") or the
    fraction of non-ignored rows whose argmax is the label; entropy of softmax(transformed logits) reduced like the
    loss. lse, accuracy and entropy carry no gradient. CONTRACT.md, "Extra outputs"."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


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


FLOAT32_MAX = torch.finfo(torch.float32).max


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


def use_kernel(tensor, backend):
    """Whether the kernels compute this call. float64 never reaches them (they compute in float32): whatever
    `backend` says, it goes to the plain-torch formulas below, which compute in float64."""
    if tensor.dtype == torch.float64:
        return False
    return backend == "kernel" or (backend == "auto" and tensor.is_cuda)


def op_schema(record):
    """A NamedTuple's fields as torch.library schema arguments ("int ignore_index, float logit_softcapping, ..."),
    so that a custom op takes a record's fields in the one order the record defines."""
    types = {int: "int", float: "float", bool: "bool", int | None: "int?"}
    return ", ".join(f"{types[record.__annotations__[name]]} {name}" for name in record._fields)


# --- the reduction -----------------------------------------------------------------------------------------------


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


def reduce_losses(token_losses, labels, reduction, n_items, ignore_index, weight=None):
    """The reduction in plain torch (the reference and torch.compile paths; the eager kernels reduce in-kernel)."""
    divisor = loss_divisor(labels, reduction, n_items, ignore_index, token_losses.dtype, weight)
    return token_losses if divisor is None else token_losses.sum() / divisor


# --- the per-token loss and its gradient in framework ops ----------------------------------------------------------


def compute_dtype(dtype):
    """The dtype the loss is computed and returned in: float64 for float64 logits, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def transform(logits, options, labels=None):
    """z: the logits in the compute dtype, scaled, then soft-capped. With labels, ignored rows are zeroed first, so
    that NaN there cannot leak into any arithmetic (or their zero gradient)."""
    if labels is not None:
        logits = torch.where((labels == options.ignore_index).unsqueeze(-1), 0.0, logits)
    z = logits.to(compute_dtype(logits.dtype))
    if options.logit_scaling != 0.0:
        z = z * options.logit_scaling
    if options.logit_softcapping > 0.0:
        z = options.logit_softcapping * torch.tanh(z / options.logit_softcapping)
    return z


def label_columns(labels, vocab_start, width, ignore_index):
    """(the column of each label in a slice [vocab_start, vocab_start + width), clamped into it; whether the slice
    holds the label)."""
    column = labels.long() - vocab_start
    owned = (column >= 0) & (column < width) & (labels != ignore_index)
    return column.clamp(0, max(width - 1, 0)), owned


def row_statistics(z, labels, options, vocab_start=0):
    """Per row of z (..., width), the columns [vocab_start, vocab_start + width) of the vocabulary: (logsumexp,
    the label's z where the slice holds the label else 0, sum of z (zeros without label smoothing)). Ignored rows
    give finite values that the loss ignores."""
    lse = torch.logsumexp(z, dim=-1)
    column, owned = label_columns(labels, vocab_start, z.shape[-1], options.ignore_index)
    label_logit = torch.where(owned, z.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
    sum_z = z.sum(dim=-1) if options.label_smoothing > 0.0 else torch.zeros_like(lse)
    return lse, label_logit, sum_z


def row_shift(maxima, n_rows):
    """The shift of each row's combined logsumexp: the reduced maximum, 0 where it is -inf (rows that are -inf on
    every rank, ignored or all -inf logits: -inf - -inf would be NaN)."""
    row_max = maxima[:n_rows]
    return torch.where(row_max == float("-inf"), 0.0, row_max)


def global_statistics(maxima, sums, n_rows, shift=None):
    """Vocab-parallel: (lse, z_label, sum_z or None) per row from the two all-reduced tensors of
    sharding.reduced_statistics (maxima holds 2 more entries, the widths, when they are checked; sums a third row,
    sum_z, with label smoothing) and its shift (derived again from maxima when None)."""
    shift = row_shift(maxima, n_rows) if shift is None else shift
    lse = shift + torch.log(sums[0])
    if maxima.shape[0] > n_rows:
        lse = torch.where(maxima[n_rows] == -maxima[n_rows + 1], lse, float("nan"))
    return lse, sums[1], (sums[2] if sums.shape[0] > 2 else None)


def token_loss_from_statistics(lse, label_logit, sum_z, labels, options, vocab):
    """The contract's per-token loss from a row's (logsumexp, label z, sum of z) over the whole vocabulary."""
    _, _, _, label_smoothing, z_loss = options
    loss = lse - label_logit
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_z / vocab)
    if z_loss != 0.0:
        loss = loss + z_loss * lse * lse
    ignored = labels == options.ignore_index
    # Multiply (not where) so that an out-of-range row's gradient is NaN too, as the kernels give it.
    loss = loss * torch.where(((labels >= 0) & (labels < vocab)) | ignored, 1.0, float("nan")).to(loss.dtype)
    return torch.where(ignored, 0.0, loss)


def reference_token_losses(logits, labels, options, weight=None):
    """Per-token losses of the contract in plain torch (differentiable by autograd; backend='reference'): float32
    math and losses, float64 for float64 logits. weight: class weights (V,) or None."""
    z = transform(logits, options, labels)
    if weight is not None:
        return weighted_token_losses(z, labels, options, weight)
    return token_loss_from_statistics(*row_statistics(z, labels, options), labels, options, logits.shape[-1])


def weighted_token_losses(z, labels, options, weight):
    """F.cross_entropy's weighted per-token loss of transformed logits z (..., V): w[y] (1 - eps)(lse - z_y)
    + (eps / V) sum_c w_c (lse - z_c) + w[y] z_loss lse^2 (a class of weight 0 takes no part, even at z = -inf);
    NaN for a label outside [0, V), 0 where ignored."""
    _, _, _, label_smoothing, z_loss = options
    vocab = z.shape[-1]
    weight = weight.to(z.dtype)
    lse, label_logit, _ = row_statistics(z, labels, options._replace(label_smoothing=0.0))
    w_label = label_weights(labels, weight, vocab)
    loss = w_label * (lse - label_logit)
    if label_smoothing > 0.0:
        spread = torch.where(weight == 0.0, 0.0, weight * (lse.unsqueeze(-1) - z)).sum(-1)
        loss = (1.0 - label_smoothing) * loss + label_smoothing / vocab * spread
    if z_loss != 0.0:
        loss = loss + w_label * z_loss * lse * lse
    ignored = labels == options.ignore_index
    loss = loss * torch.where(((labels >= 0) & (labels < vocab)) | ignored, 1.0, float("nan")).to(loss.dtype)
    return torch.where(ignored, 0.0, loss)


def logits_gradient(grad_rows, logits, labels, lse, options, vocab_start=0, vocab_total=None, weight=None):
    """d loss / d logits of the columns [vocab_start, vocab_start + V) (float32; float64 for float64 logits) in
    plain torch ops, so that autograd and torch.func can differentiate it again: grad_rows (N,) the per-token
    upstream, lse (N,) the logsumexp over the whole vocabulary of vocab_total (default V), or None for that of these
    logits themselves. weight: class weights (V,) or None (not with a slice of the vocabulary)."""
    ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss = options
    vocab_total = logits.shape[-1] if vocab_total is None else vocab_total
    ignored = labels == ignore_index
    z = transform(logits, options, labels)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    dz = torch.exp(z - lse.unsqueeze(-1))
    column, owned = label_columns(labels, vocab_start, logits.shape[-1], ignore_index)
    if weight is not None:
        # w[y] ((1 - eps)(p - onehot) + 2 z_loss lse p) + (eps / V)(W p - w)
        weight = weight.to(dz.dtype)
        w_label = label_weights(labels, weight, vocab_total).unsqueeze(-1)
        coefficient = w_label * (1.0 - label_smoothing + 2.0 * z_loss * lse.unsqueeze(-1))
        dz = dz * (coefficient + label_smoothing / vocab_total * weight.sum())
        label_mass = owned.to(dz.dtype) * (1.0 - label_smoothing) * w_label.squeeze(-1)
        dz = dz.scatter_add(-1, column.unsqueeze(-1), -label_mass.unsqueeze(-1))
        if label_smoothing > 0.0:
            dz = dz - label_smoothing / vocab_total * weight
    else:
        if z_loss != 0.0:
            dz = dz * (1.0 + 2.0 * z_loss * lse.unsqueeze(-1))
        label_mass = owned.to(dz.dtype) * (1.0 - label_smoothing)
        dz = dz.scatter_add(-1, column.unsqueeze(-1), -label_mass.unsqueeze(-1))
        if label_smoothing > 0.0:
            dz = dz - label_smoothing / vocab_total
    if logit_softcapping > 0.0:
        tanh_z = z / logit_softcapping
        dz = dz * (1.0 - tanh_z * tanh_z)
    if logit_scaling != 0.0:
        dz = dz * logit_scaling
    in_range = (labels >= 0) & (labels < vocab_total)
    scale = torch.where(in_range, grad_rows.to(dz.dtype), float("nan"))  # a bad label's whole row is NaN
    return torch.where(ignored.unsqueeze(-1), 0.0, dz * scale.unsqueeze(-1))


# The extra outputs' formulas (CrossEntropyOutput from per-token statistics, their gradients) live in outputs.py,
# which builds on the functions above; re-exported so every layer reaches them as contract.*.
from .outputs import (  # noqa: E402, F401
    entropy_gradient,
    extra_outputs,
    lse_gradient,
    reference_outputs,
    row_extras,
    softmax_mean,
    unshifted,
    weighted_output,
)
