"""Fused cross-entropy for PyTorch: argument checks, the eager autograd.Function, torch.library custom ops for
torch.compile, the functional `cross_entropy`, the `CrossEntropyLoss` module, and `cross_entropy_reference` (the
same contract in plain torch). The kernels and their launchers are in kernels.py.

Eager calls go through `_CrossEntropyFunction`: one forward launch that also reduces "mean"/"sum" in-kernel
(a fixed summation order, no host synchronisation), one backward launch, nothing else on the host's hot path, since
at N=8192, V=32000 the kernels take ~0.4 ms and host-side framework steps would otherwise dominate. Under
torch.compile the custom ops give the compiler opaque per-token ops and the reduction is plain torch arithmetic.
"""

import math

import torch

from . import distributed, kernels
from .kernels import Options

REDUCTIONS = ("none", "mean", "sum")
BACKENDS = ("auto", "kernel", "reference")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: options between 0 and this are refused

LOGITS_REUSED = (
    "fastce_torch.cross_entropy wrote its gradient into the logits' buffer (inplace_backward=True), and these "
    "logits were needed again: by a second backward through the same loss, by a second loss over the same logits, "
    "or by another op that saved them. Pass inplace_backward=False to keep the logits intact."
)
VMAP_UNSUPPORTED = (
    "fastce_torch.cross_entropy's kernels have no torch.func.vmap rule: a vmapped batch is only more rows, so "
    "flatten it into the rows instead (logits.reshape(-1, V), labels.reshape(-1), reduction='none', then reduce "
    "per example), or use backend='reference'"
)


def _functorch_transforms():
    """The torch.func transforms (grad, vjp, jvp, vmap, ...) the current call runs under, outermost first."""
    return [interpreter.key() for interpreter in torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()]


def _under_functorch():
    return torch._C._functorch.maybe_current_level() is not None


