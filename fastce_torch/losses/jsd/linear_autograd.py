"""The fused linear distillation loss: `linear_jsd`, fastce_torch.jsd(student_hidden @ W_s.T + b_s,
teacher_hidden @ W_t.T + b_t, ...) without the (N, V) logits of either model.

Chunks of rows (linear/chunks.py's rows_per_chunk: the workspace budget, DEFAULT_WORKSPACE_BYTES = 256 MiB by
default, covers both chunks of logits, student's and teacher's, each in its head's dtype): per chunk the student
logits h_s W_s^T (+ b_s) and the teacher logits h_t W_t[:V_s]^T (+ b_t[:V_s]) (the teacher weight's first V_s rows,
a view, no copy), matmuls accumulating in float32 and rounding once to the inputs' dtype (logits_dtype=float32:
kept in float32, the student's d logits then written into a chunk of its own in the inputs' dtype), then the
forward kernels (kernels/jsd.py; rows split into column segments, so a chunk of a few hundred rows still fills the
GPU; their partials, 5 or 6 floats per row and segment, under 200 KiB a chunk up to 8192 rows, are outside
workspace_bytes). accumulate_in_float32: d W_s summed over the chunks in float32 (chunks.py).
- "mean" / "sum" with a gradient to compute: the backward kernel overwrites the chunk's student logits with
  d loss / d logits (upstream 1 / divisor, a device scalar: no host synchronisation), and d h_s[chunk] = g W_s,
  d W_s += g^T h_s, d b_s += column sums follow at once; the autograd backward only scales them by the upstream
  scalar (as linear_cross_entropy does), so a second backward through the same loss raises.
- "none": the forward keeps lse_s, lse_t and the row constant (3 N floats); the backward recomputes both chunks'
  logits and runs the backward kernel with the per-row upstream.
skip_ignored_rows=True: the chunks run over the kept rows only (linear_cross_entropy's _kept_rows, row_selections
and take_rows: their indices found with one host synchronisation, both heads' rows gathered, d h_s written back by
index; the "none" Function hands its forward's kept rows to its backward).
The teacher's hidden, weight and bias are constants (detached: no gradient, whether or not they require one).
Gradients are computed only with grad mode on and a student input requiring one. Under torch.compile the
torch.library custom ops below replace the autograd Functions.
"""

import torch
from torch.autograd.function import once_differentiable

from .. import contract, jsd_contract, kernels
from ..jsd import (
    JSD_OPTIONS_SCHEMA,
    reduced,
    reference_row_losses,
    row_divisor,
)
from ..jsd_contract import JsdOptions
from ..kernels import jsd as jsd_kernels
from .chunks import (
    _FIND,
    Chunking,
    _check_chunking,
    _chunk_logits,
    _kept_rows,
    accumulate_grads,
    autocast_or_common_dtype,
    check_logits_dtype,
    finish_grads,
    in_compute_dtype,
    kernel_context,
    logit_bytes,
    logits_operands,
    new_grads,
    row_selections,
    rows_per_chunk,
    selected_count,
    take_rows,
)
from .unsharded import gradients_needed, reference_logits

NO_GRADS = (False, False, False)
BACKWARD_TWICE = (
    "fastce_torch.linear_jsd: backward through the same loss twice is not supported (its gradients are computed in "
    "the forward and handed over once); compute the loss again instead of retain_graph=True"
)


# --- the chunk loop -------------------------------------------------------------------------------------------------


def _side(chunking, hidden):
    """chunking for one head: float32 logits only where its compute dtype is bf16 / fp16 (float32 and float64 heads
    already make float32 or wider logits)."""
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    return chunking._replace(float32_logits=chunking.float32_logits and half)


def _head_workspace(hidden, weight, bias, side_chunking, step):
    """One head's logits workspace (step, V) and its logits operands (logits_operands: a float32 copy only on the
    CPU, for float32 logits)."""
    dtype = torch.float32 if side_chunking.float32_logits else hidden.dtype
    workspace = torch.empty(step, weight.shape[0], dtype=dtype, device=hidden.device)
    return workspace, *logits_operands(weight, bias, side_chunking)


