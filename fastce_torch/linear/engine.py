"""The chunk loop of the fused linear cross-entropy (linear_cross_entropy without the (N, V) logits).

Chunks. The rows are processed in chunks of `rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes, chunk_rows)`
rows: the workspace budget (the `workspace_bytes` keyword, by default `DEFAULT_WORKSPACE_BYTES` = 256 MiB of
logits) split evenly over as few chunks as it allows, rounded up to a multiple of `ROWS_MULTIPLE` (whole matmul
tiles); the `chunk_rows` keyword, when given, overrides it. Per chunk: the logits come from one
matmul into the workspace, fastce's forward kernel gives each row's loss and log-sum-exp (`_ce_forward`), the
backward kernel overwrites the same fresh logits with d loss / d logits (`chunk_gradient`), and two matmuls
fold that into the chunk's rows of d hidden and into d weight (a column sum into d bias). The last chunk is
shorter (a slice of the workspace). logits_dtype=float32 with bf16/fp16 inputs: the workspace holds float32 logits
(4 bytes each) and, in a pass that computes gradients, the backward kernel writes d logits into a second chunk in the
inputs' dtype (the products' operand, as with the default logits), so such a pass counts 4 + itemsize bytes per
logit against workspace_bytes.

Reductions.
- "mean" / "sum": the gradients are complete after the forward (the denominator is counted on the device first, no
  host synchronisation); the backward only multiplies them by the upstream scalar, and skips even that on the device
  when the scalar is exactly 1. 6·N·H·V flops in all. Token weights keep this: w_t / denominator is the backward
  kernel's per-row upstream. A differentiated z_loss or entropy output is the exception: its upstream exists only in
  the backward, which then recomputes each chunk's logits for that part. Gradients are computed only when grad mode
  is on and an input requires one (2·N·H·V flops otherwise).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops. A differentiated entropy output adds its
  term in the same backward kernel pass (the kernel's entropy variant, from the forward's per-row entropy).

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats.

Ignored rows: by default every row costs its matmuls (an ignored row's logits are computed, then never read).
skip_ignored_rows=True runs the chunks over the kept rows only (their indices by nonzero, each chunk's rows of hidden
gathered, its rows of d hidden written back by index): 6·K·H·V flops for K kept rows, plus K·H copied. cuBLAS takes
its shapes from the host, so the number of kept rows is read there: one synchronisation per call (eager; the
autograd Functions hand the kept rows to the backward that recomputes the logits; under torch.compile that backward's
custom op reads them again). Opt-in, and refused under CUDA-graph capture. linear_jsd's loop (jsd.py) skips the
same way through the same helpers (_kept_rows, row_selections, take_rows, new_grads, accumulate_grads).

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. With float32 logits the
gradient chunk is still rounded to the inputs' dtype before the products (which then run at the bf16/fp16 rate, and
need no float32 copy of the weight): measured on the CPU (bf16, N=512, H=256, V=8192, T=0.7, float64 as truth), the
relative error of d hidden is 1.9e-3 with it against 1.6e-3 with float32 products (d weight: 1.9e-3 / 1.7e-3), both
dominated by the gradients' own bf16 rounding. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(accumulate_in_float32=True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.
"""

import contextlib
from typing import NamedTuple

import torch

from .. import contract, kernels

# At 256 MiB the workspace holds 1024 rows of bf16 logits at V=128256, 512 at V=256000.
DEFAULT_WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many


class Chunking(NamedTuple):
    """linear_cross_entropy's settings keywords, as the custom ops take them (contract.op_schema)."""

    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    chunk_rows: int | None = None
    accumulate_in_float32: bool = False
    skip_ignored_rows: bool = False
    float32_logits: bool = False  # logits_dtype=float32 with bf16/fp16 inputs


LOGITS_DTYPES = (None, "float32", torch.float32)


def check_logits_dtype(logits_dtype, dtype):
    """Whether the chunks' logits are float32 for inputs computed in `dtype`: logits_dtype None (the inputs' dtype)
    or float32 (the string "float32" or torch.float32); a no-op for float32 and float64 inputs."""
    if not any(logits_dtype is ok or (isinstance(logits_dtype, str) and logits_dtype == ok) for ok in LOGITS_DTYPES):
        raise ValueError(f'logits_dtype must be None, "float32" or torch.float32, got {logits_dtype!r}')
    return logits_dtype is not None and dtype in (torch.bfloat16, torch.float16)


def _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False, float32_logits=False):
    workspace_bytes = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    for name, value in (("accumulate_in_float32", accumulate_in_float32), ("skip_ignored_rows", skip_ignored_rows)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    return Chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows, float32_logits)