def _unwrapped(tensor):
    """The plain tensor inside torch.func's wrappers (grad/vjp run the backward on them; a kernel needs memory)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def _differentiated_again(tensors):
    """Whether the gradient this backward returns will itself be differentiated, so it must be built from
    differentiable torch ops rather than by a kernel (whose output autograd would take for a constant): under
    create_graph=True (grad mode on inside backward) when the saved logits or the upstream gradient are tracked
    beneath the torch.func wrappers, or inside an outer torch.func transform that differentiates again (grad of
    grad, jvp of grad) or batches the cotangent (vmap: jacrev, per-example gradients)."""
    if torch.is_grad_enabled() and any(_unwrapped(tensor).requires_grad for tensor in tensors[:2]):
        return True
    if not _under_functorch():
        return False
    transforms = _functorch_transforms()
    kind = torch._C._functorch.TransformType
    return kind.Vmap in transforms or sum(key in (kind.Grad, kind.Jvp) for key in transforms) > 1


def _differentiable_gradient(grad_output, logits, labels, denominator, options):
    """The kernel backward's gradient in plain torch from the saved inputs: the contract's d loss / d logits,
    differentiable again (Hessian-vector products, gradient penalties)."""
    upstream = grad_output.float()
    if denominator.numel():
        upstream = upstream / denominator.reshape(())
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    grad = distributed.local_gradient(upstream.expand(labels.shape), rows, labels, None, options, 0, vocab)
    return grad.to(logits.dtype).reshape(logits.shape)


class _CrossEntropyFunction(torch.autograd.Function):
    """The eager path, reduction included, with the fewest host-side steps: one launch forward, one launch
    backward, and no autograd nodes besides this one (each costs host time per step). Outputs: the loss (it owns
    its storage), lse and the reduction's denominator (both non-differentiable, for the backward)."""

    @staticmethod
    def forward(logits, labels, reduction, n_items, inplace_backward, options):
        loss, lse, denominator = kernels.forward(logits, labels, options, reduction, n_items)
        return loss, lse, (lse[:0] if denominator is None else denominator)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, labels, _, _, inplace_backward, options = inputs
        _, lse, denominator = output
        ctx.mark_non_differentiable(lse, denominator)
        ctx.save_for_backward(logits, labels, lse, denominator)
        if _under_functorch() or torch.autograd.forward_ad._current_level >= 0:  # forward mode may ask for jvp
            ctx.save_for_forward(logits, labels, lse, denominator)
        ctx.inplace_backward, ctx.options, ctx.consumed = inplace_backward, options, False

    @staticmethod
    def backward(ctx, grad_output, grad_lse, grad_denominator):
        if ctx.consumed:
            raise RuntimeError(LOGITS_REUSED)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:
            if ctx.inplace_backward and "modified by an inplace operation" in str(error):
                raise RuntimeError(LOGITS_REUSED) from error
            raise
        tensors = (grad_output, *saved)
        transformed = _under_functorch()
        plain = not transformed and not any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors))
        if plain and not torch.is_grad_enabled():  # the first-order path: one kernel launch
            return _CrossEntropyFunction._gradient(ctx, *tensors), *[None] * 5
        # Decided before anything is written in place: a gradient that is differentiated again is computed in plain
        # torch from the intact logits.
        if _differentiated_again(tensors):
            grad_output, logits, labels, _, denominator = tensors
            if not transformed and not plain:
                # The function torch.func.vjp returned, called after the transform: its wrappers are dead, the
                # tracked tensors beneath them are what create_graph differentiates.
                with torch._C._DisableFuncTorch():
                    grad_output, logits, labels, denominator = map(
                        _unwrapped, (grad_output, logits, labels, denominator)
                    )
                    return _differentiable_gradient(grad_output, logits, labels, denominator, ctx.options), *[None] * 5
            return _differentiable_gradient(grad_output, logits, labels, denominator, ctx.options), *[None] * 5
        if plain:
            return _CrossEntropyFunction._gradient(ctx, *tensors), *[None] * 5
        # torch.func.grad / vjp run this backward on their wrapped tensors, inside the transform (grad) or after it
        # (the function vjp returns). Differentiated once, the kernel runs on the plain tensors with the transforms
        # switched off (anything allocated under them, Triton's interpreter copies included, would be a wrapper
        # without storage).
        with torch._C._DisableFuncTorch():
            grad = _CrossEntropyFunction._gradient(ctx, *map(_unwrapped, tensors))
        return grad, *[None] * 5

    @staticmethod
    def _gradient(ctx, grad_output, logits, labels, lse, denominator):
        if ctx.inplace_backward:
            grad = logits
            # The logits are about to hold the gradient: any other op that saved them for its own backward then
            # fails loudly ("modified by an inplace operation") instead of reading gradients as logits.
            torch.autograd.graph.increment_version(logits)
            ctx.consumed = True
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return kernels.backward(
            grad_output,
            logits,
            labels,
            lse,
            grad,
            ctx.options,
            denominator=denominator if denominator.numel() else None,
        )

    @staticmethod
    def jvp(ctx, logits_tangent, *unused_tangents):
        # Forward mode (torch.func.jvp, jacfwd, hessian): the loss's tangent is <d loss / d logits, tangent>, with
        # that gradient in differentiable plain torch, so transforms around this one differentiate it again.
        logits, labels, _, denominator = ctx.saved_tensors
        reduced = denominator.numel() > 0
        ones = torch.ones((() if reduced else labels.shape), dtype=torch.float32, device=logits.device)
        grad = _differentiable_gradient(ones, logits, labels, denominator, ctx.options)
        product = (grad.float() * logits_tangent.float()).reshape(labels.shape[0], -1)
        return (product.sum() if reduced else product.sum(-1)), None, None

    @staticmethod
    def vmap(info, in_dims, *args):
        raise RuntimeError(VMAP_UNSUPPORTED)