def _row_chunks(student, teacher, labels, chunking, with_grads, kept=None):
    """Yields (rows, student hidden chunk, labels chunk or None, student logits, d student logits, teacher logits,
    first) chunk by chunk; the logits are views of workspaces that the next chunk overwrites. student, teacher:
    (hidden, weight, bias) in their compute dtypes, the teacher's weight and bias already its first V_s rows. d
    student logits: where the backward kernel writes (the student logits' own chunk, or next to float32 logits a
    chunk in the student's dtype, the products' operand). The budget counts both chunks of logits (logit_bytes: 4
    bytes a float32 logit, plus the student's gradient chunk in a pass with gradients). rows: a slice, or with
    `kept` (skip_ignored_rows) a slice of the kept rows' indices, both heads' hidden rows gathered (chunks.py's
    row_selections, as linear_cross_entropy's loop)."""
    (h_s, w_s, b_s), (h_t, w_t, b_t) = student, teacher
    student_chunking, teacher_chunking = _side(chunking, h_s), _side(chunking, h_t)
    vocab = w_s.shape[0]
    itemsize = logit_bytes(h_s, student_chunking, with_grads) + logit_bytes(h_t, teacher_chunking, False)
    step = rows_per_chunk(selected_count(h_s.shape[0], kept), vocab, itemsize, chunking.workspace_bytes)
    student_workspace, w_s, b_s = _head_workspace(h_s, w_s, b_s, student_chunking, step)
    teacher_workspace, w_t, b_t = _head_workspace(h_t, w_t, b_t, teacher_chunking, step)
    grad_workspace = student_workspace
    if with_grads and student_workspace.dtype != h_s.dtype:
        grad_workspace = torch.empty(step, vocab, dtype=h_s.dtype, device=h_s.device)
    for rows, width, first in row_selections(h_s.shape[0], step, kept):
        hidden_chunk = take_rows(h_s, rows)
        student_logits = _chunk_logits(student_workspace[:width], hidden_chunk, w_s, b_s)
        teacher_logits = _chunk_logits(teacher_workspace[:width], take_rows(h_t, rows), w_t, b_t)
        labels_chunk = None if labels is None else take_rows(labels, rows)
        yield rows, hidden_chunk, labels_chunk, student_logits, grad_workspace[:width], teacher_logits, first


def _in_compute_dtype(student, teacher):
    """Each head's weight and bias in its hidden's dtype (a cast copy only under autocast); a float64 teacher next
    to a kernel-dtype student is read as float32 (the kernels take no float64)."""
    student = (student[0], *in_compute_dtype(*student))
    h_t, w_t, b_t = teacher
    if h_t.dtype not in contract.KERNEL_DTYPES:
        h_t = h_t.to(torch.float32)
    return student, (h_t, *in_compute_dtype(h_t, w_t, b_t))


def _kept(labels, options, chunking, kept):
    """The kept rows of a pass: handed over (the eager "none" Function's backward gets its forward's), or found here
    (chunks._kept_rows: one host synchronisation with skip_ignored_rows, None without)."""
    return _kept_rows(labels, options.ignore_index, chunking, "linear_jsd") if kept is _FIND else kept


