"""Fused cross-entropy for PyTorch: launchers, the eager autograd.Function, torch.library custom ops for
torch.compile, the functional `cross_entropy`, the `CrossEntropyLoss` module, and `cross_entropy_reference` (the
same contract in plain torch).

Eager calls go through `_CrossEntropyFunction`: one forward launch that also reduces "mean"/"sum" in-kernel
(a fixed summation order, no host synchronisation), one backward launch, nothing else on the host's hot path, since
at N=8192, V=32000 the kernels take ~0.4 ms and host-side framework steps would otherwise dominate. Under
torch.compile the custom ops give the compiler opaque per-token ops and the reduction is plain torch arithmetic.
"""

import math

import torch

from . import distributed as _distributed
from . import kernels as _kernels

REDUCTIONS = ("none", "mean", "sum")
BACKENDS = ("auto", "kernel", "reference")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: options between 0 and this are refused

# Tiles and warps from bench/tune_kernels.py on the H200 (2026-11-30, bench/NOTES.md): forward tiles of 4096 with
# 4 warps reached 0.95-1.08x the one-read floor at N=8192 (stages 1 or 3 alike); backward tiles of 2048 with 4 warps
# 1.01-1.05x the read+write floor. Chunks of at most 65536 columns, halved while the grid has under 8192 programs:
# at N=512, V=256000 chunks of 16384 (8192 programs) took 75 us against 90 us for 65536 (2048 programs, 8 warps).
FORWARD_BLOCK, FORWARD_WARPS, FORWARD_WARPS_FEW_PROGRAMS, FORWARD_STAGES = 4096, 4, 8, 3
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4
MAX_CHUNK, TARGET_PROGRAMS, FEW_PROGRAMS = 65536, 8192, 4096
ROWS_PER_GROUP = 64  # rows counted per group before the batch-level count (in-kernel "mean"/"sum")


def _kernels_for(tensor):
    if not tensor.is_cuda and not _kernels.INTERPRETED:
        raise RuntimeError(
            "the Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before "
            "triton is first imported, or use backend='reference'"
        )
    return _kernels


# Plain integer helpers: triton.cdiv / next_power_of_2 go through Triton's jit dispatch (~10 us each on the host).
def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << max(n - 1, 0).bit_length()


def launch_config(n_rows, vocab):
    """(forward tile, warps, chunk width, number of chunks) for an N x V problem."""
    block = min(FORWARD_BLOCK, _next_power_of_2(vocab))
    chunk = max(block, min(MAX_CHUNK, _next_power_of_2(vocab)))
    while chunk > block and n_rows * _cdiv(vocab, chunk) < TARGET_PROGRAMS:
        chunk //= 2
    n_chunks = _cdiv(vocab, chunk)
    warps = FORWARD_WARPS_FEW_PROGRAMS if n_rows * n_chunks < FEW_PROGRAMS and block == FORWARD_BLOCK else FORWARD_WARPS
    return block, warps, chunk, n_chunks


def _flags(logit_scaling, logit_softcapping, label_smoothing, z_loss):
    return dict(
        HAS_SCALING=logit_scaling != 0.0,
        HAS_SOFTCAP=logit_softcapping > 0.0,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_Z_LOSS=z_loss != 0.0,
    )