# --- the one place that calls fastce's launchers ----------------------------------------------------------------


def _ce_forward(logits, labels, options, outputs=False, class_weight=None):
    """Per-token float32 (loss, lse) of a 2-D logits chunk; with outputs, also (argmax, mean of z) per row.
    class_weight: class weights (V,) or None, for every launcher call here."""
    loss, lse, _, *statistics = kernels.forward(logits, labels, options, outputs=outputs, weight=class_weight)
    return loss, lse, *statistics


def chunk_gradient(logits, dlogits, labels, lse, options, upstream, denominator=None, class_weight=None):
    """Writes into `dlogits` (the logits' own buffer, or the chunk in the inputs' dtype next to float32 logits) the
    gradient of sum_t (g_loss_t loss_t / denominator + g_lse_t lse_t + g_entropy_t H_t) with upstream = (g_loss,
    g_lse, g_entropy, entropy) of the chunk's rows, each None for none of that part: g_loss per row or 0-d (with a
    denominator, a per-row g_loss is the token weights' factor w_t / denominator); g_lse (the z_loss output's)
    already holds any class weights' factor (the lse part is unweighted); entropy (the rows' H) gives mz = lse - H."""
    grad_loss, grad_lse, grad_entropy, entropy = upstream
    # The entropy's part rides in the loss's pass (the kernel's entropy variant; a zero upstream for the loss when
    # only the entropy is differentiated).
    entropy_keywords = {}
    if grad_entropy is not None:
        entropy_keywords = dict(grad_entropy=grad_entropy, mean_z=lse - entropy)
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    if grad_lse is None:
        return kernels.backward(
            grad_loss, logits, labels, lse, dlogits, options, denominator, weight=class_weight, **entropy_keywords
        )
    if grad_loss is None:
        return kernels.lse_backward(grad_lse, logits, labels, lse, dlogits, options)
    # Both parts in float32, rounded to the gradient's dtype once.
    total = kernels.lse_backward(grad_lse, logits, labels, lse, torch.empty_like(logits, dtype=torch.float32), options)
    part = torch.empty_like(logits, dtype=torch.float32)
    total += kernels.backward(
        grad_loss, logits, labels, lse, part, options, denominator, weight=class_weight, **entropy_keywords
    )
    return dlogits.copy_(total)


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
    """The chunk's logits into the workspace. A float32 workspace with bf16/fp16 operands (logits_dtype=float32):
    cuBLAS takes the operands as they are and writes float32 (no float32 copy of the weight); the CPU has no
    mixed-dtype matmul, so there `weight` and `bias` are already float32 (logits_operands) and the chunk is cast."""
    if workspace.dtype != hidden_chunk.dtype:
        if workspace.is_cuda:
            torch.mm(hidden_chunk, weight.t(), out_dtype=torch.float32, out=workspace)
            if bias is not None:
                workspace += bias
            return workspace
        hidden_chunk = hidden_chunk.to(workspace.dtype)
    if bias is None:
        torch.matmul(hidden_chunk, weight.t(), out=workspace)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=workspace)
    return workspace


def logit_bytes(hidden, chunking, with_grads):
    """Workspace bytes per logit: the inputs' itemsize; with float32 logits 4, plus the gradient chunk in the inputs'
    dtype (the products' operand, written by the backward kernel next to the float32 logits) when gradients are
    computed in that pass."""
    if not chunking.float32_logits:
        return hidden.element_size()
    return 4 + (hidden.element_size() if with_grads else 0)


def logits_operands(weight, bias, chunking):
    """weight and bias as the logits matmul takes them: as given, except float32 logits on the CPU (no mixed-dtype
    matmul there: one float32 copy per pass; on CUDA the matmul reads the bf16/fp16 operands)."""
    if not chunking.float32_logits or weight.is_cuda:
        return weight, bias
    return weight.float(), None if bias is None else bias.float()


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