def _apply(function, *args):
    """function.apply(*args) without torch.autograd.Function.apply's per-call inspect.signature binding (~15 us of
    host time, bench/NOTES.md), which only fills in default arguments: every argument here is positional and none has
    a default. Under torch.func transforms the full path runs."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*torch._functorch.utils.unwrap_dead_wrappers(args))


# --- custom ops for torch.compile: opaque to the compiler, fake implementations for tracing, no graph break ------


@torch.library.custom_op("fastce::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    logit_softcapping: float,
    logit_scaling: float,
    label_smoothing: float,
    z_loss: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = Options(ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss)
    loss, lse, _ = kernels.forward(logits, labels, options)
    return loss, lse.clone()  # lse is a view of the launch's scratch buffer; an op's output owns its storage


@_forward_op.register_fake
def _(logits, labels, ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss):
    n_rows = labels.shape[0]
    return logits.new_empty(n_rows, dtype=torch.float32), logits.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op("fastce::cross_entropy_backward", mutates_args=())
def _backward_op(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    logit_softcapping: float,
    logit_scaling: float,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    options = Options(ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss)
    return kernels.backward(grad_loss, logits, labels, lse, grad, options)


@_backward_op.register_fake
def _(grad_loss, logits, labels, lse, ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output):
    logits, labels, *options = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.options = options


def _backward(ctx, grad_loss, grad_lse):
    # Under the compiler the gradient is a fresh tensor; the compiler plans that memory itself.
    logits, labels, lse = ctx.saved_tensors
    return _backward_op(grad_loss, logits, labels, lse, *ctx.options), None, None, None, None, None, None


torch.library.register_autograd("fastce::cross_entropy_forward", _backward, setup_context=_setup_context)


# --- the contract ----------------------------------------------------------------------------------------------


def _is_finite(value):
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) dynamo cannot trace math.isfinite (a graph
    # break, an error with fullgraph=True), while float comparisons fold to constants. NaN fails both.
    return -math.inf < value < math.inf


def _check_arguments(
    logits, labels, ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor, got {getattr(labels, 'dtype', type(labels))}")
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must have the leading shape of logits: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension of at least 1")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(n_items, bool) or not (n_items is None or isinstance(n_items, (int, float, torch.Tensor))):
        raise TypeError(f"n_items must be a number or a 0-d tensor, got {n_items!r}")
    if isinstance(n_items, torch.Tensor) and n_items.dim() != 0:
        raise ValueError(f"n_items must be 0-d, got shape {tuple(n_items.shape)}")
    if isinstance(n_items, (int, float)) and not n_items > 0:
        raise ValueError(f"n_items must be positive, got {n_items}")
    if not _is_finite(logit_softcapping) or logit_softcapping < 0:
        raise ValueError(f"logit_softcapping must be >= 0 (0 disables it), got {logit_softcapping}")
    if not _is_finite(logit_scaling):
        raise ValueError(f"logit_scaling must be finite (0 disables it), got {logit_scaling}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not _is_finite(z_loss):
        raise ValueError(f"z_loss must be finite, got {z_loss}")
    for name, value in (
        ("logit_softcapping", logit_softcapping),
        ("logit_scaling", logit_scaling),
        ("label_smoothing", label_smoothing),
        ("z_loss", z_loss),
    ):
        if value != 0.0 and abs(value) < FLOAT32_TINY:
            raise ValueError(
                f"{name}={value} is below float32's normal range (the kernels compute in float32); use 0 to disable it"
            )


def _check_shift(shift, labels):
    """shift as an int: True is 1, False 0; position t of the sequence (labels' last dimension) is then scored
    against label t + shift."""
    if not isinstance(shift, int):
        raise TypeError(f"shift must be a non-negative int (True means 1), got {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if shift and labels.dim() < 1:
        raise ValueError("shift needs labels with a sequence dimension (their last), got 0-d labels")
    return int(shift)


def _shifted_labels(labels, shift, ignore_index):
    """labels[..., shift:] followed by `shift` ignore_index columns (all ignore_index when shift >= the sequence
    length), and the length of the kept part. The kernels then run on the full, unsliced logits: their last `shift`
    positions are ignored rows, never read and given a zero gradient, so the loss equals that of
    (logits[..., :-shift, :], labels[..., shift:]) with no logits-sized slice or gradient. O(N) integers."""
    info = torch.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(
            f"shift pads the labels with ignore_index ({ignore_index}), which {labels.dtype} labels cannot hold; "
            "pass int64 labels"
        )
    kept = labels[..., shift:]
    pad = labels.new_full((*labels.shape[:-1], labels.shape[-1] - kept.shape[-1]), ignore_index)
    return torch.cat((kept, pad), dim=-1), kept.shape[-1]


def _validate_labels(labels, vocab, ignore_index):
    """Eager, opt-in (it synchronises): raise on the first label outside [0, V) that is not ignore_index."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"labels{list(position)} = {int(labels[position])} is outside [0, {vocab}) "
            f"and is not ignore_index ({ignore_index})"
        )