def forward_kernels(
    logits,
    labels,
    ignore_index,
    logit_softcapping,
    logit_scaling,
    label_smoothing,
    z_loss,
    reduction="none",
    n_items=None,
    vocab_start=0,
    vocab_total=None,
):
    """Per-token float32 (loss, lse) of a 2-D logits (rows may be strided) and 1-D labels, and for "mean"/"sum"
    `reduced` = [loss, denominator] (else None); one launch.

    Vocab-parallel mode (vocab_total given: the logits are columns [vocab_start, vocab_start + V) of a vocabulary of
    vocab_total): per-row float32 (lse over the local columns, transformed label logit where the label is local
    else 0, local sum of z (0 without smoothing)); ignored rows give (-inf, 0, 0). reduction must be "none"."""
    vocab_parallel = vocab_total is not None
    if vocab_parallel and reduction != "none":
        raise ValueError("the vocab-parallel forward returns per-row statistics: reduction must be 'none'")
    n_rows, vocab = logits.shape
    block, warps, chunk, n_chunks = launch_config(n_rows, vocab)
    reduce = reduction != "none"
    # One allocation for every float output: losses, lse, [loss, denominator], the row groups' [loss sums, kept
    # counts] (for "mean"/"sum"), chunk partials.
    n_partials = n_rows * n_chunks if n_chunks > 1 else 1
    n_groups = _cdiv(n_rows, ROWS_PER_GROUP) if reduce else 0
    buffer = torch.empty(2 * n_rows + 2 + 2 * n_groups + 3 * n_partials, dtype=torch.float32, device=logits.device)
    loss, lse, reduced = buffer[:n_rows], buffer[n_rows : 2 * n_rows], buffer[2 * n_rows : 2 * n_rows + 2]
    sum_z = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if vocab_parallel else lse
    group_partials = buffer[2 * n_rows + 2 :]  # the kernel uses its first 2 * n_groups floats
    partials_start = 2 * n_rows + 2 + 2 * n_groups
    partials = [buffer[partials_start + i * n_partials : partials_start + (i + 1) * n_partials] for i in range(3)]
    if n_rows == 0:
        if vocab_parallel:
            return lse, loss, sum_z
        return loss, lse, (reduced.copy_(torch.tensor([0.0, 1.0])) if reduce else None)
    # arrivals[row] counts a row's finished chunks, arrivals[N] the finished groups of ROWS_PER_GROUP rows and
    # arrivals[N + 1 + g] the finished rows of group g.
    n_counters = n_rows + 1 + n_groups if n_chunks > 1 or reduce else 1
    arrivals = torch.zeros(n_counters, dtype=torch.int32, device=logits.device)
    denominator_value, denominator_ptr = 1.0, reduced
    if n_items is None:
        denominator_mode = 0 if reduction == "mean" else 1
    elif isinstance(n_items, torch.Tensor):
        denominator_mode, denominator_ptr = 2, n_items.to(device=logits.device, dtype=torch.float32)
    else:
        denominator_mode, denominator_value = 1, float(n_items)
    _kernels_for(logits)._forward_kernel[(n_rows, n_chunks)](
        logits,
        logits.stride(0),
        labels,
        loss,
        lse,
        sum_z,
        *partials,
        arrivals,
        group_partials,
        reduced,
        denominator_ptr,
        n_rows,
        vocab,
        chunk,
        n_chunks,
        ignore_index,
        logit_scaling,
        logit_softcapping,
        label_smoothing,
        z_loss,
        denominator_value,
        vocab_start,
        BLOCK=block,
        CHUNKS_BLOCK=_next_power_of_2(n_chunks),
        REDUCE=reduce,
        DENOMINATOR=denominator_mode,
        ROWS_BLOCK=1024,
        ROWS_PER_GROUP=ROWS_PER_GROUP,
        VOCAB_PARALLEL=vocab_parallel,
        num_warps=warps,
        num_stages=FORWARD_STAGES,
        **_flags(logit_scaling, logit_softcapping, label_smoothing, z_loss),
    )
    if vocab_parallel:
        return lse, loss, sum_z
    return loss, lse, (reduced if reduce else None)


