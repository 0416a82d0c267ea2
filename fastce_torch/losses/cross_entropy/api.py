"""Fused cross-entropy for PyTorch: the functional `cross_entropy`, the `CrossEntropyLoss` module, and
`cross_entropy_reference` (the same contract in plain torch). The eager autograd.Function and the torch.library
custom ops used under torch.compile are autograd.py, the kernels forward.py and backward.py with their launchers in
launch.py; the checks are core/options.py, the plain-torch formulas core/reference.py and core/outputs.py, the
vocab-parallel and DTensor paths distributed/vocab_parallel.py and distributed/dtensor.py.

temperature is folded into the options on the host (with_temperature); token_weights turn the call into
per-token losses that are weighted and reduced in O(N) torch ops (weighted_output), so that the weights
reach the kernel backward as its per-row upstream; a differentiated entropy output adds its gradient in the
backward kernel's pass (HAS_ENTROPY_GRAD).

Eager calls go through `CrossEntropyFunction`: one forward launch that also reduces "mean"/"sum" in-kernel
(a fixed summation order, no host synchronisation), one backward launch, nothing else on the host's hot path, since
at N=8192, V=32000 the kernels take ~0.4 ms and host-side framework steps would otherwise dominate. Under
torch.compile the custom ops give the compiler opaque per-token ops and the reduction is plain torch arithmetic.
"""

import torch

from ...core.guards import is_intermediate, under_functorch
from ...core.options import (
    KERNEL_DTYPE_REQUIRED,
    KERNEL_DTYPES,
    Extras,
    check_class_weight,
    check_extras,
    check_labels,
    check_temperature,
    checked_options,
    is_dtensor,
    use_kernel,
    with_temperature,
)
from ...core.options import validate_labels as validate_label_values
from ...core.outputs import CrossEntropyOutput, extra_outputs, reference_outputs, unshifted, weighted_output
from ...core.reference import reduce_losses, reference_token_losses
from ...core.token_inputs import check_shift, check_token_weights, masked_labels, shifted_labels, shifted_token_weights
from ...distributed import vocab_parallel
from ...distributed.dtensor import dtensor_cross_entropy
from ...distributed.vocab_parallel_traced import traced_vocab_parallel_cross_entropy
from . import launch
from .autograd import CrossEntropyFunction, apply_function, forward_op, forward_outputs_op

__all__ = ["CrossEntropyLoss", "cross_entropy", "cross_entropy_reference"]

# --- the functions -------------------------------------------------------------------------------------------

NO_EXTRAS = Extras()


