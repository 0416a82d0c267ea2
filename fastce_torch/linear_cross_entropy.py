"""Fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)` without the (N, V) logits.

Chunks. The rows are processed in chunks of `rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes, chunk_rows)`
rows: the workspace budget (the `workspace_bytes` keyword, by default `DEFAULT_WORKSPACE_BYTES` = 256 MiB of
logits) split evenly over as few chunks as it allows, rounded up to a multiple of `ROWS_MULTIPLE` (whole matmul
tiles); the `chunk_rows` keyword, when given, overrides it. Per chunk: the logits come from one
matmul into the workspace, fastce's forward kernel gives each row's loss and log-sum-exp (`_ce_forward`), the
backward kernel overwrites the same fresh logits with d loss / d logits (`_ce_backward_in_place`), and two matmuls
fold that into the chunk's rows of d hidden and into d weight (a column sum into d bias). The last chunk is
shorter (a slice of the workspace).

Reductions.
- "mean" / "sum": the gradients are complete after the forward (the denominator is counted on the device first, no
  host synchronisation); the backward only multiplies them by the upstream scalar, and skips even that on the device
  when the scalar is exactly 1. 6·N·H·V flops in all. Gradients are computed only when grad mode is on and an input
  requires one (2·N·H·V flops otherwise).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats.

Ignored rows: by default every row costs its matmuls (an ignored row's logits are computed, then never read).
skip_ignored_rows=True runs the chunks over the kept rows only (their indices by nonzero, each chunk's rows of hidden
gathered, its rows of d hidden written back by index): 6·K·H·V flops for K kept rows, plus K·H copied. cuBLAS takes
its shapes from the host, so the number of kept rows is read there: one synchronisation per call (eager; the
autograd Functions hand the kept rows to the backward that recomputes the logits; under torch.compile that backward's
custom op reads them again). Opt-in, and refused under CUDA-graph capture.

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(accumulate_in_float32=True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.

Autocast: under torch.autocast for the tensors' device type the matmuls run in the autocast dtype, as F.linear's do:
hidden is cast at the entry (through autograd), weight and bias inside the computation (a copy of each), so that a
weight in another dtype (a float32 master weight) has its gradient accumulated in float32 and handed back in its own
dtype. The kernels' own code runs with autocast off.

Sharded heads (the last section of this module): a column-parallel (vocab-parallel) weight, and a DTensor weight
(FSDP2's `fully_shard`, or a tensor-parallel DTensor).

Vocab-parallel (`process_group=`, or hidden a Replicate DTensor with the weight sharded on its rows): each rank
holds the weight rows (and bias entries) of a contiguous slice of the vocabulary, hidden and labels (global ids)
are the same on every rank. The rows are chunked as in linear_cross_entropy; per chunk each rank computes its
logits slice (one matmul), the kernels' vocab-parallel statistics (sharding.shard_statistics), and the two O(rows)
all-reduces of sharding.combine_statistics give every rank the chunk's global logsumexp and loss. For "mean"/"sum"
the chunk's d logits follow at once (the kernels' vocab-parallel backward, in place) and fold into d weight (local,
no communication) and d hidden (this rank's columns' share), as the unsharded loop does; "none" keeps the global
lse (N floats) and recomputes each chunk in the backward. d hidden is then summed over the ranks: one all-reduce of
N x H (inherent to a column-parallel layer, as its input gradient). Nothing weight- or logits-sized is communicated.
Every rank uses the same rows per chunk (from the widest slice), so every rank runs the same collectives. The
return_* outputs' statistics ride on the same combine (sharding.combine_statistics with extras).

DTensor weight with a plain hidden: the data-parallel case of FSDP2 (each rank's hidden and labels are its own
batch): when the LM head is a module of its own under fully_shard and the loss reads `lm_head.weight` without
calling the module, the weight is still the sharded DTensor there. The weight (and a DTensor bias) is gathered
(what FSDP2's unshard does), the unsharded fused loss runs on this rank's rows, and the weight's gradient is
reduce-scattered back to its own placements, averaged over the mesh's ranks as FSDP2 averages its gradients: the
same .grad as calling lm_head(hidden) and cross_entropy under FSDP2. Inside the FSDP2 module's own forward
(lm_head in the root's group, or a call through lm_head) the weight is already a plain tensor and none of this
applies. Treating the sharded rows as a vocabulary split instead would need the same hidden on every rank, which a
data-parallel batch is not, so that reading is reserved for hidden passed as a Replicate DTensor.
"""

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import contract, kernels, sharding
from .contract import Options

# At 256 MiB the workspace holds 1024 rows of bf16 logits at V=128256, 512 at V=256000.
DEFAULT_WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many


class Chunking(NamedTuple):
    """linear_cross_entropy's settings keywords, as the custom ops take them (contract.op_schema)."""

    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    chunk_rows: int | None = None
    accumulate_in_float32: bool = False
    skip_ignored_rows: bool = False


def _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False):
    workspace_bytes = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    for name, value in (("accumulate_in_float32", accumulate_in_float32), ("skip_ignored_rows", skip_ignored_rows)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    return Chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows)


# --- the one place that calls fastce's launchers ----------------------------------------------------------------


def _ce_forward(logits, labels, options, outputs=False, class_weight=None):
    """Per-token float32 (loss, lse) of a 2-D logits chunk; with outputs, also (argmax, mean of z) per row.
    class_weight: class weights (V,) or None, for every launcher call here."""
    loss, lse, _, *statistics = kernels.forward(logits, labels, options, outputs=outputs, weight=class_weight)
    return loss, lse, *statistics


def _ce_backward_in_place(logits, labels, lse, grad_loss, options, denominator=None, class_weight=None):
    """Overwrites `logits` with d(sum_t grad_loss_t * loss_t / denominator) / d logits; grad_loss is per row or 0-d."""
    kernels.backward(grad_loss, logits, labels, lse, logits, options, denominator, weight=class_weight)


def _ce_chunk_backward(logits, labels, lse, grad_loss, grad_lse, options, denominator=None, class_weight=None):
    """Overwrites `logits` with the gradient of sum_t (grad_loss_t * loss_t / denominator + grad_lse_t * lse_t),
    either upstream None for none of it (the z_loss output's gradient comes through lse; grad_lse already holds
    the class weights' factor, so the lse part is unweighted)."""
    if grad_lse is None:
        return _ce_backward_in_place(logits, labels, lse, grad_loss, options, denominator, class_weight)
    if grad_loss is None:
        return kernels.lse_backward(grad_lse, logits, labels, lse, logits, options)
    # Both parts in float32, rounded to the logits' dtype once.
    grad = kernels.lse_backward(grad_lse, logits, labels, lse, torch.empty_like(logits, dtype=torch.float32), options)
    loss_part = torch.empty_like(logits, dtype=torch.float32)
    grad += kernels.backward(grad_loss, logits, labels, lse, loss_part, options, denominator, weight=class_weight)
    logits.copy_(grad)


# --- the chunked computation ------------------------------------------------------------------------------------


def rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes=None, chunk_rows=None):
    """Rows per chunk: chunk_rows when given; else the workspace budget (DEFAULT_WORKSPACE_BYTES when None) split
    evenly over as few chunks as it allows (every chunk nearly full), rounded up to ROWS_MULTIPLE when the budget
    holds that many rows; never more than n_rows, at least 1."""
    if chunk_rows is not None:
        return max(1, min(int(chunk_rows), n_rows))
    workspace_bytes = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    max_rows = max(1, workspace_bytes // (vocab * itemsize))
    multiple = ROWS_MULTIPLE if max_rows >= ROWS_MULTIPLE else 1
    max_rows -= max_rows % multiple
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // max(1, n_chunks))
    rows = -(-rows // multiple) * multiple
    return max(1, min(rows, n_rows))


def _chunk_logits(workspace, hidden_chunk, weight, bias):
    if bias is None:
        torch.matmul(hidden_chunk, weight.t(), out=workspace)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=workspace)
    return workspace


def in_compute_dtype(hidden, weight, bias):
    """weight and bias in hidden's dtype, the one the matmuls run in: a cast copy only under autocast, where the
    (float32 master) weight and bias stay as given so that their gradients are accumulated in their own dtype."""
    # Each no-op .to costs host time (~8 us on the H200 machine): only cast what differs.
    dtype = hidden.dtype
    weight = weight if weight.dtype == dtype else weight.to(dtype)
    return weight, bias if bias is None or bias.dtype == dtype else bias.to(dtype)


def kernel_context(hidden):
    """The kernels' own code runs without gradient tracking and without autocast: its matmuls run exactly in the
    dtype linear_cross_entropy chose (autocast was already applied at its entry). Each context is entered only when
    it changes something (an autograd.Function's forward already runs without grad mode; torch.autocast's context
    alone costs tens of microseconds of host time per call)."""
    device = kernels.on_device(hidden)
    grad_enabled, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled(hidden.device.type)
    if not grad_enabled and not autocast:
        return device  # the usual case inside an autograd.Function: one shared no-op context
    stack = contextlib.ExitStack()
    stack.enter_context(device)
    if grad_enabled:
        stack.enter_context(torch.no_grad())
    if autocast:
        stack.enter_context(torch.autocast(hidden.device.type, enabled=False))
    return stack


def new_grads(hidden, weight, bias, needs, chunking, kept=None):
    need_hidden, need_weight, need_bias = needs
    # With kept rows (skip_ignored_rows) the chunks write only those rows: the ignored ones start at zero.
    new_hidden = torch.empty if kept is None else torch.zeros
    grad_hidden = new_hidden(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
    # Accumulated over chunks: the first chunk's product overwrites them (beta=0: no fill, no read of zeros, a
    # V x H write and read less than starting from zeros), the next ones add (beta=1); when no chunk will run (no
    # rows, or no kept row) they start at zero instead. A weight that is not in the compute dtype (a float32 master
    # weight under autocast) gets a float32 accumulator: its gradient is float32 anyway, and one rounding at the end
    # is more accurate than rounding every chunk to the compute dtype and casting back.
    float32_accumulator = chunking.accumulate_in_float32 or weight.dtype != hidden.dtype
    accumulate_dtype = torch.float32 if float32_accumulator else weight.dtype
    no_chunk = hidden.shape[0] == 0 if kept is None else kept.numel() == 0
    new_accumulator = torch.zeros if no_chunk else torch.empty
    grad_weight = new_accumulator(weight.shape, dtype=accumulate_dtype, device=weight.device) if need_weight else None
    grad_bias = new_accumulator(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
    return grad_hidden, grad_weight, grad_bias


def accumulate_grads(dlogits, hidden_chunk, weight, rows, grads, first):
    """Adds one chunk's products to the gradients; the first chunk processed writes them instead (their storage is
    uninitialised)."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        if isinstance(rows, slice):
            torch.matmul(dlogits, weight, out=grad_hidden[rows])
        else:  # the kept rows' indices (skip_ignored_rows)
            grad_hidden.index_copy_(0, rows, torch.matmul(dlogits, weight))
    if grad_weight is not None:
        # beta=0: torch (and cuBLAS) ignore the uninitialised output's values, NaN included.
        beta = 0 if first else 1
        if grad_weight.dtype == dlogits.dtype:
            grad_weight.addmm_(dlogits.t(), hidden_chunk, beta=beta)
        elif grad_weight.is_cuda:  # the float32 accumulator: cuBLAS takes bf16/fp16 operands with a float32 output
            torch.addmm(grad_weight, dlogits.t(), hidden_chunk, beta=beta, out_dtype=torch.float32, out=grad_weight)
        else:  # the CPU has no mixed-dtype addmm
            grad_weight.addmm_(dlogits.t().float(), hidden_chunk.float(), beta=beta)
    if grad_bias is not None:
        if first:
            torch.sum(dlogits, 0, dtype=torch.float32, out=grad_bias)
        else:
            grad_bias += dlogits.sum(0, dtype=torch.float32)


def finish_grads(grads, weight, bias):
    grad_hidden, grad_weight, grad_bias = grads
    if grad_weight is not None and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None and grad_bias.dtype != bias.dtype:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


SKIP_UNDER_CAPTURE = (
    "fastce_torch.linear_cross_entropy: skip_ignored_rows=True reads the number of kept rows on the host (one "
    "synchronisation), which CUDA-graph capture does not allow; capture the default skip_ignored_rows=False"
)


_FIND = object()  # the kept rows not handed over: the pass finds them (_kept_rows)


def _kept_rows(labels, ignore_index, chunking):
    """skip_ignored_rows: the ascending indices (int64) of the rows whose label is not ignore_index, or None when
    every row is kept or the keyword is off (the plain loop over all rows). cuBLAS matmuls take their shapes from
    the host, so skipping rows needs their number there: nonzero reads it, one host synchronisation."""
    if not chunking.skip_ignored_rows:
        return None
    if labels.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(SKIP_UNDER_CAPTURE)
    kept = torch.nonzero(labels != ignore_index).squeeze(1)
    return None if kept.numel() == labels.numel() else kept


def row_chunks(hidden, weight, bias, labels, chunking, kept=None):
    """Yields (rows, hidden_chunk, labels_chunk, logits, first) chunk by chunk, first True for the first chunk;
    logits is a view of one workspace that the next chunk overwrites. rows is a slice of the rows, or with `kept`
    (_kept_rows) a slice of those indices: the chunks then cover only the kept rows (gathered, a chunk x H copy
    each), so ignored rows cost no matmul."""
    n_rows, vocab = hidden.shape[0] if kept is None else kept.numel(), weight.shape[0]
    step = rows_per_chunk(n_rows, vocab, hidden.element_size(), chunking.workspace_bytes, chunking.chunk_rows)
    workspace = torch.empty(step, vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        rows = slice(start, stop) if kept is None else kept[start:stop]
        hidden_chunk = hidden[rows] if kept is None else hidden.index_select(0, rows)
        logits = _chunk_logits(workspace[: stop - start], hidden_chunk, weight, bias)
        yield rows, hidden_chunk, labels[rows], logits, start == 0


def _per_row(n_rows, kept, fill, dtype, device):
    """A per-row result buffer: every row is written by the chunks, or with kept rows the others hold `fill`, the
    value the forward kernel gives an ignored row (loss 0, lse -inf, argmax 0, mean of z NaN)."""
    if kept is None:
        return torch.empty(n_rows, dtype=dtype, device=device)
    return torch.full((n_rows,), fill, dtype=dtype, device=device)


def chunked_forward(
    hidden,
    weight,
    bias,
    labels,
    options,
    chunking,
    denominator=None,
    needs=(False, False, False),
    outputs=False,
    kept=_FIND,
    class_weight=None,
):
    """Token losses (N,) and lse (N,) of 2-D hidden; with any of `needs` (hidden, weight, bias) also the gradients of
    sum_t loss_t / denominator (a 1-element float32 device tensor) computed chunk by chunk. Returns
    (token_losses, lse, (grad_hidden, grad_weight, grad_bias)), None for gradients not needed; with outputs, then
    also the per-row argmax (int32) and mean of z (the extra outputs' statistics, collected chunk by chunk)."""
    n_rows, device = hidden.shape[0], hidden.device
    with kernel_context(hidden):
        kept = _kept_rows(labels, options.ignore_index, chunking) if kept is _FIND else kept
        weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
        # One chunk over every row (every small call) keeps the kernel's own per-row outputs (no allocation, no
        # copy); otherwise the chunks gather theirs into (token losses, lse[, argmax, mean of z]).
        per_row = None
        step = rows_per_chunk(n_rows, weight.shape[0], hidden.element_size(), *chunking[:2])
        if kept is not None or step < n_rows or n_rows == 0:
            fills = (0.0, -float("inf")) + ((0, float("nan")) if outputs else ())
            kinds = (torch.float32, torch.float32) + ((torch.int32, torch.float32) if outputs else ())
            per_row = [_per_row(n_rows, kept, fill, kind, device) for fill, kind in zip(fills, kinds, strict=True)]
        grads = new_grads(hidden, weight, bias, needs, chunking, kept)
        one = torch.ones((), dtype=torch.float32, device=device) if any(needs) else None
        for rows, hidden_chunk, labels_chunk, logits, first in row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept
        ):
            chunk_outputs = _ce_forward(logits, labels_chunk, options, outputs, class_weight)
            if per_row is None:
                per_row = list(chunk_outputs)
            else:
                for whole, part in zip(per_row, chunk_outputs, strict=True):
                    whole[rows] = part
            if any(needs):
                _ce_backward_in_place(logits, labels_chunk, chunk_outputs[1], one, options, denominator, class_weight)
                accumulate_grads(logits, hidden_chunk, weight_c, rows, grads, first)
        token_losses, lse, *statistics = per_row
        result = token_losses, lse, finish_grads(grads, weight, bias)
        return (*result, *statistics) if outputs else result


def reduced_in_one_chunk(hidden, weight, bias, labels, options, chunking, needs, reduction, n_items):
    """The reduced loss when one chunk holds every row (every small call): the forward kernel also sums the losses
    and counts their divisor, where chunked_forward's caller needs loss_divisor's and the sum's framework ops
    (more host time than a small call's kernels). Returns (loss (0-d), denominator (1,), gradients)."""
    with kernel_context(hidden):
        weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
        grads = new_grads(hidden, weight, bias, needs, chunking)
        workspace = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        logits = _chunk_logits(workspace, hidden, weight_c, bias_c)
        loss, lse, denominator = kernels.forward(logits, labels, options, reduction, n_items)
        if any(needs):
            one = torch.ones((), dtype=torch.float32, device=hidden.device)
            _ce_backward_in_place(logits, labels, lse, one, options, denominator)
            accumulate_grads(logits, hidden, weight_c, slice(None), grads, True)
        return loss, denominator, finish_grads(grads, weight, bias)


def chunked_backward(
    grad_losses,
    hidden,
    weight,
    bias,
    labels,
    lse,
    options,
    chunking,
    needs,
    grad_lse=None,
    kept=_FIND,
    class_weight=None,
):
    """Gradients of sum_t grad_losses_t * loss_t (+ grad_lse_t * lse_t: the z_loss output's), recomputing each
    chunk's logits from hidden and weight; grad_losses None for the lse part alone."""
    # no_grad: under create_graph=True autograd runs backward with grad mode on, and these are kernels and out= ops.
    with kernel_context(hidden):
        if not any(needs):
            return new_grads(hidden, weight, bias, needs, chunking)
        # The forward's kept rows: handed over by the eager Functions, found again (a second synchronisation) by
        # the custom ops' backward.
        kept = _kept_rows(labels, options.ignore_index, chunking) if kept is _FIND else kept
        grads = new_grads(hidden, weight, bias, needs, chunking, kept)
        weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
        for rows, hidden_chunk, labels_chunk, logits, first in row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept
        ):
            if grad_lse is None:
                _ce_backward_in_place(
                    logits, labels_chunk, lse[rows], grad_losses[rows], options, class_weight=class_weight
                )
            else:
                grad_rows = None if grad_losses is None else grad_losses[rows]
                _ce_chunk_backward(
                    logits, labels_chunk, lse[rows], grad_rows, grad_lse[rows], options, class_weight=class_weight
                )
            accumulate_grads(logits, hidden_chunk, weight_c, rows, grads, first)
        return finish_grads(grads, weight, bias)


def _differentiable_grads(grad_rows, hidden, weight, bias, labels, options, needs, grad_lse=None, class_weight=None):
    """The gradients of sum_t grad_rows_t * loss_t in plain torch (F.linear, then the contract's d loss / d logits
    and the two products), so that autograd can differentiate them again (create_graph=True: gradient penalties,
    Hessian-vector products). It materialises the (N, V) logits; only a second-order computation comes here."""
    # Under autocast a float32 master weight meets bf16 hidden here: compute in hidden's dtype, as the kernels did.
    weight = weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if grad_rows is None:
        dlogits = contract.lse_gradient(grad_lse, logits, labels, options)
    else:
        dlogits = contract.logits_gradient(grad_rows, logits, labels, None, options, weight=class_weight)
        dlogits = dlogits.to(logits.dtype)
        if grad_lse is not None:
            dlogits = dlogits + contract.lse_gradient(grad_lse, logits, labels, options)
    need_hidden, need_weight, need_bias = needs
    return (
        dlogits @ weight if need_hidden else None,
        dlogits.t() @ hidden if need_weight else None,
        dlogits.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias else None,
    )


# --- eager autograd -------------------------------------------------------------------------------------------

BACKWARD_TWICE = (
    "fastce_torch.linear_cross_entropy: backward through the same loss twice is not supported (its gradients are "
    "computed in the forward and handed over once); compute the loss again instead of retain_graph=True"
)


class _ReducedFunction(torch.autograd.Function):
    """ "mean"/"sum": the gradients are computed in the forward; backward scales them in place by the upstream
    scalar (nothing else holds them, so the caller's .grad takes them over without a copy)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, denominator, options, chunking, needs, extras=None, class_weight=None,
        reduction=None,
    ):  # fmt: skip
        """denominator: the divisor (1,), or None with reduction = (reduction, n_items) when one chunk holds every
        row (reduced_in_one_chunk: the kernel computes it)."""
        ctx.options, ctx.needs, ctx.extras, ctx.class_weight = options, needs, extras, class_weight
        if extras is not None:
            return _ReducedFunction._forward_outputs(ctx, hidden, weight, bias, labels, denominator, chunking)
        if denominator is None:
            loss, denominator, ctx.grads = reduced_in_one_chunk(
                hidden, weight, bias, labels, options, chunking, needs, *reduction
            )
        else:
            token_losses, _, ctx.grads = chunked_forward(
                hidden, weight, bias, labels, options, chunking, denominator, needs, class_weight=class_weight
            )
            loss = token_losses.sum() / denominator[0]
        # References, no copies: read only by a backward that must be differentiable again.
        ctx.save_for_backward(hidden, weight, bias, labels, denominator)
        return loss

    @staticmethod
    def _forward_outputs(ctx, hidden, weight, bias, labels, denominator, chunking):
        """With the extra outputs: (loss, lse, argmax, mean of z); lse is differentiable for the z_loss output."""
        ctx.kept = _kept_rows(labels, ctx.options.ignore_index, chunking)  # for a backward recomputing the logits
        token_losses, lse, grads, argmax, mean_z = chunked_forward(
            hidden,
            weight,
            bias,
            labels,
            ctx.options,
            chunking,
            denominator,
            ctx.needs,
            outputs=True,
            kept=ctx.kept,
            class_weight=ctx.class_weight,
        )
        ctx.grads, ctx.chunking = grads, chunking
        ctx.save_for_backward(hidden, weight, bias, labels, denominator, lse)
        ctx.mark_non_differentiable(argmax, mean_z, *(() if ctx.extras.z_loss else (lse,)))
        ctx.set_materialize_grads(False)
        return token_losses.sum() / denominator[0], lse, argmax, mean_z

    @staticmethod
    def backward(ctx, grad_loss, *grad_outputs):
        if ctx.extras is not None:
            return _ReducedFunction._backward_outputs(ctx, grad_loss, grad_outputs[0])
        return (*_ReducedFunction._loss_grads(ctx, grad_loss, ctx.saved_tensors), *(None,) * 8)

    @staticmethod
    def _loss_grads(ctx, grad_loss, saved):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients computed in the forward are constants to autograd; these are not.
            hidden, weight, bias, labels, denominator = saved
            grad_rows = (grad_loss.float() / denominator[0]).expand(labels.shape)
            return _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, ctx.needs, class_weight=ctx.class_weight
            )
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(BACKWARD_TWICE)
        if grad_loss.dtype != torch.float32:
            grad_loss = grad_loss.to(torch.float32)
        for grad in grads:
            if grad is not None:
                kernels.scale_unless_one(grad, grad_loss)
        return grads

    @staticmethod
    def _backward_outputs(ctx, grad_loss, grad_lse):
        """The backward with extra outputs: the loss's gradients (computed in the forward) plus, when the z_loss
        output is differentiated, its part (through lse), recomputing each chunk's logits."""
        *saved, lse = ctx.saved_tensors
        hidden, weight, bias, labels, denominator = saved
        nones = (None,) * 8
        if grad_lse is None or not ctx.extras.z_loss:
            if grad_loss is None:
                return (None,) * 3 + nones
            return (*_ReducedFunction._loss_grads(ctx, grad_loss, saved), *nones)
        if torch.is_grad_enabled():
            grad_rows = None if grad_loss is None else (grad_loss.float() / denominator[0]).expand(labels.shape)
            grads = _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, ctx.needs, grad_lse, ctx.class_weight
            )
            return (*grads, *nones)
        lse_grads = chunked_backward(
            None, hidden, weight, bias, labels, lse, ctx.options, ctx.chunking, ctx.needs, grad_lse.detach(), ctx.kept
        )  # unweighted: grad_lse holds the class weights' factor
        if grad_loss is None:
            ctx.grads = None
            return (*lse_grads, *nones)
        loss_grads = _ReducedFunction._loss_grads(ctx, grad_loss, saved)
        grads = [a if b is None else (b if a is None else a + b) for a, b in zip(loss_grads, lse_grads)]
        return (*grads, *nones)


class _PerTokenFunction(torch.autograd.Function):
    """ "none": the forward keeps lse; the backward recomputes the logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, options, chunking, extras=None, class_weight=None):
        ctx.options, ctx.chunking, ctx.extras, ctx.class_weight = options, chunking, extras, class_weight
        ctx.kept = _kept_rows(labels, options.ignore_index, chunking)  # the backward's chunks are the forward's
        if extras is None:
            token_losses, lse, _ = chunked_forward(
                hidden, weight, bias, labels, options, chunking, kept=ctx.kept, class_weight=class_weight
            )
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            return token_losses
        # With the extra outputs: (losses, lse, argmax, mean of z); lse is differentiable for the z_loss output.
        token_losses, lse, _, argmax, mean_z = chunked_forward(
            hidden, weight, bias, labels, options, chunking, outputs=True, kept=ctx.kept, class_weight=class_weight
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.mark_non_differentiable(argmax, mean_z, *(() if extras.z_loss else (lse,)))
        ctx.set_materialize_grads(False)
        return token_losses, lse, argmax, mean_z

    @staticmethod
    def backward(ctx, grad_losses, *grad_outputs):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_lse = grad_outputs[0] if grad_outputs and ctx.extras.z_loss else None
        if grad_losses is None and grad_lse is None:
            return (None,) * 8
        if torch.is_grad_enabled():  # create_graph=True: a gradient that autograd can differentiate again
            grad_rows = None if grad_losses is None else grad_losses.float()
            grads = _differentiable_grads(
                grad_rows, hidden, weight, bias, labels, ctx.options, needs, grad_lse, ctx.class_weight
            )
            return (*grads, None, None, None, None, None)
        grad_losses = None if grad_losses is None else grad_losses.detach().contiguous()
        grad_lse = None if grad_lse is None else grad_lse.detach()
        grads = chunked_backward(
            grad_losses,
            hidden,
            weight,
            bias,
            labels,
            lse,
            ctx.options,
            ctx.chunking,
            needs,
            grad_lse,
            ctx.kept,
            ctx.class_weight,
        )
        return (*grads, None, None, None, None, None)


# --- custom ops for torch.compile -----------------------------------------------------------------------------
# A custom op cannot return None: gradients that are not needed come back as empty tensors. Each op takes, after its
# tensors, the fields of Options, of Chunking and of _Needs, spelled out once by contract.op_schema.


class _Needs(NamedTuple):
    need_hidden: bool
    need_weight: bool
    need_bias: bool


_SETTINGS = ", ".join(contract.op_schema(record) for record in (Options, Chunking, _Needs))
_N_SETTINGS = len(Options._fields) + len(Chunking._fields) + len(_Needs._fields)


def _settings(settings):
    """(Options, Chunking, needs) from an op's trailing scalars."""
    n_options, n_chunking = len(Options._fields), len(Chunking._fields)
    chunking = Chunking(*settings[n_options : n_options + n_chunking])
    return Options(*settings[:n_options]), chunking, tuple(settings[n_options + n_chunking :])


def _split_class_weight(settings):
    """(the op's trailing scalars, its class weights or None): the ops take `Tensor? class_weight=None` last; a
    trailing tensor or None is that argument (the scalars before it are ints, floats and bools)."""
    if settings and (settings[-1] is None or isinstance(settings[-1], torch.Tensor)):
        return tuple(settings[:-1]), settings[-1]
    return tuple(settings), None


def _or_empty(tensor, like):
    return like.new_empty(0) if tensor is None else tensor


def _fake_grads(hidden, weight, bias, needs):
    """The gradients' shapes and dtypes for the compiler (an empty stand-in where one is not needed)."""
    need_hidden, need_weight, need_bias = needs
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
        hidden.new_empty((weight.shape[0],) if need_bias else (0,), dtype=bias.dtype if need_bias else hidden.dtype),
    )