def backward_kernels(
    grad_loss,
    logits,
    labels,
    lse,
    grad,
    ignore_index,
    logit_softcapping,
    logit_scaling,
    label_smoothing,
    z_loss,
    denominator=None,
    vocab_start=0,
    vocab_total=None,
):
    """Writes d(sum_t grad_loss_t * loss_t / denominator)/d logits into `grad`, which may be `logits` itself.
    grad_loss is per token, or 0-d (one upstream scalar for all tokens); denominator a 1-element tensor or None.
    Vocab-parallel mode (vocab_total given): the logits are columns [vocab_start, vocab_start + V) of vocab_total,
    lse the global logsumexp; labels outside [0, vocab_total) give NaN rows."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return grad
    block = min(BACKWARD_BLOCK, _next_power_of_2(vocab))
    _kernels_for(logits)._backward_kernel[(n_rows, _cdiv(vocab, block))](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        labels,
        lse,
        grad_loss,
        grad_loss.stride(0) if grad_loss.dim() else 0,
        lse if denominator is None else denominator,
        vocab,
        ignore_index,
        logit_scaling,
        logit_softcapping,
        label_smoothing,
        z_loss,
        vocab_start,
        vocab if vocab_total is None else vocab_total,
        BLOCK=block,
        HAS_DENOMINATOR=denominator is not None,
        VOCAB_PARALLEL=vocab_total is not None,
        num_warps=BACKWARD_WARPS,
        **_flags(logit_scaling, logit_softcapping, label_smoothing, z_loss),
    )
    return grad


class _CrossEntropyFunction(torch.autograd.Function):
    """The eager path, reduction included, with the fewest host-side steps: two allocations and one launch
    forward, one launch backward, and no autograd nodes besides this one (each costs host time per step)."""

    @staticmethod
    def forward(ctx, logits, labels, reduction, n_items, inplace_backward, options):
        token_losses, lse, reduced = forward_kernels(logits, labels, *options, reduction=reduction, n_items=n_items)
        ctx.save_for_backward(logits, labels, lse, reduced)
        ctx.inplace_backward, ctx.options = inplace_backward, options
        return token_losses if reduced is None else reduced[0]

    @staticmethod
    def backward(ctx, grad_output):
        logits, labels, lse, reduced = ctx.saved_tensors
        if ctx.inplace_backward:
            grad = logits
            # The logits are about to hold the gradient: any other op that saved them for its own backward then
            # fails loudly ("modified by an inplace operation") instead of reading gradients as logits.
            torch.autograd.graph.increment_version(logits)
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        denominator = None if reduced is None else reduced[1:]
        grad = backward_kernels(grad_output, logits, labels, lse, grad, *ctx.options, denominator=denominator)
        return grad, None, None, None, None, None


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
    loss, lse, _ = forward_kernels(
        logits, labels, ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss
    )
    return loss, lse.clone()  # the two share one buffer; a custom op's outputs must not alias each other


@_forward_op.register_fake
def _(logits, labels, ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss):
    n_rows = logits.shape[0]
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
    return backward_kernels(
        grad_loss, logits, labels, lse, grad, ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss
    )


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
    if not math.isfinite(logit_softcapping) or logit_softcapping < 0:
        raise ValueError(f"logit_softcapping must be >= 0 (0 disables it), got {logit_softcapping}")
    if not math.isfinite(logit_scaling):
        raise ValueError(f"logit_scaling must be finite (0 disables it), got {logit_scaling}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not math.isfinite(z_loss):
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


def _reduce(token_losses, labels, reduction, n_items, ignore_index):
    """The reduction in plain torch (reference and torch.compile paths; the eager kernels reduce in-kernel)."""
    if reduction == "none":
        return token_losses
    if n_items is not None:
        denominator = n_items.to(token_losses.device, torch.float32) if torch.is_tensor(n_items) else float(n_items)
    elif reduction == "mean":
        # At least 1: an all-ignored batch gives 0 with a zero gradient.
        denominator = (labels != ignore_index).sum().clamp_min(1).to(torch.float32)
    else:
        denominator = 1.0
    return token_losses.sum() / denominator


def cross_entropy_reference(
    logits, labels, *, ignore_index=-100, logit_softcapping=0.0, logit_scaling=0.0, label_smoothing=0.0, z_loss=0.0
):
    """Per-token float32 losses of the contract in plain torch (differentiable; used by backend='reference')."""
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    # Ignored rows are zeroed before any arithmetic, so NaN there cannot leak into their (zero) gradient.
    z = torch.where(ignored.unsqueeze(-1), 0.0, logits.float())
    if logit_scaling != 0.0:
        z = z * logit_scaling
    if logit_softcapping > 0.0:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    lse = torch.logsumexp(z, dim=-1)
    z_label = z.gather(-1, torch.where(in_range, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    loss = lse - z_label
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z.mean(dim=-1))
    if z_loss != 0.0:
        loss = loss + z_loss * lse * lse
    loss = torch.where(in_range, loss, float("nan"))
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
):
    """Cross-entropy of logits (..., V) against integer labels (...), fused on the GPU.

    Returns a float32 scalar ("mean", "sum") or per-token losses shaped like labels ("none"). See CONTRACT.md.
    With inplace_backward=True (the default) the backward writes the gradient into the logits' own buffer when
    logits is an intermediate (non-leaf) tensor, so the loss costs no gradient-sized allocation: the logits are
    consumed by backward. Leaf tensors are never overwritten.

    Vocab-parallel (tensor-parallel LM head): with `process_group`, logits (..., V_local) are this rank's contiguous
    slice of the vocabulary and labels (...) global class ids, the same on every rank; the loss (the same on every
    rank) is that of the full logits, each rank's gradient its own columns. The slice starts at `vocab_start`, or,
    when None, at rank * V_local: every rank must then hold the same width (if not, the loss is NaN). A DTensor
    sharded on its last dimension (Shard(-1)) is handled the same way and gives a DTensor (see distributed.py).
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
    vocab = logits.shape[-1]
    options = dict(
        ignore_index=ignore_index,
        logit_softcapping=float(logit_softcapping),
        logit_scaling=float(logit_scaling),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
    )
    use_kernel = backend == "kernel" or (backend == "auto" and logits.is_cuda)
    if use_kernel and logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16 for the kernels, got {logits.dtype}")
    if process_group is not None or _distributed.is_dtensor(logits):
        return _vocab_parallel(
            logits, labels, reduction, n_items, inplace_backward, validate_labels, options, use_kernel, process_group,
            vocab_start,
        )  # fmt: skip
    if validate_labels:
        _validate_labels(labels, vocab, ignore_index)
    if use_kernel:
        logits_2d = logits.reshape(-1, vocab)
        if logits_2d.stride(-1) != 1:
            logits_2d = logits_2d.contiguous()
        labels_1d = labels.reshape(-1).contiguous()
        if not torch.compiler.is_compiling():
            inplace = bool(inplace_backward) and _is_intermediate(logits)
            loss = _CrossEntropyFunction.apply(
                logits_2d, labels_1d, reduction, n_items, inplace, tuple(options.values())
            )
            return loss.view(labels.shape) if reduction == "none" else loss
        token_losses = _forward_op(logits_2d, labels_1d, *options.values())[0].view(labels.shape)
    else:
        token_losses = cross_entropy_reference(logits, labels, **options)
    return _reduce(token_losses, labels, reduction, n_items, ignore_index)