def _check_logits(logits):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() >= 1 and logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension of at least 1")


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
    process_group=None,
    vocab_start=None,
    shift=0,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    weight=None,
    temperature=1.0,
    token_weights=None,
    where=None,
):
    """Cross-entropy of logits (..., V) against integer labels (...), fused on the GPU.

    Returns a float32 scalar ("mean", "sum") or per-token losses shaped like labels ("none"), float64 for float64
    logits (computed in float64 by the plain-torch reference, whatever `backend` says). See CONTRACT.md.
    With inplace_backward=True (the default) the backward writes the gradient into the logits' own buffer when
    logits is an intermediate (non-leaf) tensor, so the loss costs no gradient-sized allocation: the logits are
    consumed by backward. Leaf tensors are never overwritten.

    Vocab-parallel (tensor-parallel LM head): with `process_group`, logits (..., V_local) are this rank's contiguous
    slice of the vocabulary and labels (...) global class ids, the same on every rank; the loss (the same on every
    rank) is that of the full logits, each rank's gradient its own columns. The slice starts at `vocab_start`, or,
    when None, at rank * V_local: every rank must then hold the same width (if not, the loss is NaN). A DTensor
    sharded on its last dimension (Shard(-1)) is handled the same way and gives a DTensor (see distributed/dtensor.py).

    shift=k (True = 1): position t is scored against label t + k along labels' last (the sequence) dimension, the
    loss of `cross_entropy(logits[..., :-k, :], labels[..., k:])` ("none": shaped like labels[..., k:]) without that
    slice, whose backward allocates a zero-filled logits-sized gradient: the kernels run on the full logits with
    the last k positions ignored. k >= the sequence length leaves no token (as the slice does).

    return_z_loss, return_lse, return_accuracy, return_entropy: any True returns CrossEntropyOutput(loss, z_loss,
    lse, accuracy, entropy), None for what was not asked, computed in the same forward pass (CONTRACT.md, "Extra
    outputs"); loss, z_loss and entropy are differentiable (the entropy's gradient is added in the same backward
    pass over the logits; an entropy returned but not differentiated costs nothing).

    temperature: z = softcap(scaling * x) / temperature in every output and gradient (folded on the host into the
    scaling and softcapping, exact; 1.0 changes nothing). token_weights: a floating tensor shaped like labels (no
    gradient; may be negative): each token's loss (its z-loss term included) times its weight before the
    reduction, "mean" still dividing by the non-ignored count (or n_items, or the class weights' divisor); the
    z_loss output is weighted alike, lse, accuracy and entropy are not. With shift, w[..., t] goes with
    labels[..., t].

    weight: class weights (V,) as F.cross_entropy's weight= (CONTRACT.md, "Class weights"): a floating tensor on
    the logits' device without requires_grad; "mean" is then the weighted mean. Not with process_group / DTensor.

    where: optax's mask, a bool tensor shaped like labels on their device: False leaves the token out exactly as
    ignore_index does (loss 0, gradient 0, not counted by "mean"); folded into the labels (O(N), no extra kernel
    pass). With shift it goes with the labels (where[..., t] with labels[..., t]).
    """
    _check_logits(logits)
    check_labels(labels, "logits", logits.shape, logits.device)
    labels = masked_labels(labels, where, ignore_index)
    if weight is not None and (process_group is not None or is_dtensor(logits)):
        raise NotImplementedError(
            "class weights (weight=) are not supported with vocab-parallel or DTensor logits; compute the loss "
            "with reduction='none' and weight it yourself"
        )
    weight = check_class_weight(weight, logits.shape[-1] if logits.dim() else 0, logits.device)
    options = checked_options(
        ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
    )
    options = with_temperature(options, check_temperature(temperature))
    token_weights = check_token_weights(token_weights, labels)
    if vocab_start is not None and process_group is None:
        raise ValueError("vocab_start is only meaningful with process_group (vocab-parallel logits)")
    extras = check_extras(return_z_loss, return_lse, return_accuracy, return_entropy)
    kept = None
    if shift := check_shift(shift, labels):
        if is_dtensor(logits) or is_dtensor(labels):
            raise NotImplementedError(
                "shift is not supported with DTensor inputs; shift the labels yourself (labels[..., k:] padded with "
                "ignore_index), or pass plain tensors with process_group"
            )
        labels, kept = shifted_labels(labels, shift, ignore_index)
        if token_weights is not None:
            token_weights = shifted_token_weights(token_weights, shift)
    if token_weights is not None and not is_dtensor(logits):
        # Per-token losses from the kernels, weighted and reduced in O(N) ops: the weights reach the backward kernel
        # as its per-row upstream. (DTensor logits weight their local rows: dtensor.py.)
        loss = _cross_entropy(
            logits, labels, options, "none", None, backend, inplace_backward, validate_labels, process_group,
            vocab_start, extras, weight,
        )  # fmt: skip
        loss = weighted_output(loss, labels, token_weights, reduction, n_items, ignore_index, weight)
    else:
        loss = _cross_entropy(
            logits, labels, options, reduction, n_items, backend, inplace_backward, validate_labels, process_group,
            vocab_start, extras, weight, token_weights,
        )  # fmt: skip
    if isinstance(loss, CrossEntropyOutput):
        return unshifted(loss, kept, reduction)
    return loss[..., :kept] if kept is not None and reduction == "none" else loss