def chunked_forward(student, teacher, labels, options, chunking, upstream=None, needs=NO_GRADS, kept=_FIND):
    """Per-row (loss, lse_s, lse_t, kl) (N,) float32 and, with any of `needs` (student hidden, weight, bias), the
    gradients of sum_rows upstream * loss_row (upstream: a 0-d float32 device tensor), chunk by chunk. chunking:
    workspace_bytes, accumulate_in_float32, float32_logits and skip_ignored_rows (chunk_rows unused). With kept
    rows the chunks cover only those; the others keep what the forward kernel gives an ignored row (0 in each
    statistic) and their rows of d hidden stay 0."""
    h_s, w_s, b_s = student
    with kernel_context(h_s):
        kept = _kept(labels, options, chunking, kept)
        student_c, teacher_c = _in_compute_dtype(student, teacher)
        n_rows, device = h_s.shape[0], h_s.device
        if kept is None:
            out = jsd_kernels.new_stats(n_rows, device)
        else:  # rows no chunk writes
            out = torch.zeros(4, n_rows, dtype=torch.float32, device=device).unbind(0)
        grads = new_grads(h_s, w_s, b_s, needs, chunking, kept)
        for rows, hidden_chunk, labels_chunk, s_logits, s_grad, t_logits, first in _row_chunks(
            student_c, teacher_c, labels, chunking, any(needs), kept
        ):
            # A slice: the kernel writes into the full buffers (views); kept rows' indices: into the chunk's own,
            # scattered back.
            gathered = not isinstance(rows, slice)
            chunk_out = jsd_kernels.new_stats(s_logits.shape[0], device) if gathered else [b[rows] for b in out]
            jsd_kernels.jsd_forward(s_logits, t_logits, labels_chunk, options, chunk_out)
            if gathered:
                for whole, part in zip(out, chunk_out, strict=True):
                    whole[rows] = part
            if any(needs):  # d loss / d logits (in place of the student logits, or beside them), then the products
                jsd_kernels.jsd_backward(upstream, s_logits, t_logits, labels_chunk, chunk_out[1:], s_grad, options)
                accumulate_grads(s_grad, hidden_chunk, student_c[1], rows, grads, first)
        return out, finish_grads(grads, w_s, b_s)


def chunked_backward(upstream, student, teacher, labels, stats, options, chunking, needs, kept=_FIND):
    """The gradients of sum_rows upstream_row * loss_row (upstream (N,) float32, any stride) from the forward's
    per-row stats = (lse_s, lse_t, kl), recomputing both chunks' logits (over the kept rows only, with them)."""
    h_s, w_s, b_s = student
    with kernel_context(h_s):
        if not any(needs):
            return new_grads(h_s, w_s, b_s, needs, chunking)
        kept = _kept(labels, options, chunking, kept)
        grads = new_grads(h_s, w_s, b_s, needs, chunking, kept)
        student_c, teacher_c = _in_compute_dtype(student, teacher)
        for rows, hidden_chunk, labels_chunk, s_logits, s_grad, t_logits, first in _row_chunks(
            student_c, teacher_c, labels, chunking, True, kept
        ):
            chunk_stats = tuple(take_rows(s, rows) for s in stats)
            chunk_upstream = take_rows(upstream, rows)
            jsd_kernels.jsd_backward(chunk_upstream, s_logits, t_logits, labels_chunk, chunk_stats, s_grad, options)
            accumulate_grads(s_grad, hidden_chunk, student_c[1], rows, grads, first)
        return finish_grads(grads, w_s, b_s)


# --- the eager autograd Functions ---------------------------------------------------------------------------------


class _ReducedJsd(torch.autograd.Function):
    """ "mean" / "sum": the gradients are computed in the forward; backward scales them in place by the upstream
    scalar (nothing else holds them) and hands them over once."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, labels, options, divisor, chunking, needs):
        upstream = divisor.reciprocal()
        (loss, *_), ctx.grads = chunked_forward(
            (h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, upstream, needs
        )
        return reduced(loss, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(BACKWARD_TWICE)
        for grad in grads:
            if grad is not None:
                kernels.scale_unless_one(grad, grad_loss.to(torch.float32))
        return (*grads, *[None] * 8)


class _PerRowJsd(torch.autograd.Function):
    """ "none": the forward keeps the per-row statistics; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, labels, options, chunking):
        ctx.kept = _kept(labels, options, chunking, _FIND)  # the backward's chunks are the forward's
        (loss, *stats), _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, kept=ctx.kept)
        ctx.options, ctx.chunking = options, chunking
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[:2], b_s is not None and ctx.needs_input_grad[2])
        grads = chunked_backward(
            grad_rows.to(torch.float32), (h_s, w_s, b_s), (h_t, w_t, b_t), labels, stats, ctx.options,
            ctx.chunking, needs, ctx.kept,
        )  # fmt: skip
        return (*grads, *[None] * 6)


