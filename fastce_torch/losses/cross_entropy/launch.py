"""The cross-entropy kernels' host side: the tuned constants and launch configurations (`forward_config`,
`backward_config`), the scratch layout, and the launch functions the other layers call (`forward`, `backward`,
`lse_backward`; the vocab-parallel combine's steps in distributed/combine.py build on `forward`).

Rows are addressed as (batch, row) with two strides, so 2-D logits and strided 3-D logits (logits[:, :-1]) reach the
kernels without a copy. The decomposition of a row (chunk width, tile width, warps) depends on V alone, never on N: a
row's loss and gradient are bitwise the same whatever batch it is computed in. Launches go through core/launch.py's
launchers and capture guard.
"""

import functools
from typing import NamedTuple

import torch

from ...core.kernel_helpers import cdiv, next_power_of_2
from ...core.launch import Launcher, checked, guard_capture, on_device, register_launchers
from .backward import backward_kernel
from .forward import forward_kernel

__all__ = [
    "BACKWARD_BLOCK",
    "BACKWARD_WARPS",
    "CHUNK",
    "FORWARD_BLOCK",
    "FORWARD_STAGES",
    "FORWARD_WARPS",
    "GROUPS_BLOCK",
    "ROWS_PER_GROUP",
    "BackwardConfig",
    "ForwardConfig",
    "backward",
    "backward_config",
    "backward_launcher",
    "class_weight_operands",
    "denominator_operands",
    "forward",
    "forward_config",
    "forward_launcher",
    "lse_backward",
    "option_flags",
    "row_layout",
    "rows_overlap",
]


# Tiles and warps from bench/tools/tune.py on the H200 (2026-11-30, bench/NOTES.md): forward tiles of 4096
# with 4 warps reached 0.95-1.08x the one-read floor at N=8192 (stages 1 or 3 alike); backward tiles of 2048 with
# 4 warps 1.01-1.05x the read+write floor. Rows are split into chunks of 16384 columns whatever N is (batch
# invariance): at N=512, V=256000 chunks of 16384 (8192 programs) took 75 us against 90 us for 65536, and at N=8192
# the extra partials are 3 floats per 16384 logits.
FORWARD_BLOCK, FORWARD_WARPS, FORWARD_STAGES = 4096, 4, 3
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4
CHUNK = 16384
ROWS_PER_GROUP = 64  # rows counted per group before the batch-level count (in-kernel "mean"/"sum")
GROUPS_BLOCK = 1024  # groups summed per step by the batch's last group


class ForwardConfig(NamedTuple):
    """The forward kernel's decomposition of a row: tile width, chunk width, number of chunks, warps, stages."""

    block: int
    chunk: int
    n_chunks: int
    warps: int
    stages: int


class BackwardConfig(NamedTuple):
    """The backward kernel's tile width and warps."""

    block: int
    warps: int


@functools.lru_cache(maxsize=1024)
def forward_config(vocab, block=None, chunk=None, warps=None, stages=None):
    """The forward's ForwardConfig at V = vocab; V alone decides (batch invariance). Each setting left None is the
    module's tuned constant (FORWARD_BLOCK, CHUNK, FORWARD_WARPS, FORWARD_STAGES); block and chunk are capped at V
    rounded up to a power of 2. Cached per argument set (the launchers ask on every call): the constants are read
    once per vocab, so a sweep over other settings passes them here or builds its own ForwardConfig and gives it to
    `forward(config=...)` rather than changing the constants."""
    width = next_power_of_2(vocab)
    block = min(FORWARD_BLOCK if block is None else block, width)
    chunk = max(block, min(CHUNK if chunk is None else chunk, width))
    warps = FORWARD_WARPS if warps is None else warps
    return ForwardConfig(block, chunk, cdiv(vocab, chunk), warps, FORWARD_STAGES if stages is None else stages)


@functools.lru_cache(maxsize=1024)
def backward_config(vocab, block=None, warps=None):
    """The backward's BackwardConfig at V = vocab (None: BACKWARD_BLOCK, BACKWARD_WARPS); cached as forward_config."""
    block = min(BACKWARD_BLOCK if block is None else block, next_power_of_2(vocab))
    return BackwardConfig(block, BACKWARD_WARPS if warps is None else warps)