@torch.library.custom_op(
    "fastce::linear_cross_entropy_reduced",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor denominator, "
    f"{_SETTINGS}, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _reduced_op(hidden, weight, bias, labels, denominator, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings)
    token_losses, _, grads = chunked_forward(
        hidden, weight, bias, labels, options, chunking, denominator, needs, class_weight=class_weight
    )
    loss = token_losses.sum() / denominator[0]
    return (loss, *(_or_empty(grad, hidden) for grad in grads))


@_reduced_op.register_fake
def _(hidden, weight, bias, labels, denominator, *settings):
    needs = _settings(_split_class_weight(settings)[0])[2]
    return (hidden.new_empty((), dtype=torch.float32), *_fake_grads(hidden, weight, bias, needs))


def _reduced_setup_context(ctx, inputs, output):
    ctx.needs = _settings(_split_class_weight(inputs[5:])[0])[2]
    ctx.save_for_backward(*output[1:])


def _reduced_backward(ctx, grad_loss, *unused_grads_of_grads):
    # Out of place under the compiler (it plans that memory itself); eager scales in place.
    # Exact zeros stay zero whatever the factor, as the eager scale kernel keeps them.
    grads = [
        torch.where(g == 0, 0, g * grad_loss.to(g.dtype)) if need else None
        for g, need in zip(ctx.saved_tensors, ctx.needs)
    ]
    return (*grads, None, None, *[None] * (_N_SETTINGS + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_reduced", _reduced_backward, setup_context=_reduced_setup_context
)


@torch.library.custom_op(
    "fastce::linear_cross_entropy_forward",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"{contract.op_schema(Options)}, {contract.op_schema(Chunking)}, Tensor? class_weight=None) -> (Tensor, Tensor)",
)
def _per_token_forward_op(hidden, weight, bias, labels, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, _ = _settings(settings)
    token_losses, lse, _ = chunked_forward(hidden, weight, bias, labels, options, chunking, class_weight=class_weight)
    return token_losses, lse


@_per_token_forward_op.register_fake
def _(hidden, weight, bias, labels, *settings):
    n_rows = hidden.shape[0]
    return hidden.new_empty(n_rows, dtype=torch.float32), hidden.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op(
    "fastce::linear_cross_entropy_backward",
    mutates_args=(),
    schema="(Tensor grad_losses, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor lse, "
    f"{_SETTINGS}, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor)",
)
def _per_token_backward_op(grad_losses, hidden, weight, bias, labels, lse, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings)
    grads = chunked_backward(
        grad_losses.contiguous(), hidden, weight, bias, labels, lse, options, chunking, needs, None, class_weight
    )
    return tuple(_or_empty(grad, hidden) for grad in grads)


@_per_token_backward_op.register_fake
def _(grad_losses, hidden, weight, bias, labels, lse, *settings):
    return _fake_grads(hidden, weight, bias, _settings(_split_class_weight(settings)[0])[2])


def _per_token_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, *settings = inputs
    ctx.settings, ctx.class_weight = _split_class_weight(settings)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])


def _per_token_backward(ctx, grad_losses, unused_grad_lse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    grads = _per_token_backward_op(
        grad_losses, hidden, weight, bias, labels, lse, *ctx.settings, *needs, ctx.class_weight
    )
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads, None, *[None] * (len(ctx.settings) + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_forward", _per_token_backward, setup_context=_per_token_setup_context
)


# With the extra outputs (any return_* keyword) under torch.compile every reduction takes the per-token ops below
# (the reduction in plain torch, the backward recomputing each chunk's logits): one op pair instead of a reduced
# variant of each.
@torch.library.custom_op(
    "fastce::linear_cross_entropy_forward_outputs",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"{contract.op_schema(Options)}, {contract.op_schema(Chunking)}, bool z_grad, Tensor? class_weight=None) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
)
def _outputs_forward_op(hidden, weight, bias, labels, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, _ = _settings(settings[:-1])
    token_losses, lse, _, argmax, mean_z = chunked_forward(
        hidden, weight, bias, labels, options, chunking, outputs=True, class_weight=class_weight
    )
    return token_losses, lse, argmax, mean_z


@_outputs_forward_op.register_fake
def _(hidden, weight, bias, labels, *settings):
    n_rows = hidden.shape[0]
    floats = [hidden.new_empty(n_rows, dtype=torch.float32) for _ in range(3)]
    return floats[0], floats[1], hidden.new_empty(n_rows, dtype=torch.int32), floats[2]


@torch.library.custom_op(
    "fastce::linear_cross_entropy_backward_outputs",
    mutates_args=(),
    schema="(Tensor grad_losses, Tensor grad_lse, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"Tensor lse, {_SETTINGS}, bool z_grad, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor)",
)
def _outputs_backward_op(grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings):
    settings, class_weight = _split_class_weight(settings)
    options, chunking, needs = _settings(settings[:-1])
    grad_lse = grad_lse.contiguous() if settings[-1] else None
    grads = chunked_backward(
        grad_losses.contiguous(), hidden, weight, bias, labels, lse, options, chunking, needs, grad_lse, class_weight
    )
    return tuple(_or_empty(grad, hidden) for grad in grads)


@_outputs_backward_op.register_fake
def _(grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings):
    return _fake_grads(hidden, weight, bias, _settings(_split_class_weight(settings)[0][:-1])[2])


def _outputs_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, *settings = inputs
    ctx.settings, ctx.class_weight = _split_class_weight(settings)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])
    ctx.mark_non_differentiable(output[2], output[3])