# --- custom ops for torch.compile -----------------------------------------------------------------------------------
# A custom op cannot return None: gradients that are not needed come back as empty tensors.

_HEADS = "Tensor h_s, Tensor w_s, Tensor? b_s, Tensor h_t, Tensor w_t, Tensor? b_t, Tensor? labels"
_NEEDS = "bool need_hidden, bool need_weight, bool need_bias"
_CHUNKING = "int workspace_bytes, bool accumulate_in_float32, bool float32_logits, bool skip_ignored_rows"
_N_OPTIONS = len(JsdOptions._fields)
_CHUNKING_FIELDS = ("workspace_bytes", "accumulate_in_float32", "float32_logits", "skip_ignored_rows")


def _op_chunking(chunking):
    """The Chunking fields the custom ops take (_CHUNKING), in their order."""
    return tuple(getattr(chunking, field) for field in _CHUNKING_FIELDS)


def _settings(settings):
    """A custom op's trailing arguments: (options, chunking, the rest: the needs where the op has them)."""
    end = _N_OPTIONS + len(_CHUNKING_FIELDS)
    chunking = Chunking(**dict(zip(_CHUNKING_FIELDS, settings[_N_OPTIONS:end])))
    return JsdOptions(*settings[:_N_OPTIONS]), chunking, settings[end:]


def _or_empty(tensor, like):
    return like.new_empty(0) if tensor is None else tensor


def _fake_grads(h_s, w_s, b_s, needs):
    need_hidden, need_weight, need_bias = needs
    return (
        h_s.new_empty(h_s.shape if need_hidden else (0,)),
        w_s.new_empty(w_s.shape if need_weight else (0,)),
        h_s.new_empty((w_s.shape[0],) if need_bias else (0,), dtype=b_s.dtype if need_bias else h_s.dtype),
    )


@torch.library.custom_op(
    "fastce::linear_jsd_reduced",
    mutates_args=(),
    schema=f"({_HEADS}, Tensor divisor, {JSD_OPTIONS_SCHEMA}, {_CHUNKING}, {_NEEDS}) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
)
def _reduced_op(h_s, w_s, b_s, h_t, w_t, b_t, labels, divisor, *settings):
    options, chunking, needs = _settings(settings)
    (loss, *_), grads = chunked_forward(
        (h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking, divisor.reciprocal(), needs
    )
    return (reduced(loss, divisor), *(_or_empty(grad, h_s) for grad in grads))


@_reduced_op.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, labels, divisor, *settings):
    return (h_s.new_empty((), dtype=torch.float32), *_fake_grads(h_s, w_s, b_s, settings[-3:]))


def _reduced_setup_context(ctx, inputs, output):
    ctx.needs, ctx.n_inputs = inputs[-3:], len(inputs)
    ctx.save_for_backward(*output[1:])


def _reduced_backward(ctx, grad_loss, *unused):
    # Out of place under the compiler (it plans that memory); exact zeros stay zero, as the eager scaling keeps them.
    grads = [
        torch.where(g == 0, 0, g * grad_loss.to(g.dtype)) if need else None
        for g, need in zip(ctx.saved_tensors, ctx.needs)
    ]
    return (*grads, *[None] * (ctx.n_inputs - 3))


torch.library.register_autograd("fastce::linear_jsd_reduced", _reduced_backward, setup_context=_reduced_setup_context)