def _is_intermediate(tensor):
    """True when the tensor's storage belongs to the autograd graph alone (not a leaf, not a view of one)."""
    base = tensor if tensor._base is None else tensor._base
    return tensor.requires_grad and not tensor.is_leaf and not base.is_leaf


def _compute_dtype(dtype):
    """The dtype the loss is computed and returned in: float64 for float64 logits, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(token_losses, labels, reduction, n_items, ignore_index):
    """The reduction in plain torch (reference and torch.compile paths; the eager kernels reduce in-kernel)."""
    if reduction == "none":
        return token_losses
    dtype = token_losses.dtype
    if n_items is not None:
        denominator = n_items.to(token_losses.device, dtype) if torch.is_tensor(n_items) else float(n_items)
    elif reduction == "mean":
        # At least 1: an all-ignored batch gives 0 with a zero gradient.
        denominator = (labels != ignore_index).sum().clamp_min(1).to(dtype)
    else:
        denominator = 1.0
    return token_losses.sum() / denominator


def _reference_token_losses(logits, labels, options):
    """Per-token losses of the contract in plain torch (differentiable by autograd; backend='reference'): float32
    math and losses, float64 for float64 logits."""
    ignored = labels == options.ignore_index
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    # Ignored rows are zeroed before any arithmetic, so NaN there cannot leak into their (zero) gradient.
    z = torch.where(ignored.unsqueeze(-1), 0.0, logits.to(_compute_dtype(logits.dtype)))
    if options.logit_scaling != 0.0:
        z = z * options.logit_scaling
    if options.logit_softcapping > 0.0:
        z = options.logit_softcapping * torch.tanh(z / options.logit_softcapping)
    lse = torch.logsumexp(z, dim=-1)
    z_label = z.gather(-1, torch.where(in_range, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    loss = lse - z_label
    if options.label_smoothing > 0.0:
        loss = (1.0 - options.label_smoothing) * loss + options.label_smoothing * (lse - z.mean(dim=-1))
    if options.z_loss != 0.0:
        loss = loss + options.z_loss * lse * lse
    # Multiply (not where) so that an out-of-range row's gradient is NaN too, as the kernels give it.
    loss = loss * torch.where(in_range | ignored, 1.0, float("nan")).to(loss.dtype)
    return torch.where(ignored, 0.0, loss)


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
    sharded on its last dimension (Shard(-1)) is handled the same way and gives a DTensor (see distributed.py).

    shift=k (True = 1): position t is scored against label t + k along labels' last (the sequence) dimension, the
    loss of `cross_entropy(logits[..., :-k, :], labels[..., k:])` ("none": shaped like labels[..., k:]) without that
    slice, whose backward allocates a zero-filled logits-sized gradient: the kernels run on the full logits with
    the last k positions ignored. k >= the sequence length leaves no token (as the slice does).
    """
    _check_arguments(
        logits,
        labels,
        ignore_index,
        reduction,
        n_items,
        logit_softcapping,
        logit_scaling,
        label_smoothing,
        z_loss,
        backend,
    )
    if vocab_start is not None and process_group is None:
        raise ValueError("vocab_start is only meaningful with process_group (vocab-parallel logits)")
    if shift := _check_shift(shift, labels):
        if distributed.is_dtensor(logits) or distributed.is_dtensor(labels):
            raise NotImplementedError(
                "shift is not supported with DTensor inputs; shift the labels yourself (labels[..., k:] padded with "
                "ignore_index), or pass plain tensors with process_group"
            )
        labels, kept = _shifted_labels(labels, shift, ignore_index)
        loss = cross_entropy(
            logits,
            labels,
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
            process_group=process_group,
            vocab_start=vocab_start,
        )
        return loss[..., :kept] if reduction == "none" else loss
    vocab = logits.shape[-1]
    options = Options(
        ignore_index, float(logit_softcapping), float(logit_scaling), float(label_smoothing), float(z_loss)
    )
    if process_group is not None or distributed.is_dtensor(logits):
        return _vocab_parallel(
            logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group,
            vocab_start,
        )  # fmt: skip
    if validate_labels:
        _validate_labels(labels, vocab, ignore_index)
    if not _use_kernel(logits, backend):
        token_losses = _reference_token_losses(logits, labels, options)
        return _reduce(token_losses, labels, reduction, n_items, ignore_index)
    logits = _in_kernel_dtype(logits)
    # Logits whose rows form one or two strided dimensions (any contiguous tensor, logits[:, :-1]) go to the kernels
    # as they are; anything else is copied once.
    kernel_logits = logits if kernels.row_layout(logits) is not None else logits.contiguous()
    labels_1d = labels.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        token_losses = _forward_op(kernel_logits, labels_1d, *options)[0].view(labels.shape)
        return _reduce(token_losses, labels, reduction, n_items, ignore_index)
    # In place only into memory the graph alone owns, and only where no two rows share memory.
    # Never under torch.func: its wrappers hide who else holds the memory.
    inplace = (
        bool(inplace_backward)
        and _is_intermediate(logits)
        and not kernels.rows_overlap(kernel_logits)
        and not _under_functorch()
    )
    loss = _apply(_CrossEntropyFunction, kernel_logits, labels_1d, reduction, n_items, inplace, options)[0]
    return loss.view(labels.shape) if reduction == "none" else loss