def _outputs_backward(ctx, grad_losses, grad_lse, *unused):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    *settings, z_grad = ctx.settings
    if grad_losses is None:
        grad_losses = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse, z_grad = lse, False
    grads = _outputs_backward_op(
        grad_losses, grad_lse, hidden, weight, bias, labels, lse, *settings, *needs, z_grad, ctx.class_weight
    )
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads, None, *[None] * (len(ctx.settings) + 1))


torch.library.register_autograd(
    "fastce::linear_cross_entropy_forward_outputs", _outputs_backward, setup_context=_outputs_setup_context
)


# --- the function -----------------------------------------------------------------------------------------------


# float64 is accepted as in cross_entropy: computed in float64 by the plain-torch reference, whatever the backend.
LINEAR_DTYPES = (*contract.KERNEL_DTYPES, torch.float64)


def _check_tensors(hidden, weight, bias, labels):
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in LINEAR_DTYPES:
            got = getattr(tensor, "dtype", type(tensor))
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {got}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., H)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H = hidden.shape[-1] (nn.Linear's layout): hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have a vocabulary dimension of at least 1")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be None or a (V,) = ({weight.shape[0]},) tensor, got {bias!r:.80}")
        if bias.dtype not in LINEAR_DTYPES:
            raise TypeError(f"bias must be float32, bfloat16, float16 or float64, got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden on {hidden.device}")
    contract.check_labels(labels, "hidden", hidden.shape, hidden.device)


def _common_dtype(hidden, weight, bias):
    """Mixed dtypes compute in their promoted dtype (as jnp.result_type does in fastce_jax): the narrower tensors are
    cast, a copy of each, and autograd hands each gradient back in its own tensor's dtype."""
    dtype = hidden.dtype if bias is None else torch.promote_types(hidden.dtype, bias.dtype)
    dtype = torch.promote_types(dtype, weight.dtype)
    return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in (hidden, weight, bias))