@torch.library.custom_op(
    "fastce::linear_jsd_forward",
    mutates_args=(),
    schema=f"({_HEADS}, {JSD_OPTIONS_SCHEMA}, {_CHUNKING}) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _per_row_forward_op(h_s, w_s, b_s, h_t, w_t, b_t, labels, *settings):
    options, chunking, _ = _settings(settings)
    out, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, options, chunking)
    return tuple(t.clone() for t in out)  # each output owns its storage


@_per_row_forward_op.register_fake
def _(h_s, w_s, b_s, h_t, w_t, b_t, labels, *settings):
    return tuple(h_s.new_empty(h_s.shape[0], dtype=torch.float32) for _ in range(4))


@torch.library.custom_op(
    "fastce::linear_jsd_backward",
    mutates_args=(),
    schema=f"(Tensor upstream, {_HEADS}, Tensor lse_s, Tensor lse_t, Tensor kl, {JSD_OPTIONS_SCHEMA}, "
    f"{_CHUNKING}, {_NEEDS}) -> (Tensor, Tensor, Tensor)",
)
def _per_row_backward_op(upstream, h_s, w_s, b_s, h_t, w_t, b_t, labels, lse_s, lse_t, kl, *settings):
    options, chunking, needs = _settings(settings)
    # skip_ignored_rows: the kept rows found again (a second synchronisation; an op hands over tensors only).
    grads = chunked_backward(
        upstream.to(torch.float32), (h_s, w_s, b_s), (h_t, w_t, b_t), labels, (lse_s, lse_t, kl), options,
        chunking, needs,
    )  # fmt: skip
    return tuple(_or_empty(grad, h_s) for grad in grads)


@_per_row_backward_op.register_fake
def _(upstream, h_s, w_s, b_s, h_t, w_t, b_t, labels, lse_s, lse_t, kl, *settings):
    return _fake_grads(h_s, w_s, b_s, settings[-3:])


def _per_row_setup_context(ctx, inputs, output):
    ctx.settings = inputs[7:]
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*inputs[:7], *output[1:])


def _per_row_backward(ctx, grad_rows, *unused):
    h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats = ctx.saved_tensors
    needs = (*ctx.needs_input_grad[:2], b_s is not None and ctx.needs_input_grad[2])
    grads = _per_row_backward_op(grad_rows, h_s, w_s, b_s, h_t, w_t, b_t, labels, *stats, *ctx.settings, *needs)
    return (*[grad if need else None for grad, need in zip(grads, needs)], *[None] * (4 + len(ctx.settings)))


torch.library.register_autograd("fastce::linear_jsd_forward", _per_row_backward, setup_context=_per_row_setup_context)


# --- the function -------------------------------------------------------------------------------------------------