def transposed_view(weight):
    """Whether weight (V, H) is the transpose of a contiguous (H, V) tensor (weight_layout="hv": a Flax-layout
    kernel taken as `kernel.t()`, no copy). Its matmuls then read the (H, V) memory as it is (cuBLAS's transpose
    flags) and its gradient is made in the same layout (new_grads)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride(0) == 1 and weight.t().is_contiguous()


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
    no_chunk = selected_count(hidden.shape[0], kept) == 0
    new_accumulator = torch.zeros if no_chunk else torch.empty
    grad_weight = None
    if need_weight:
        # In the weight's own layout (preserve_format keeps a dense weight's strides): a weight_layout="hv" view
        # gets its gradient in (H, V) memory, which the .t() in front of it hands to .grad without a copy; the
        # products write the transposed output directly (torch's addmm swaps the operands for a column-major result).
        like = torch.zeros_like if no_chunk else torch.empty_like
        grad_weight = like(weight, dtype=accumulate_dtype, memory_format=torch.preserve_format)
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
    "fastce_torch.{function}: skip_ignored_rows=True reads the number of kept rows on the host (one "
    "synchronisation), which CUDA-graph capture does not allow; capture the default skip_ignored_rows=False"
)


_FIND = object()  # the kept rows not handed over: the pass finds them (_kept_rows)


def _kept_rows(labels, ignore_index, chunking, function="linear_cross_entropy"):
    """skip_ignored_rows: the ascending indices (int64) of the rows whose label is not ignore_index, or None when
    every row is kept, there are no labels or the keyword is off (the plain loop over all rows). cuBLAS matmuls
    take their shapes from the host, so skipping rows needs their number there: nonzero reads it, one host
    synchronisation. function: the public function whose call this is, named by the capture error."""
    if not chunking.skip_ignored_rows or labels is None:
        return None
    if labels.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(SKIP_UNDER_CAPTURE.format(function=function))
    kept = torch.nonzero(labels != ignore_index).squeeze(1)
    return None if kept.numel() == labels.numel() else kept


def row_selections(n_rows, step, kept=None):
    """Yields (rows, width, first) chunk by chunk over n_rows rows in chunks of `step`: rows a slice, or with `kept`
    (_kept_rows) a slice of those indices (an int64 tensor), so that the chunks cover only the kept rows; width its
    number of rows, first True for the first chunk."""
    total = selected_count(n_rows, kept)
    for start in range(0, total, step):
        stop = min(start + step, total)
        yield (slice(start, stop) if kept is None else kept[start:stop]), stop - start, start == 0


def take_rows(tensor, rows):
    """tensor's chunk rows (row_selections): a view for a slice, a gathered copy for kept rows' indices."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def selected_count(n_rows, kept):
    """The rows the chunks cover: n_rows, or the kept ones."""
    return n_rows if kept is None else kept.numel()


def row_chunks(hidden, weight, bias, labels, chunking, kept=None, with_grads=True):
    """Yields (rows, hidden_chunk, labels_chunk, logits, dlogits, first) chunk by chunk, first True for the first
    chunk; logits is a view of one workspace that the next chunk overwrites, dlogits where the chunk's gradient goes
    (the logits themselves, or with float32 logits and gradients a chunk in the inputs' dtype). rows is a slice of
    the rows, or with `kept` (_kept_rows) a slice of those indices: the chunks then cover only the kept rows
    (gathered, a chunk x H copy each), so ignored rows cost no matmul."""
    vocab = weight.shape[0]
    itemsize = logit_bytes(hidden, chunking, with_grads)
    step = rows_per_chunk(
        selected_count(hidden.shape[0], kept), vocab, itemsize, chunking.workspace_bytes, chunking.chunk_rows
    )
    logits_dtype = torch.float32 if chunking.float32_logits else hidden.dtype
    workspace = torch.empty(step, vocab, dtype=logits_dtype, device=hidden.device)
    grad_workspace = workspace
    if with_grads and logits_dtype != hidden.dtype:
        grad_workspace = torch.empty(step, vocab, dtype=hidden.dtype, device=hidden.device)
    logits_weight, logits_bias = logits_operands(weight, bias, chunking)
    for rows, width, first in row_selections(hidden.shape[0], step, kept):
        hidden_chunk = take_rows(hidden, rows)
        logits = _chunk_logits(workspace[:width], hidden_chunk, logits_weight, logits_bias)
        yield rows, hidden_chunk, take_rows(labels, rows), logits, grad_workspace[:width], first


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
    token_weights=None,
):
    """Token losses (N,) and lse (N,) of 2-D hidden; with any of `needs` (hidden, weight, bias) also the gradients of
    sum_t w_t loss_t / denominator (a 1-element float32 device tensor; w_t the float32 token_weights (N,), or 1)
    computed chunk by chunk. The token losses are not multiplied by the weights. Returns
    (token_losses, lse, (grad_hidden, grad_weight, grad_bias)), None for gradients not needed; with outputs, then
    also the per-row argmax (int32) and mean of z (the extra outputs' statistics, collected chunk by chunk)."""
    n_rows, device = hidden.shape[0], hidden.device
    with kernel_context(hidden):
        kept = _kept_rows(labels, options.ignore_index, chunking) if kept is _FIND else kept
        weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
        # One chunk over every row (every small call) keeps the kernel's own per-row outputs (no allocation, no
        # copy); otherwise the chunks gather theirs into (token losses, lse[, argmax, mean of z]).
        per_row = None
        step = rows_per_chunk(n_rows, weight.shape[0], logit_bytes(hidden, chunking, any(needs)), *chunking[:2])
        if kept is not None or step < n_rows or n_rows == 0:
            fills = (0.0, -float("inf")) + ((0, float("nan")) if outputs else ())
            kinds = (torch.float32, torch.float32) + ((torch.int32, torch.float32) if outputs else ())
            per_row = [_per_row(n_rows, kept, fill, kind, device) for fill, kind in zip(fills, kinds, strict=True)]
        grads = new_grads(hidden, weight, bias, needs, chunking, kept)
        one = torch.ones((), dtype=torch.float32, device=device) if any(needs) and token_weights is None else None
        for rows, hidden_chunk, labels_chunk, logits, dlogits, first in row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept, any(needs)
        ):
            chunk_outputs = _ce_forward(logits, labels_chunk, options, outputs, class_weight)
            if per_row is None:
                per_row = list(chunk_outputs)
            else:
                for whole, part in zip(per_row, chunk_outputs, strict=True):
                    whole[rows] = part
            if any(needs):
                factor = one if token_weights is None else token_weights[rows]
                upstream = (factor, None, None, None)
                chunk_gradient(
                    logits, dlogits, labels_chunk, chunk_outputs[1], options, upstream, denominator, class_weight
                )
                accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
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
            chunk_gradient(logits, logits, labels, lse, options, (one, None, None, None), denominator)
            accumulate_grads(logits, hidden, weight_c, slice(None), grads, True)
        return loss, denominator, finish_grads(grads, weight, bias)