def _use_kernel(logits, backend):
    """Whether the kernels compute this call. float64 logits never reach them (the kernels compute in float32):
    whatever `backend` says, they go to the plain-torch reference, which computes in float64."""
    if logits.dtype == torch.float64:
        return False
    return backend == "kernel" or (backend == "auto" and logits.is_cuda)


def _in_kernel_dtype(logits):
    if logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    return logits


@torch.compiler.disable
def _vocab_parallel(
    logits, labels, reduction, n_items, inplace_backward, validate_labels, options, backend, process_group, vocab_start
):
    """Eager even under torch.compile (a graph break): the collectives run in the autograd.Function's forward."""
    use_kernel = _use_kernel(logits, backend)
    if use_kernel:
        logits = _in_kernel_dtype(logits)
    if distributed.is_dtensor(logits):
        if validate_labels:
            full_labels = labels.full_tensor() if distributed.is_dtensor(labels) else labels
            _validate_labels(full_labels, logits.shape[-1], options.ignore_index)
        return distributed.dtensor_cross_entropy(
            logits, labels, reduction, n_items, options, use_kernel, process_group, vocab_start
        )
    layout = distributed.layout_of(process_group, vocab_start, logits.shape[-1], logits.device)
    if validate_labels:
        _validate_labels(labels, layout[2], options.ignore_index)
    inplace = bool(inplace_backward) and _is_intermediate(logits)
    return distributed.vocab_parallel_cross_entropy(
        logits, labels, reduction, n_items, inplace, options, layout, use_kernel
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
    ):
        super().__init__()
        if weight is not None:
            raise NotImplementedError("class weights are not supported by fastce")
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

    def forward(self, input, target, n_items=None):
        return cross_entropy(
            input, target, ignore_index=self.ignore_index, reduction=self.reduction, n_items=n_items, **self.options
        )

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items()
        )