def autocast_or_common_dtype(hidden, weight, bias):
    """Under torch.autocast for the tensors' device type the matmuls run in the autocast dtype, as F.linear's do:
    hidden is cast (through autograd, so its gradient comes back in its own dtype, as F.linear's would); weight and
    bias are cast inside the computation instead, and their gradients accumulated and handed back in their own
    dtype. float64 is not autocast-eligible (torch leaves it alone) and keeps the promotion rule. Without autocast,
    mixed dtypes compute in their promoted dtype (_common_dtype)."""
    device_type = hidden.device.type
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if not torch.is_autocast_enabled(device_type) or any(t.dtype == torch.float64 for t in tensors):
        return _common_dtype(hidden, weight, bias)
    return hidden.to(torch.get_autocast_dtype(device_type)), weight, bias


def linear_cross_entropy(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    validate_labels=False,
    shift=0,
    workspace_bytes=None,
    chunk_rows=None,
    accumulate_in_float32=False,
    skip_ignored_rows=False,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    process_group=None,
    vocab_start=None,
    class_weight=None,
):
    """fastce_torch.cross_entropy(hidden @ weight.T + bias, labels, ...) without ever allocating the logits.

    hidden (..., H), weight (V, H) as nn.Linear / lm_head store it, bias (V,) or None, labels (...) int32/int64;
    hidden, weight and bias are float32, bfloat16, float16 or float64 on one device; mixed dtypes compute in the
    promoted dtype (a cast copy of the narrower ones), each gradient in its own tensor's dtype; a float64 promoted
    dtype is computed in float64 by plain torch, whatever `backend` says. Every keyword is cross_entropy's
    (CONTRACT.md). Returns a float32 scalar ("mean", "sum") or per-token losses shaped like labels ("none"), float64
    when computed in float64. backend: "auto" = the chunked kernels for CUDA tensors, plain torch (matmul + the
    reference loss) elsewhere; "kernel" = the chunked kernels always (CPU: Triton's interpreter); "reference" =
    plain torch.

    For "mean"/"sum" with gradients enabled the gradients are computed during the forward (see the module
    docstring), so a second backward through the same loss (retain_graph=True) raises.

    shift=k (True = 1): cross_entropy's, along hidden's second-to-last (the sequence) dimension: the loss of
    `linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])` without slicing (or copying) hidden.

    Chunking (the kernels only; neither changes the loss beyond rounding): `workspace_bytes` bounds the chunk of
    logits materialised at a time (None: DEFAULT_WORKSPACE_BYTES = 256 MiB), `chunk_rows` (an int) forces the rows
    per chunk whatever the budget; `accumulate_in_float32=True` sums a bf16/fp16 weight's gradient over the chunks
    in a float32 accumulator (one rounding instead of one per chunk, 4·V·H more bytes).

    skip_ignored_rows=True (the kernels only): the chunks cover only the rows whose label is not ignore_index
    (gathered chunk by chunk, a copy of their rows of hidden), so ignored rows (padding, prompt tokens) cost no
    matmul work: 6·K·H·V flops for K kept rows instead of 6·N·H·V. The same loss and gradients (d hidden exactly 0
    on ignored rows), every output in the original order. It reads the number of kept rows on the host: one
    synchronisation per call (under torch.compile a backward that recomputes the logits, "none" or a
    differentiated z_loss output, reads it again inside its custom op), so it raises under CUDA-graph capture.
    Off by default: the default path never synchronises.

    return_z_loss, return_lse, return_accuracy, return_entropy: as cross_entropy's (CrossEntropyOutput), collected
    chunk by chunk from the same forward kernels. Differentiating the z_loss output recomputes each chunk's logits
    in the backward. Under torch.compile any of them sends "mean"/"sum" through the per-token ops (the backward
    recomputes the logits: 8·N·H·V flops instead of 6).

    Sharded heads (this module's last section): with `process_group`, weight (V_local, H) and bias (V_local,) are this
    rank's rows of a column-parallel head, a contiguous slice of the vocabulary starting at `vocab_start` (None:
    rank * V_local, every rank the same width), hidden and labels (global ids) the same on every rank; O(N)
    communication per call plus the all-reduce of d hidden. A DTensor weight (FSDP2's fully_shard) with a plain
    hidden: this rank's rows against the gathered weight, the weight's gradient reduce-scattered (averaged) back to
    its placements as FSDP2 does. hidden a Replicate DTensor with a Shard(0) weight: vocab-parallel over the mesh.

    class_weight: class weights (V,), cross_entropy's `weight=` (the positional `weight` is the LM head here), in
    every chunk's kernels; "mean" divides by the kept tokens' summed class weights (on the device).
    """
    _check_tensors(hidden, weight, bias, labels)
    sharded = (
        process_group is not None or vocab_start is not None or any(map(sharding.is_dtensor, (hidden, weight, bias)))
    )
    if sharded and class_weight is not None:
        raise NotImplementedError(
            "fastce_torch.linear_cross_entropy: class_weight with a sharded head (process_group=, vocab_start= or a "
            "DTensor weight) is not supported; call it without class_weight, or gather the head and call it unsharded"
        )
    class_weight = contract.check_class_weight(class_weight, weight.shape[0], hidden.device, "class_weight")
    options = contract.check_options(
        ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss, backend
    )
    chunking = _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows)
    extras = contract.check_extras(return_z_loss, return_lse, return_accuracy, return_entropy)
    kept = None
    if shift := contract.check_shift(shift, labels):
        labels, kept = contract.shifted_labels(labels, shift, ignore_index)
    if sharded:
        loss = sharded_linear_cross_entropy(
            hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, validate_labels,
            process_group, vocab_start,
        )  # fmt: skip
        if isinstance(loss, contract.CrossEntropyOutput):
            return contract.unshifted(loss, kept, reduction)
        return loss[..., :kept] if kept is not None and reduction == "none" else loss
    if validate_labels:
        contract.validate_labels(labels, weight.shape[0], ignore_index)
    if any(extras):
        output = unsharded_outputs(
            hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, class_weight
        )
        return contract.unshifted(output, kept, reduction)
    loss = unsharded_loss(hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight)
    return loss[..., :kept] if kept is not None and reduction == "none" else loss