def chunked_backward(
    upstream, hidden, weight, bias, labels, lse, options, chunking, needs, kept=_FIND, class_weight=None
):
    """Gradients of sum_t (g_loss_t loss_t + g_lse_t lse_t + g_entropy_t H_t) with upstream = (g_loss, g_lse,
    g_entropy, entropy) per row (N,) (chunk_gradient; None for a part not there), recomputing each chunk's logits
    from hidden and weight."""
    # no_grad: under create_graph=True autograd runs backward with grad mode on, and these are kernels and out= ops.
    with kernel_context(hidden):
        if not any(needs):
            return new_grads(hidden, weight, bias, needs, chunking)
        # The forward's kept rows: handed over by the eager Functions, found again (a second synchronisation) by
        # the custom ops' backward.
        kept = _kept_rows(labels, options.ignore_index, chunking) if kept is _FIND else kept
        grads = new_grads(hidden, weight, bias, needs, chunking, kept)
        weight_c, bias_c = in_compute_dtype(hidden, weight, bias)
        for rows, hidden_chunk, labels_chunk, logits, dlogits, first in row_chunks(
            hidden, weight_c, bias_c, labels, chunking, kept
        ):
            rows_upstream = tuple(None if part is None else part[rows] for part in upstream)
            chunk_gradient(logits, dlogits, labels_chunk, lse[rows], options, rows_upstream, class_weight=class_weight)
            accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
        return finish_grads(grads, weight, bias)


def _differentiable_grads(
    grad_rows, hidden, weight, bias, labels, options, needs, grad_lse=None, class_weight=None, grad_entropy=None
):
    """The gradients of sum_t (grad_rows_t loss_t + grad_lse_t lse_t + grad_entropy_t H_t) (each None for none of
    it) in plain torch (F.linear, then the contract's d / d logits and the two products), so that autograd can
    differentiate them again (create_graph=True: gradient penalties, Hessian-vector products). It materialises the
    (N, V) logits; only a second-order computation comes here."""
    # Under autocast a float32 master weight meets bf16 hidden here: compute in hidden's dtype, as the kernels did.
    weight = weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    parts = []
    if grad_rows is not None:
        parts.append(contract.logits_gradient(grad_rows, logits, labels, None, options, weight=class_weight))
    if grad_lse is not None:
        parts.append(contract.lse_gradient(grad_lse, logits, labels, options))
    if grad_entropy is not None:
        parts.append(contract.entropy_gradient(grad_entropy, logits, labels, options))
    dlogits = parts[0].to(logits.dtype)
    for part in parts[1:]:
        dlogits = dlogits + part.to(logits.dtype)
    need_hidden, need_weight, need_bias = needs
    return (
        dlogits @ weight if need_hidden else None,
        dlogits.t() @ hidden if need_weight else None,
        dlogits.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias else None,
    )


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