def linear_jsd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels=None,
    *,
    student_bias=None,
    teacher_bias=None,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
    workspace_bytes=None,
    accumulate_in_float32=False,
    skip_ignored_rows=False,
    logits_dtype=None,
    backend="auto",
):
    """fastce_torch.jsd(student_hidden @ student_weight.T + student_bias, teacher_hidden @ teacher_weight.T +
    teacher_bias, labels, ...) without either model's (N, V) logits (see the module docstring for the chunks).

    student_hidden (..., H_s), student_weight (V_s, H_s), teacher_hidden (..., H_t) with the same leading shape,
    teacher_weight (V_t, H_t) with V_t >= V_s (only its first V_s rows are used: a padded teacher head), biases (V,)
    or None; labels (leading shape, int) or None. Each head computes in its promoted dtype (under torch.autocast in
    the autocast dtype, as F.linear); a float64 student is computed in float64 by plain torch. The other keywords are
    jsd's; workspace_bytes bounds the two chunks of logits together (None: 256 MiB). Only the student's hidden,
    weight and bias get gradients; the teacher's are constants.

    Precision (linear_cross_entropy's keywords, the same meaning): logits_dtype None (each head's logits in its
    compute dtype) or float32 ("float32" or torch.float32): with bf16/fp16 heads both models' chunk logits come
    out of the matmul in float32 (cuBLAS reads the bf16/fp16 operands, no float32 copy of either weight) and the
    backward kernel writes d student logits into a chunk in the student's dtype; the workspace then counts 4 bytes a
    teacher logit and 4 + itemsize a student logit (fewer rows per chunk). The JSD gradient p_s - p_t is a
    difference of nearly equal numbers: logits rounded to bf16 make it off by percents at a realistic logit spread.
    accumulate_in_float32=True sums a bf16/fp16 weight's gradient over the chunks in float32 and rounds it once
    (4 V H bytes more).

    skip_ignored_rows=True (the kernels only; linear_cross_entropy's keyword, the same meaning): the chunks cover
    only the rows whose label is not ignore_index (both heads' hidden rows gathered chunk by chunk), so ignored rows
    (prompt tokens, padding) cost no matmul: 2·K·(H_s + H_t)·V + 4·K·H_s·V flops for K kept rows. The same loss and
    gradients (0 and a zero d hidden on ignored rows; "mean" divides by the same count). It reads the number of
    kept rows on the host, one synchronisation per call (under torch.compile the "none" backward's custom op reads
    it again), so it raises under CUDA-graph capture. Without labels there is nothing to skip (the plain loop).
    """
    options = jsd_contract.check_jsd_options(
        beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
    )
    jsd_contract.check_heads(
        (student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias)
    )
    jsd_contract.check_jsd_labels(labels, student_hidden, "student_hidden")
    vocab = student_weight.shape[0]
    chunking = _check_chunking(workspace_bytes, None, accumulate_in_float32, skip_ignored_rows)
    leading = student_hidden.shape[:-1]
    h_s, w_s, b_s = autocast_or_common_dtype(student_hidden, student_weight, student_bias)
    # The teacher: constants, its weight's (and bias's) first V_s rows as views.
    teacher = (teacher_hidden, teacher_weight[:vocab], None if teacher_bias is None else teacher_bias[:vocab])
    h_t, w_t, b_t = (None if t is None else t.detach() for t in autocast_or_common_dtype(*teacher))
    float32_logits = any([check_logits_dtype(logits_dtype, h.dtype) for h in (h_s, h_t)])
    chunking = chunking._replace(float32_logits=float32_logits)
    divisor = row_divisor(labels, leading.numel(), reduction, ignore_index, h_s.device)
    if not contract.use_kernel(h_s, backend):
        student_logits = reference_logits(h_s, w_s, b_s, _side(chunking, h_s))
        w_t, b_t = w_t.to(h_t.dtype), None if b_t is None else b_t.to(h_t.dtype)
        teacher_logits = reference_logits(h_t, w_t, b_t, _side(chunking, h_t))
        return reduced(reference_row_losses(student_logits, teacher_logits, labels, options), divisor)
    h_s, h_t = h_s.reshape(-1, h_s.shape[-1]), h_t.reshape(-1, h_t.shape[-1])
    flat_labels = None if labels is None else labels.reshape(-1).contiguous()
    heads = (h_s, w_s, b_s, h_t, w_t, b_t, flat_labels)
    if reduction == "none":
        if torch.compiler.is_compiling():
            loss = _per_row_forward_op(*heads, *options, *_op_chunking(chunking))[0]
        elif any(gradients_needed(h_s, w_s, b_s)):
            loss = _PerRowJsd.apply(*heads, options, chunking)
        else:  # nothing to differentiate: nothing kept
            loss = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), flat_labels, options, chunking)[0][0]
        return loss.view(leading)
    needs = gradients_needed(h_s, w_s, b_s)
    if torch.compiler.is_compiling():
        return _reduced_op(*heads, divisor, *options, *_op_chunking(chunking), *needs)[0]
    if any(needs):
        return _ReducedJsd.apply(*heads, options, divisor, chunking, needs)
    loss = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), flat_labels, options, chunking)[0][0]
    return reduced(loss, divisor)