def _cross_entropy(
    logits, labels, options, reduction, n_items, backend, inplace_backward, validate_labels, process_group, vocab_start,
    extras=NO_EXTRAS, weight=None, token_weights=None,
):  # fmt: skip
    # token_weights: only for DTensor logits (cross_entropy weights every other call itself).
    ignore_index = options.ignore_index
    if process_group is not None or is_dtensor(logits):
        return _vocab_parallel(
            logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group,
            vocab_start, extras if any(extras) else None, token_weights,
        )  # fmt: skip
    if validate_labels:
        validate_label_values(labels, logits.shape[-1], ignore_index)
    if not use_kernel(logits, backend):
        token_losses = reference_token_losses(logits, labels, options, weight)
        loss = reduce_losses(token_losses, labels, reduction, n_items, ignore_index, weight)
        if any(extras):
            return reference_outputs(logits, labels, options, extras, reduction, n_items, loss, weight)
        return loss
    logits = _in_kernel_dtype(logits)
    # Logits whose rows form one or two strided dimensions (any contiguous tensor, logits[:, :-1]) go to the kernels
    # as they are; anything else is copied once.
    kernel_logits, layout = logits, launch.row_layout(logits)
    if layout is None:
        kernel_logits = logits.contiguous()
        layout = launch.row_layout(kernel_logits)
    # Flat contiguous labels as they are: reshape(-1) would make a view object (~0.5 us) of the same memory.
    labels_1d = labels if labels.dim() == 1 and labels.is_contiguous() else labels.reshape(-1).contiguous()
    if torch.compiler.is_compiling() and any(extras):
        token_losses, lse, argmax, mean_z = forward_outputs_op(
            kernel_logits, labels_1d, *options, extras.z_loss, weight, extras.entropy
        )
        loss = reduce_losses(token_losses.view(labels.shape), labels, reduction, n_items, ignore_index, weight)
        vocab = logits.shape[-1]
        return extra_outputs(
            loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, weight, extras.entropy
        )
    if torch.compiler.is_compiling():
        token_losses = forward_op(kernel_logits, labels_1d, *options, weight)[0].view(labels.shape)
        return reduce_losses(token_losses, labels, reduction, n_items, ignore_index, weight)
    # In place only into memory the graph alone owns, and only where no two rows share memory.
    # Never under torch.func: its wrappers hide who else holds the memory.
    inplace = (
        bool(inplace_backward)
        and is_intermediate(logits)
        and not launch.rows_overlap(kernel_logits)
        and not under_functorch()
    )
    if any(extras):
        loss, lse, _, argmax, mean_z = apply_function(
            CrossEntropyFunction, kernel_logits, labels_1d, reduction, n_items, inplace, options, layout, extras,
            weight,
        )  # fmt: skip
        loss = loss.view(labels.shape) if reduction == "none" else loss
        vocab = logits.shape[-1]
        return extra_outputs(
            loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, weight, extras.entropy
        )
    if weight is not None:
        loss = apply_function(
            CrossEntropyFunction, kernel_logits, labels_1d, reduction, n_items, inplace, options, layout, None, weight
        )[0]
        return loss.view(labels.shape) if reduction == "none" else loss
    function = CrossEntropyFunction
    loss = apply_function(function, kernel_logits, labels_1d, reduction, n_items, inplace, options, layout)[0]
    return loss.view(labels.shape) if reduction == "none" else loss


def _in_kernel_dtype(logits):
    if logits.dtype not in KERNEL_DTYPES:
        raise TypeError(KERNEL_DTYPE_REQUIRED.format(logits.dtype))
    return logits


def _vocab_parallel(
    logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group, vocab_start,
    extras=None, token_weights=None,
):  # fmt: skip
    """Eager: an autograd.Function with the collectives in its forward. Under torch.compile (process group or
    DTensor): functional collectives around custom ops, traced without a graph break; explicit vocab_start (its
    layout check synchronises), validate_labels and the return_* outputs run the eager path there (a graph
    break)."""
    if torch.compiler.is_compiling() and vocab_start is None and not validate_labels and extras is None:
        kernel = use_kernel(logits, backend)
        if kernel:
            logits = _in_kernel_dtype(logits)
        if is_dtensor(logits):  # traces the vocab-parallel compiled path too
            return dtensor_cross_entropy(
                logits, labels, reduction, n_items, options, kernel, process_group, vocab_start, None,
                token_weights,
            )  # fmt: skip
        layout = vocab_parallel.layout_of(process_group, None, logits.shape[-1], logits.device)
        return traced_vocab_parallel_cross_entropy(logits, labels, reduction, n_items, options, layout, kernel)
    return _eager_vocab_parallel(
        logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group,
        vocab_start, extras, token_weights,
    )  # fmt: skip