@functools.lru_cache(maxsize=256)
def option_flags(options):
    """The kernels' option constexprs, in their order: HAS_SCALING, HAS_SOFTCAP, HAS_SMOOTHING, HAS_Z_LOSS (cached
    per Options: a pure function of its values, and equal Options give equal flags)."""
    return (
        options.logit_scaling != 0.0,
        options.logit_softcapping > 0.0,
        options.label_smoothing > 0.0,
        options.z_loss != 0.0,
    )


forward_launcher = Launcher(forward_kernel)
backward_launcher = Launcher(backward_kernel)
register_launchers(__name__, "forward_launcher", "backward_launcher")


def row_layout(logits):
    """(batch stride, row stride, rows per batch) of logits viewed as (batch, rows, V) with unit column stride:
    the flat row r is (r // rows per batch, r % rows per batch). Logits (..., V) whose leading dimensions collapse
    into one or two strided dimensions qualify; None otherwise (the caller copies)."""
    if logits.is_contiguous() and logits.numel():  # the common case, without the general walk below
        return 0, logits.shape[-1], logits.numel() // logits.shape[-1]
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return None
    lead, strides = logits.shape[:-1], logits.stride()[:-1]
    # Drop size-1 dimensions (their stride is meaningless), then merge neighbours that are contiguous in each other.
    dims = [(size, stride) for size, stride in zip(lead, strides) if size != 1]
    merged = []
    for size, stride in dims:
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if not merged:
        return 0, logits.shape[-1], max(1, logits.numel() // max(logits.shape[-1], 1))
    if len(merged) == 1:
        return 0, merged[0][1], merged[0][0]
    if len(merged) == 2:
        return merged[0][1], merged[1][1], merged[1][0]
    return None


def rows_overlap(logits):
    """True when two rows of logits share memory (expand, as_strided): the gradient must not be written in place."""
    if logits.is_contiguous():
        return False
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return True
    span = logits.shape[-1]  # elements one row covers
    for size, stride in sorted(
        (d for d in zip(logits.shape[:-1], logits.stride()[:-1]) if d[0] > 1), key=lambda d: d[1]
    ):
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False


@functools.lru_cache(maxsize=1024)
def _scratch_offsets(n_rows, n_chunks, reduce):
    """The forward scratch buffer's layout (see forward): the element offsets of lse, the per-token losses, the
    denominator, the row groups' partials and the chunk partials, the partials' stride and the buffer's size."""
    n_groups = cdiv(n_rows, ROWS_PER_GROUP) if reduce else 0
    n_counters = n_rows + 1 + n_groups if n_chunks > 1 or reduce else 1
    rows_padded = -(-n_rows // 16) * 16
    lse_offset = -(-n_counters // 16) * 16
    token_losses_offset = lse_offset + rows_padded
    denominator_offset = token_losses_offset + (rows_padded if reduce else 0)
    groups_offset = denominator_offset + 16
    partials_offset = groups_offset + -(-2 * n_groups // 16) * 16
    partials_stride = -(-n_rows * n_chunks // 16) * 16 if n_chunks > 1 else 16
    size = partials_offset + 3 * partials_stride
    return lse_offset, token_losses_offset, denominator_offset, groups_offset, partials_offset, partials_stride, size


def forward(
    logits,
    labels,
    options,
    reduction="none",
    n_items=None,
    vocab_start=0,
    vocab_total=None,
    config=None,
    layout=None,
    outputs=False,
    weight=None,
    statistics_out=None,
):
    """One launch: (loss, lse, denominator) of logits (..., V) laid out as `row_layout` allows and flat labels (N,).
    loss is the per-token float32 losses (N,) for reduction "none", else a 0-d tensor of its own (the reduced loss),
    and denominator the 1-element divisor the backward needs for "mean"/"sum" (None for "none").

    Vocab-parallel mode (vocab_total given: the logits are columns [vocab_start, vocab_start + V) of a vocabulary of
    vocab_total): per-row float32 (lse over the local columns, transformed label logit where the label is local
    else 0, local sum of z (0 without smoothing)); ignored rows give (-inf, 0, 0). reduction must be "none".
    config: a ForwardConfig for these logits' V (default forward_config(V)). layout: row_layout(logits), when the
    caller has it already.
    outputs=True: two more results, per row the int32 argmax of the transformed logits (first column on ties) and
    the float32 mean of z under softmax(z) (entropy = lse - it), NaN where ignored; in vocab-parallel mode three:
    the argmax as a global column, the mean of z over the slice's softmax, and the slice's largest z.
    weight: class weights, a float32 contiguous (V,) tensor on the logits' device (`class_weight_operands`), or
    None; not in vocab-parallel mode. statistics_out (vocab-parallel mode): three float32 (N,) tensors that receive
    the lse, label logit and sum of z (`vocab_parallel_statistics`' rows) instead of new ones."""
    vocab_parallel = vocab_total is not None
    if weight is not None and vocab_parallel:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    if vocab_parallel and reduction != "none":
        raise ValueError("the vocab-parallel forward returns per-row statistics: reduction must be 'none'")
    checked(logits)
    vocab = logits.shape[-1]
    n_rows = labels.shape[0]
    # The caller copies logits that have no row layout.
    batch_stride, row_stride, rows_per_batch = row_layout(logits) if layout is None else layout
    block, chunk, n_chunks, warps, stages = forward_config(vocab) if config is None else config
    reduce = reduction != "none"
    device = logits.device
    # The returned loss owns its storage (in-place ops on it are ordinary autograd). Everything else lives in one
    # int32 buffer (one allocation, one fill when counters are used): the int32 arrival counters, which must start at
    # zero, then float32 (the kernel writes every float before reading it) lse, the per-token losses when reduced,
    # the denominator, the row groups' loss sums and kept counts, and the three chunk partials. Only what
    # is returned or read as a tensor gets a view (each costs a tensor object, ~1 us of host time); the kernel finds
    # the rest at element offsets from the buffer. Every piece starts at a multiple of 16 elements, so the pointers
    # keep the buffer's 16-byte alignment and the offsets stay divisible by 16 whatever N is: Triton specialises on
    # both, and a variant per N modulo 16 would mean more compiles and more launch-cache entries.
    # Without chunk partials and without the in-kernel reduction no counter is used (the kernel reads arrivals only
    # under n_chunks > 1 or REDUCE), so the buffer needs no fill: on a GPU that is one fill launch less.
    # arrivals[row] counts a row's finished chunks, arrivals[N] the finished groups of ROWS_PER_GROUP rows and
    # arrivals[N + 1 + g] the finished rows of group g.
    lse_offset, token_losses_offset, denominator_offset, groups_offset, partials_offset, partials_stride, size = (
        _scratch_offsets(n_rows, n_chunks, reduce)
    )
    if statistics_out is None:
        loss = torch.empty(() if reduce else (n_rows,), dtype=torch.float32, device=device)
    else:
        lse_out, loss, sum_z = statistics_out
    rows_padded = -(-n_rows // 16) * 16
    n_partials = 5 if outputs else 3
    outputs_offset = partials_offset + n_partials * partials_stride
    n_outputs = (2 + vocab_parallel) if outputs else 0  # argmax, mean of z (, the slice's largest z)
    if outputs:
        size = outputs_offset + n_outputs * rows_padded
    allocate = torch.zeros if n_chunks > 1 or reduce or outputs else torch.empty
    arrivals = allocate(size, dtype=torch.int32, device=device)
    scratch = arrivals.view(torch.float32)
    lse = scratch[lse_offset : lse_offset + n_rows] if statistics_out is None else lse_out
    if reduce:
        token_losses = scratch[token_losses_offset : token_losses_offset + n_rows]
        denominator = scratch[denominator_offset : denominator_offset + 1]
    else:
        token_losses, denominator = loss, scratch  # the kernel writes no denominator without REDUCE
    if statistics_out is None:
        sum_z = torch.empty(n_rows, dtype=torch.float32, device=device) if vocab_parallel else lse
    if outputs:
        argmax = arrivals[outputs_offset : outputs_offset + n_rows]
        mean_z = scratch[outputs_offset + rows_padded : outputs_offset + rows_padded + n_rows]
        z_max = scratch[outputs_offset + 2 * rows_padded : outputs_offset + 2 * rows_padded + n_rows]
    vocab_parallel_outputs = (argmax, mean_z, z_max) if outputs and vocab_parallel else ()
    if n_rows == 0:
        if vocab_parallel:
            return lse, loss, sum_z, *vocab_parallel_outputs
        if reduce:
            loss.zero_()
            denominator.fill_(1.0)
        return (loss, lse, (denominator if reduce else None)) + ((argmax, mean_z) if outputs else ())
    denominator_mode, denominator_value, n_items_ptr = denominator_operands(reduction, n_items, denominator)
    flags = option_flags(options)
    weight, weight_sum = class_weight_operands(weight, options, lse)
    args = (
        logits,
        batch_stride,
        row_stride,
        rows_per_batch,
        labels,
        token_losses,
        lse,
        sum_z,
        scratch,
        arrivals,
        loss,
        denominator,
        n_items_ptr,
        partials_offset,
        partials_stride,
        groups_offset,
        n_rows,
        vocab,
        chunk,
        n_chunks,
        options.ignore_index,
        options.logit_scaling,
        options.logit_softcapping,
        options.label_smoothing,
        options.z_loss,
        denominator_value,
        vocab_start,
        weight,
        weight_sum,
        block,  # the constexprs, in the kernel's order: BLOCK, CHUNKS_BLOCK, the four flags, REDUCE, ...
        next_power_of_2(n_chunks),
        *flags,
        reduce,
        denominator_mode,
        GROUPS_BLOCK,
        ROWS_PER_GROUP,
        vocab_parallel,
        outputs,
        weight is not lse,
    )
    grid = (n_rows, n_chunks, 1)
    with on_device(logits):
        if not forward_launcher.cached(grid, args, warps, stages):
            guard_capture(
                ("forward", device, logits.dtype, labels.dtype, block, n_chunks > 1, reduce, denominator_mode, *flags)
                + (warps, stages, outputs, weight is not lse),
                logits,
            )
            forward_launcher.launch(grid, args, warps, stages)
    if vocab_parallel:
        return lse, loss, sum_z, *vocab_parallel_outputs
    return (loss, lse, (denominator if reduce else None)) + ((argmax, mean_z) if outputs else ())


def backward(
    grad_loss,
    logits,
    labels,
    lse,
    grad,
    options,
    denominator=None,
    vocab_start=0,
    vocab_total=None,
    config=None,
    weight=None,
    grad_entropy=None,
    mean_z=None,
):
    """Writes d(sum_t grad_loss_t * loss_t / denominator)/d logits into `grad` (the shape of logits; it may be
    `logits` itself). grad_loss is per token (N,), or 0-d (one upstream scalar for all tokens); denominator a
    1-element tensor or None. Vocab-parallel mode (vocab_total given): the logits are columns
    [vocab_start, vocab_start + V) of vocab_total, lse the global logsumexp; labels outside [0, vocab_total) give
    NaN rows. config: a BackwardConfig (default backward_config(V)). weight: class weights as in `forward` (the
    same tensor the forward had; not in vocab-parallel mode).
    grad_entropy, mean_z: the entropy output's gradient as well (the HAS_ENTROPY_GRAD variant, in the same pass):
    both per row (N,), grad_entropy the upstream of each row's entropy H_t (already divided by a "mean" entropy's
    count), mean_z the row's mz = lse - H (the forward's `outputs=True` mean of z; vocab-parallel: the global one);
    adds sum_t grad_entropy_t dH_t/d logits, dH/dz_j = p_j (mz - z_j). Both or neither."""
    if (grad_entropy is None) != (mean_z is None):
        raise ValueError("the entropy gradient needs both grad_entropy and mean_z (per row)")
    if weight is not None and vocab_total is not None:
        raise NotImplementedError("class weights are not supported in vocab-parallel mode")
    checked(logits)
    vocab = logits.shape[-1]
    n_rows = labels.shape[0]
    if n_rows == 0:
        return grad
    batch_stride, row_stride, rows_per_batch = row_layout(logits)
    # In place (grad is the logits), the layout is the same one.
    layout = (batch_stride, row_stride, rows_per_batch) if grad is logits else row_layout(grad)
    grad_batch_stride, grad_row_stride, grad_rows_per_batch = layout
    if (
        grad_rows_per_batch != rows_per_batch
    ):  # one kernel argument splits both: express the one-batch side in the other's
        if grad_batch_stride == 0:
            grad_batch_stride = grad_row_stride * rows_per_batch
        elif batch_stride == 0:
            batch_stride, rows_per_batch = row_stride * grad_rows_per_batch, grad_rows_per_batch
        else:
            raise ValueError("grad and logits split their rows into batches differently")
    block, warps = backward_config(vocab) if config is None else config
    flags = option_flags(options)
    weight, weight_sum = class_weight_operands(weight, options, lse)
    entropy_grad = grad_entropy is not None
    if entropy_grad:  # per-row float32, contiguous: the kernel reads element `row` of each
        grad_entropy = grad_entropy.to(torch.float32).contiguous()
        mean_z = mean_z.to(torch.float32).contiguous()
        if grad_entropy.shape != (n_rows,) or mean_z.shape != (n_rows,):
            raise ValueError(f"grad_entropy and mean_z must have shape ({n_rows},)")
    else:  # placeholders, as for the class weights: the default variant's arguments keep their types
        grad_entropy = mean_z = lse
    args = (
        logits,
        batch_stride,
        row_stride,
        grad,
        grad_batch_stride,
        grad_row_stride,
        rows_per_batch,
        labels,
        lse,
        grad_loss,
        grad_loss.stride(0) if grad_loss.dim() else 0,
        lse if denominator is None else denominator,
        vocab,
        options.ignore_index,
        options.logit_scaling,
        options.logit_softcapping,
        options.label_smoothing,
        options.z_loss,
        vocab_start,
        vocab if vocab_total is None else vocab_total,
        weight,
        weight_sum,
        grad_entropy,
        mean_z,
        block,  # the constexprs, in the kernel's order: BLOCK, the four flags, HAS_DENOMINATOR, VOCAB_PARALLEL, ...
        *flags,
        denominator is not None,
        vocab_total is not None,
        weight is not lse,
        entropy_grad,
    )
    grid = (n_rows, cdiv(vocab, block), 1)
    with on_device(logits):
        if not backward_launcher.cached(grid, args, warps):
            guard_capture(
                (
                    "backward",
                    logits.device,
                    logits.dtype,
                    grad.dtype,
                    grad_loss.dtype,
                    labels.dtype,
                    block,
                    warps,
                    denominator is not None,
                    *flags,
                    weight is not lse,
                    entropy_grad,
                ),
                logits,
            )
            backward_launcher.launch(grid, args, warps)
    return grad


def denominator_operands(reduction, n_items, placeholder):
    """The in-kernel reduction's divisor as the kernels take it: (DENOMINATOR_MODE, its value, the n_items pointer).
    Mode 0 counts the kept tokens ("mean"), 1 divides by the value ("sum": 1, or a number n_items), 2 reads a tensor
    n_items on the device (no host synchronisation); the pointer is `placeholder` (any float32 tensor on the device)
    unless mode 2."""
    if n_items is None:
        return (0 if reduction == "mean" else 1), 1.0, placeholder
    if isinstance(n_items, torch.Tensor):
        return 2, 1.0, n_items.to(device=placeholder.device, dtype=torch.float32)
    return 1, float(n_items), placeholder


def class_weight_operands(weight, options, placeholder):
    """The kernels' (weight, weight sum) pointer arguments: the float32 weights and, with label smoothing, their
    sum as a 1-element device tensor (no host synchronisation). Without weights both are `placeholder`, a tensor
    the launch passes anyway, so the unweighted variant's arguments keep their types and alignment and
    `weight is placeholder` tells the variant apart."""
    if weight is None:
        return placeholder, placeholder
    weight = weight.to(torch.float32).contiguous()
    weight_sum = weight.sum().reshape(1) if options.label_smoothing > 0.0 else weight
    return weight, weight_sum


def lse_backward(grad_lse, logits, labels, lse, grad, options, vocab_total=None, config=None):
    """Writes d(sum_t grad_lse_t * lse_t) / d logits into `grad` (it may be `logits`): the gradient of the
    z_loss output. The backward kernel with neither smoothing nor z-loss and the label placed outside the columns
    (vocab_start = the vocabulary's size), so that no one-hot term is subtracted; bad labels give NaN rows as in
    `backward`. Vocab-parallel (vocab_total given): lse is the global logsumexp, the columns this rank's."""
    vocab = logits.shape[-1] if vocab_total is None else vocab_total
    options = options._replace(label_smoothing=0.0, z_loss=0.0)
    grad_lse = grad_lse.float().contiguous()
    return backward(grad_lse, logits, labels, lse, grad, options, vocab_start=vocab, vocab_total=vocab, config=config)
