"""The LM-head engine: the chunk loop over rows that every linear loss runs on (linear_cross_entropy and
linear_log_probs, linear_jsd) without materialising the (N, V) logits. Loss-neutral: it imports core/ only, and each
loss plugs its row kernels into it (losses/*/linear_chunks.py).

Chunks. The rows are processed in chunks of `rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes, chunk_rows)`
rows: the workspace budget (the `workspace_bytes` keyword, by default `DEFAULT_WORKSPACE_BYTES` = 256 MiB of
logits) split evenly over as few chunks as it allows, rounded up to a multiple of `ROWS_MULTIPLE` (whole matmul
tiles); the `chunk_rows` keyword, when given, overrides it. `row_chunks` yields the chunks, each chunk's logits from
one matmul into the workspace (`chunk_logits`); the loss's row kernels give its per-row results and overwrite the
same fresh logits with d loss / d logits, and `accumulate_grads` folds that into the chunk's rows of d hidden and
into d weight (a column sum into d bias), in the buffers of `new_grads`, which `finish_grads` hands back in the
inputs' dtypes. The last chunk is shorter (a slice of the workspace). logits_dtype=float32 with bf16/fp16 inputs
(`check_logits_dtype`, `logits_operands`): the workspace holds float32 logits (4 bytes each) and, in a pass that
computes gradients, the backward kernel writes d logits into a second chunk in the inputs' dtype (the products'
operand, as with the default logits), so such a pass counts 4 + itemsize bytes per logit against workspace_bytes
(`logit_bytes`). The settings travel as `Chunking` (checked by `check_chunking`), the record the custom ops take.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats.

Ignored rows: by default every row costs its matmuls (an ignored row's logits are computed, then never read).
skip_ignored_rows=True runs the chunks over the kept rows only (`kept_rows`: their indices by nonzero;
`row_selections` and `take_rows`: each chunk's rows of hidden gathered, its rows of d hidden written back by index;
`selected_count`; `per_row` buffers holding an ignored row's values): 6·K·H·V flops for K kept rows, plus K·H
copied. cuBLAS takes its shapes from the host, so the number of kept rows is read there: one synchronisation per call
(eager; the autograd Functions hand the kept rows to the backward that recomputes the logits, and `FIND` marks a pass
that finds them itself; under torch.compile that backward's custom op reads them again). Opt-in, and refused under
CUDA-graph capture (`SKIP_UNDER_CAPTURE`).

Dtypes: `autocast_or_common_dtype` (under torch.autocast the matmuls run in the autocast dtype, as F.linear's; else
mixed dtypes compute in their promoted dtype), `in_compute_dtype` (the weight and bias in the matmuls' dtype) and
`kernel_context` (the loop's own code runs without grad mode and autocast). `transposed_view`: a weight_layout="hv"
weight, whose gradient comes back in its own layout. `reference_logits`: the plain-torch path's logits;
`gradients_needed`: which of (hidden, weight, bias) are owed a gradient.

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

from ..core.launch import on_device

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "FIND",
    "LOGITS_DTYPES",
    "ROWS_MULTIPLE",
    "SKIP_UNDER_CAPTURE",
    "Chunking",
    "accumulate_grads",
    "autocast_or_common_dtype",
    "check_chunking",
    "check_logits_dtype",
    "chunk_logits",
    "finish_grads",
    "gradients_needed",
    "in_compute_dtype",
    "kept_rows",
    "kernel_context",
    "logit_bytes",
    "logits_operands",
    "new_grads",
    "per_row",
    "reference_logits",
    "row_chunks",
    "row_selections",
    "rows_per_chunk",
    "selected_count",
    "take_rows",
    "transposed_view",
]

# At 256 MiB the workspace holds 1024 rows of bf16 logits at V=128256, 512 at V=256000.
DEFAULT_WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many


class Chunking(NamedTuple):
    """The chunk loops' settings (linear_cross_entropy's and linear_jsd's keywords), as the custom ops take them
    (core/custom_ops.op_schema)."""

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


def check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False, float32_logits=False):
    workspace_bytes = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    for name, value in (("accumulate_in_float32", accumulate_in_float32), ("skip_ignored_rows", skip_ignored_rows)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    return Chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows, float32_logits)


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


def chunk_logits(workspace, hidden_chunk, weight, bias):
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
    device = on_device(hidden)
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
    """The gradients' buffers (None where `needs`, the (hidden, weight, bias) flags, says none): hidden's, the
    weight's in its own layout (a float32 accumulator where asked or where the weight is not in the compute dtype)
    and the bias's (float32), uninitialised where the first chunk overwrites them, zeros where no chunk will."""
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
    """The gradients in the weight's and the bias's own dtypes (the accumulators rounded once)."""
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


FIND = object()  # the kept rows not handed over: the pass finds them (kept_rows)


def kept_rows(labels, ignore_index, chunking, function="linear_cross_entropy"):
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
    (kept_rows) a slice of those indices (an int64 tensor), so that the chunks cover only the kept rows; width its
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
    the rows, or with `kept` (kept_rows) a slice of those indices: the chunks then cover only the kept rows
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
        logits = chunk_logits(workspace[:width], hidden_chunk, logits_weight, logits_bias)
        yield rows, hidden_chunk, take_rows(labels, rows), logits, grad_workspace[:width], first


def per_row(n_rows, kept, fill, dtype, device):
    """A per-row result buffer: every row is written by the chunks, or with kept rows the others hold `fill`, the
    value the forward kernel gives an ignored row (loss 0, lse -inf, argmax 0, mean of z NaN)."""
    if kept is None:
        return torch.empty(n_rows, dtype=dtype, device=device)
    return torch.full((n_rows,), fill, dtype=dtype, device=device)


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


def gradients_needed(hidden, weight, bias):
    """Which of (hidden, weight, bias) the computation owes a gradient."""
    grad_enabled = torch.is_grad_enabled()
    return (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )


def reference_logits(hidden, weight, bias, chunking):
    """The plain-torch path's logits: F.linear in the compute dtype, or in float32 for float32 logits."""
    if chunking.float32_logits:
        hidden, weight, bias = (None if t is None else t.float() for t in (hidden, weight, bias))
    if transposed_view(weight):  # weight_layout="hv": hidden @ (H, V) as stored, so its gradient comes back (H, V)
        logits = torch.matmul(hidden, weight.t())
        return logits if bias is None else logits + bias
    return torch.nn.functional.linear(hidden, weight, bias)