def _compiler_disable(reason):
    try:
        return torch.compiler.disable(reason=reason)
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable


@_compiler_disable(
    "fastce_torch vocab-parallel with vocab_start= or validate_labels=True synchronises with the host (the slices' "
    "layout check, the label check); under torch.compile pass neither (slices then start at rank * V_local); the "
    "return_* outputs of a vocab-parallel call run eagerly"
)
def _eager_vocab_parallel(
    logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group, vocab_start,
    extras=None, token_weights=None,
):  # fmt: skip
    """Eager even under torch.compile (a graph break): the collectives run in the autograd.Function's forward."""
    kernel = use_kernel(logits, backend)
    if kernel:
        logits = _in_kernel_dtype(logits)
    if is_dtensor(logits):
        if validate_labels:
            full_labels = labels.full_tensor() if is_dtensor(labels) else labels
            validate_label_values(full_labels, logits.shape[-1], options.ignore_index)
        return dtensor_cross_entropy(
            logits, labels, reduction, n_items, options, kernel, process_group, vocab_start, extras, token_weights
        )
    layout = vocab_parallel.layout_of(process_group, vocab_start, logits.shape[-1], logits.device)
    if validate_labels:
        validate_label_values(labels, layout[2], options.ignore_index)
    inplace = bool(inplace_backward) and is_intermediate(logits)
    return vocab_parallel.vocab_parallel_cross_entropy(
        logits, labels, reduction, n_items, inplace, options, layout, kernel, extras
    )


def cross_entropy_reference(logits, labels, **options):
    """`cross_entropy` in plain torch (the same keywords; `backend` is ignored): differentiable by autograd, float32
    math (float64 for float64 logits), so it materialises (N, V) float32 values."""
    return cross_entropy(logits, labels, **dict(options, backend="reference"))


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss's arguments plus fastce's options; classes are on the LAST dimension."""

    def __init__(
        self,
        weight=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        *,
        logit_softcapping=0.0,
        logit_scaling=0.0,
        z_loss=0.0,
        backend="auto",
        inplace_backward=True,
        validate_labels=False,
        process_group=None,
        vocab_start=None,
        shift=0,
        return_z_loss=False,
        return_lse=False,
        return_accuracy=False,
        return_entropy=False,
        temperature=1.0,
    ):
        super().__init__()
        # A buffer, as torch.nn.CrossEntropyLoss keeps it: it follows .to(device) and lands in the state dict.
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.options = dict(
            label_smoothing=label_smoothing,
            logit_softcapping=logit_softcapping,
            logit_scaling=logit_scaling,
            z_loss=z_loss,
            backend=backend,
            inplace_backward=inplace_backward,
            validate_labels=validate_labels,
            process_group=process_group,
            vocab_start=vocab_start,
            shift=shift,
        )
        # Only the keywords given: the repr of a plain loss stays as it was.
        returns = dict(
            return_z_loss=return_z_loss,
            return_lse=return_lse,
            return_accuracy=return_accuracy,
            return_entropy=return_entropy,
        )
        self.options.update({name: value for name, value in returns.items() if value is not False})
        if temperature != 1.0:
            self.options["temperature"] = check_temperature(temperature)

    def forward(self, input, target, n_items=None, token_weights=None):
        """token_weights: per-token weights shaped like target (see cross_entropy), per call."""
        weights = {} if self.weight is None else {"weight": self.weight}
        if token_weights is not None:
            weights["token_weights"] = token_weights
        return cross_entropy(
            input, target, ignore_index=self.ignore_index, reduction=self.reduction, n_items=n_items, **self.options,
            **weights,
        )  # fmt: skip

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items()
        )