def unsharded_outputs(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, class_weight=None
):
    """linear_cross_entropy with extra outputs: CrossEntropyOutput."""
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    vocab = weight.shape[0]
    if not contract.use_kernel(hidden, backend):
        logits = torch.nn.functional.linear(hidden, weight, bias)
        token_losses = contract.reference_token_losses(logits, labels, options, class_weight)
        loss = contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
        return contract.reference_outputs(logits, labels, options, extras, reduction, n_items, loss, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        token_losses, lse, argmax, mean_z = _outputs_forward_op(
            hidden_2d, weight, bias, labels_1d, *options, *chunking, extras.z_loss, class_weight
        )
        loss = contract.reduce_losses(
            token_losses.view(labels.shape), labels, reduction, n_items, ignore_index, class_weight
        )
    elif reduction == "none":
        token_losses, lse, argmax, mean_z = _PerTokenFunction.apply(
            hidden_2d, weight, bias, labels_1d, options, chunking, extras, class_weight
        )
        loss = token_losses.view(labels.shape)
    else:
        needs = gradients_needed(hidden, weight, bias)
        denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
        loss, lse, argmax, mean_z = _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, extras, class_weight
        )
    return contract.extra_outputs(
        loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, vocab, class_weight
    )


def gradients_needed(hidden, weight, bias):
    """Which of (hidden, weight, bias) the computation owes a gradient."""
    grad_enabled = torch.is_grad_enabled()
    return (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )


def unsharded_loss(hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, class_weight=None):
    ignore_index = options.ignore_index
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    if not contract.use_kernel(hidden, backend):
        token_losses = contract.reference_token_losses(
            torch.nn.functional.linear(hidden, weight, bias), labels, options, class_weight
        )
        return contract.reduce_losses(token_losses, labels, reduction, n_items, ignore_index, class_weight)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        if compiling:
            token_losses = _per_token_forward_op(hidden_2d, weight, bias, labels_1d, *options, *chunking, class_weight)[
                0
            ]
        else:
            token_losses = _PerTokenFunction.apply(
                hidden_2d, weight, bias, labels_1d, options, chunking, None, class_weight
            )
        return token_losses.view(labels.shape)
    needs = gradients_needed(hidden, weight, bias)
    n_rows = hidden_2d.shape[0]
    one_chunk = 0 < n_rows <= rows_per_chunk(n_rows, weight.shape[0], hidden.element_size(), *chunking[:2])
    if not compiling and one_chunk and class_weight is None and not chunking.skip_ignored_rows:
        return _ReducedFunction.apply(
            hidden_2d, weight, bias, labels_1d, None, options, chunking, needs, None, None, (reduction, n_items)
        )
    denominator = contract.loss_divisor(labels_1d, reduction, n_items, ignore_index, weight=class_weight).reshape(1)
    if compiling:
        return _reduced_op(hidden_2d, weight, bias, labels_1d, denominator, *options, *chunking, *needs, class_weight)[
            0
        ]
    return _ReducedFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, None, class_weight
    )