@torch.compiler.disable
def _vocab_parallel(
    logits,
    labels,
    reduction,
    n_items,
    inplace_backward,
    validate_labels,
    options,
    use_kernel,
    process_group,
    vocab_start,
):
    """Eager even under torch.compile (a graph break): the collectives run in the autograd.Function's forward."""
    options = tuple(options.values())
    if _distributed.is_dtensor(logits):
        if validate_labels:
            _validate_labels(labels.full_tensor() if _distributed.is_dtensor(labels) else labels, logits.shape[-1],
                             options[0])  # fmt: skip
        return _distributed.dtensor_cross_entropy(
            logits, labels, reduction, n_items, options, use_kernel, process_group, vocab_start
        )
    if logits.shape[-1] < 1:
        raise ValueError("each rank must hold at least one vocabulary column")
    layout = _distributed.layout_of(process_group, vocab_start, logits.shape[-1], logits.device)
    if validate_labels:
        _validate_labels(labels, layout[2], options[0])
    inplace = bool(inplace_backward) and _is_intermediate(logits)
    return _distributed.vocab_parallel_cross_entropy(
        logits, labels, reduction, n_items, inplace, options, layout, use_kernel
    )


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
        )

    def forward(self, input, target, n_items=None):
        return cross_entropy(
            input, target, ignore_index=self.ignore_index, reduction=self.reduction, n_items=n_items, **self.options
        )

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items()
        )