# --- sharded heads ------------------------------------------------------------------------------------------

_VERIFIED_WIDTHS = set()  # (group, rank, width) whose rank * width layout the ranks' gathered slices confirmed


def _layout(group, vocab_start, width, device):
    """(group, vocab_start, vocab_total, widest slice). Without vocab_start the slices start at rank * width; the
    first call for a (group, width) checks that every rank holds that width (one gather of O(world) integers, then
    remembered), since unequal widths would give the ranks different chunk counts and so different collectives.
    An explicit vocab_start gathers the slices every call (a host synchronisation), as cross_entropy does."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised (init_process_group)")
    if vocab_start is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        key = (id(group), rank, width)
        if key not in _VERIFIED_WIDTHS:
            try:  # rank * width tiles [0, V) exactly when every width is the same
                sharding.gathered_slices(group, rank * width, width, device)
            except ValueError as error:
                raise ValueError(
                    "linear_cross_entropy with process_group: without vocab_start every rank must hold the same "
                    "number of weight rows (pass vocab_start= for unequal slices)"
                ) from error
            _VERIFIED_WIDTHS.add(key)
        return group, rank * width, world * width, width
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    slices = sharding.gathered_slices(group, vocab_start, width, device)
    return group, vocab_start, slices[-1][0], max(w for _, w in slices[:-1])


def _sum_over_ranks(tensor, group):
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _chunk_gradient(grad_rows, denominator, logits, labels, lse, options, layout, use_kernel, grad_lse=None):
    """Overwrites the chunk's local logits with d(loss, and lse where grad_lse is given) / d logits of its columns
    (no communication): the loss's with grad_rows (None: none), the lse's (the z_loss output's) with grad_lse."""
    group, vocab_start, vocab_total, _ = layout
    if grad_lse is None:
        sharding.shard_gradient(
            grad_rows, denominator, logits, labels, lse, logits, options, vocab_start, vocab_total, use_kernel
        )
        return
    # Both parts in float32, rounded to the logits' dtype once.
    grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if use_kernel:
        kernels.lse_backward(grad_lse, logits, labels, lse, grad, options, vocab_total=vocab_total)
    else:
        lse_options = options._replace(label_smoothing=0.0, z_loss=0.0)
        grad.copy_(
            contract.logits_gradient(grad_lse.to(lse.dtype), logits, labels, lse, lse_options, vocab_total, vocab_total)
        )
    if grad_rows is not None:
        loss_part = torch.empty_like(grad)
        sharding.shard_gradient(
            grad_rows, denominator, logits, labels, lse, loss_part, options, vocab_start, vocab_total, use_kernel
        )
        grad += loss_part
    logits.copy_(grad)


def _recomputed_grads(hidden, weight, bias, labels, lse, grad_losses, grad_lse, needs, ctx):
    """The gradients of sum_t (grad_losses_t loss_t + grad_lse_t lse_t) (either None for none of it), each chunk's
    logits recomputed; d hidden summed over the ranks."""
    with kernel_context(hidden):
        grads = new_grads(hidden, weight, bias, needs, ctx.chunking)
        if any(needs):
            weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
            for rows, hidden_chunk, labels_chunk, logits, first in row_chunks(
                hidden, weight_c, bias_c, labels, ctx.chunking
            ):
                _chunk_gradient(
                    None if grad_losses is None else grad_losses[rows], None, logits, labels_chunk, lse[rows],
                    ctx.options, ctx.layout, ctx.use_kernel, None if grad_lse is None else grad_lse[rows],
                )  # fmt: skip
                accumulate_grads(logits, hidden_chunk, weight_c, rows, grads, first)
        grads = finish_grads(grads, weight, bias)
        if grads[0] is not None:
            _sum_over_ranks(grads[0], ctx.layout[0])
    return grads


class _VocabParallelLinearFunction(torch.autograd.Function):
    """hidden (N, H) replicated, weight (V_local, H) and bias (V_local,) this rank's rows, labels (N,) global. With
    extras (the return_* outputs): (loss, lse, argmax, mean of z), lse differentiable for the z_loss output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, options, chunking, needs, layout, use_kernel, extras):
        group, vocab_start, vocab_total, widest = layout
        reduced = denominator is not None
        grad_now = needs if reduced else (False, False, False)
        outputs = extras is not None
        n_rows = hidden.shape[0]
        dtype = contract.compute_dtype(hidden.dtype)
        with_sum_z = options.label_smoothing > 0.0
        # The same rows per chunk on every rank (from the widest slice): the ranks' collectives pair up.
        step = rows_per_chunk(n_rows, widest, hidden.element_size(), chunking.workspace_bytes, chunking.chunk_rows)
        chunking = chunking._replace(chunk_rows=step)
        with kernel_context(hidden):
            weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
            token_losses = torch.zeros(n_rows, dtype=dtype, device=hidden.device)
            lse = torch.full((n_rows,), float("-inf"), dtype=dtype, device=hidden.device)
            if outputs:
                argmax = torch.zeros(n_rows, dtype=torch.int64, device=hidden.device)
                mean_z = torch.zeros(n_rows, dtype=dtype, device=hidden.device)
            grads = new_grads(hidden, weight, bias, grad_now, chunking)
            one = torch.ones((), dtype=torch.float32, device=hidden.device)
            for rows, hidden_chunk, labels_chunk, logits, first in row_chunks(
                hidden, weight_c, bias_c, labels, chunking
            ):
                lse_local, z_label, sum_z, *local_extras = sharding.shard_statistics(
                    logits, labels_chunk, options, vocab_start, vocab_total, use_kernel, outputs
                )
                chunk_lse, z_label, sum_z, *chunk_extras = sharding.combine_statistics(
                    lse_local, z_label, sum_z, group, logits.shape[-1], False, with_sum_z,
                    local_extras if outputs else None, vocab_total,
                )  # fmt: skip
                token_losses[rows] = contract.token_loss_from_statistics(
                    chunk_lse, z_label, sum_z, labels_chunk, options, vocab_total
                )
                lse[rows] = chunk_lse
                if outputs:
                    argmax[rows], mean_z[rows] = chunk_extras
                if any(grad_now):
                    _chunk_gradient(one, denominator, logits, labels_chunk, chunk_lse, options, layout, use_kernel)
                    accumulate_grads(logits, hidden_chunk, weight_c, rows, grads, first)
            grads = finish_grads(grads, weight, bias)
            if grads[0] is not None:
                _sum_over_ranks(grads[0], group)
        ctx.options, ctx.chunking, ctx.layout, ctx.use_kernel = options, chunking, layout, use_kernel
        ctx.grads = grads if reduced else None
        ctx.reduced, ctx.extras = reduced, extras
        loss = token_losses.sum() / denominator if reduced else token_losses
        if not reduced or (outputs and extras.z_loss):
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        if not outputs:
            return loss
        ctx.mark_non_differentiable(argmax, mean_z, *(() if extras.z_loss else (lse,)))
        ctx.set_materialize_grads(False)
        return loss, lse, argmax, mean_z

    @staticmethod
    def backward(ctx, grad_output, *grad_extras):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "create_graph=True through a vocab-parallel linear_cross_entropy is not supported"
            )
        nones = (None,) * 8
        grad_lse = grad_extras[0] if grad_extras and ctx.extras.z_loss else None
        grad_lse = None if grad_lse is None else grad_lse.detach().contiguous()
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        if ctx.reduced:
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError(BACKWARD_TWICE)
            if grad_output is not None:
                factor = grad_output.detach().to(torch.float32)
                for grad in grads:
                    if grad is not None:
                        if ctx.use_kernel:
                            kernels.scale_unless_one(grad, factor)
                        else:
                            grad.mul_(factor.to(grad.dtype))
            else:
                grads = (None, None, None)
            if grad_lse is None:
                return (*grads, *nones)
            hidden, weight, bias, labels, lse = ctx.saved_tensors
            needs = (needs[0], needs[1], bias is not None and needs[2])
            lse_grads = _recomputed_grads(hidden, weight, bias, labels, lse, None, grad_lse, needs, ctx)
            grads = [a if b is None else (b if a is None else a + b) for a, b in zip(grads, lse_grads)]
            return (*grads, *nones)
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        needs = (needs[0], needs[1], bias is not None and needs[2])
        if grad_output is None and grad_lse is None:
            return (None,) * 3 + nones
        grad_losses = None if grad_output is None else grad_output.detach().contiguous().to(lse.dtype)
        grads = _recomputed_grads(hidden, weight, bias, labels, lse, grad_losses, grad_lse, needs, ctx)
        return (*grads, *nones)


def vocab_parallel_linear_cross_entropy(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, layout, extras=None
):
    """hidden (..., H) and labels (...) the same on every rank, weight (V_local, H) and bias (V_local,) this rank's
    rows; the loss of the full head on every rank (with extras, a contract.Extras asking for some:
    CrossEntropyOutput)."""
    hidden, weight, bias = autocast_or_common_dtype(hidden, weight, bias)
    use_kernel = contract.use_kernel(hidden, backend)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    needs = gradients_needed(hidden, weight, bias)
    # Labels are the same on every rank, so the local kept-token count is the global one.
    denominator = contract.loss_divisor(labels_1d, reduction, n_items, options.ignore_index)
    out = _VocabParallelLinearFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, layout, use_kernel, extras
    )
    if extras is None:
        return out.view(labels.shape) if reduction == "none" else out
    loss, lse, argmax, mean_z = out
    loss = loss.view(labels.shape) if reduction == "none" else loss
    return contract.extra_outputs(loss, lse, argmax, mean_z, labels, options, extras, reduction, n_items, layout[2])


# --- DTensor weights -------------------------------------------------------------------------------------------


class _Gathered(torch.autograd.Function):
    """A DTensor (Shard / Replicate placements) as the full plain tensor on every rank; the backward hands each
    rank's full gradient back in the DTensor's placements, averaged over the mesh (FSDP2's reduce-scatter, with an
    all-reduce over replicated mesh dimensions as HSDP has)."""

    @staticmethod
    def forward(ctx, tensor):
        from torch.distributed.tensor import Replicate

        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        ctx.spec = mesh, placements, tensor.shape, tensor.stride()
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor, Partial

        mesh, placements, shape, stride = ctx.spec
        partial = DTensor.from_local(
            grad.contiguous() / mesh.size(), mesh, [Partial("sum")] * mesh.ndim, run_check=False, shape=shape,
            stride=stride,
        )  # fmt: skip
        return partial.redistribute(mesh, placements)


def _check_dtensor_weight(tensor, name):
    bad = [p for p in tensor.placements if not (p.is_replicate() or (p.is_shard() and p.dim % tensor.dim() == 0))]
    if bad:
        raise NotImplementedError(
            f"linear_cross_entropy takes a DTensor {name} sharded on its rows (Shard(0)) or replicated; got "
            f"placements {tuple(tensor.placements)}"
        )


class _ReplicatedLocal(torch.autograd.Function):
    """A Replicate DTensor's local tensor; its gradient (already summed over the ranks) comes back Replicate."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.spec = tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride()
        return tensor.to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def _dtensor_vocab_parallel(hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras):
    """hidden a Replicate DTensor, weight Shard(0) on a 1-D mesh (bias Shard(0) or None): vocab-parallel, the loss
    (and every extra output) a Replicate DTensor, the gradients DTensors placed like their inputs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    tensors = [("hidden", hidden, Replicate()), ("weight", weight, Shard(0))]
    if bias is not None:
        tensors.append(("bias", bias, Shard(0)))
    for name, tensor, placement in tensors:
        if not sharding.is_dtensor(tensor) or tensor.device_mesh != mesh or tuple(tensor.placements) != (placement,):
            raise NotImplementedError(
                "vocab-parallel linear_cross_entropy over DTensors takes hidden Replicate and weight (and bias) "
                f"Shard(0) on one 1-D mesh; {name} is {getattr(tensor, 'placements', 'a plain tensor')}"
            )
    if sharding.is_dtensor(labels):
        labels = labels.full_tensor()
    vocab_total, n_ranks, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    # Shard's chunking (torch.chunk): ceil(V / n) rows per rank, the last ranks fewer.
    chunk = -(-vocab_total // n_ranks)
    start = min(rank * chunk, vocab_total)
    local_weight = sharding._LocalShard.apply(weight)
    local_bias = None if bias is None else sharding._LocalShard.apply(bias)
    if local_weight.shape[0] == 0:
        raise NotImplementedError("a rank holds no weight rows (V < mesh size); not supported")
    layout = (mesh.get_group(), start, vocab_total, chunk)
    loss = vocab_parallel_linear_cross_entropy(
        _ReplicatedLocal.apply(hidden), local_weight, local_bias, labels, options, reduction, n_items, backend,
        chunking, layout, extras,
    )  # fmt: skip
    if extras is None:
        return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
    fields = {
        name: None if value is None else DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        for name, value in loss._asdict().items()
    }
    return contract.CrossEntropyOutput(**fields)


@torch.compiler.disable
def sharded_linear_cross_entropy(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, validate_labels,
    process_group, vocab_start,
):  # fmt: skip
    """linear_cross_entropy's entry for process_group= / vocab_start= or DTensor inputs (eager: the collectives
    run in an autograd.Function; under torch.compile a graph break)."""
    dtensors = [sharding.is_dtensor(t) for t in (hidden, weight, bias)]
    if any(dtensors):
        if process_group is not None or vocab_start is not None:
            raise ValueError(
                "a DTensor carries its own process group and offsets: pass neither process_group nor vocab_start"
            )
        if dtensors[0]:
            if validate_labels:
                full = labels.full_tensor() if sharding.is_dtensor(labels) else labels
                contract.validate_labels(full, weight.shape[0], options.ignore_index)
            return _dtensor_vocab_parallel(
                hidden, weight, bias, labels, options, reduction, n_items, backend, chunking,
                extras if any(extras) else None,
            )  # fmt: skip
        for name, tensor in (("weight", weight), ("bias", bias)):
            if sharding.is_dtensor(tensor):
                _check_dtensor_weight(tensor, name)
        if sharding.is_dtensor(labels):
            raise ValueError("with a plain hidden (this rank's rows) labels must be a plain tensor too")
        full_weight = _Gathered.apply(weight) if dtensors[1] else weight
        full_bias = _Gathered.apply(bias) if dtensors[2] else bias
        if validate_labels:
            contract.validate_labels(labels, full_weight.shape[0], options.ignore_index)
        if any(extras):
            return unsharded_outputs(
                hidden, full_weight, full_bias, labels, options, reduction, n_items, backend, chunking, extras
            )
        return unsharded_loss(hidden, full_weight, full_bias, labels, options, reduction, n_items, backend, chunking)
    if process_group is None:
        raise ValueError("vocab_start is only meaningful with process_group (a vocab-parallel weight)")
    layout = _layout(process_group, vocab_start, weight.shape[0], hidden.device)
    if validate_labels:
        contract.validate_labels(labels, layout[2], options.ignore_index)
    return vocab_parallel_linear_cross_entropy(
        hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, layout,
        extras if any(extras) else None,
    )  # fmt: skip
