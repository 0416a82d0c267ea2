"""The JSD's per-chunk work on the LM-head engine (linear/engine.py), for linear_jsd: per chunk both heads' logits
(the student's h_s W_s^T (+ b_s) and the teacher's h_t W_t[:V_s]^T (+ b_t[:V_s]), the teacher weight's first V_s rows,
a view, no copy) from the engine's matmul, then the forward kernels (launch.py; rows split into column segments, so a
chunk of a few hundred rows still fills the GPU; their partials, 5 or 6 floats per row and segment, under 200 KiB a
chunk up to 8192 rows, are outside workspace_bytes) and, with a gradient to compute, the backward kernel into the
student's d logits, which the engine folds into the student's gradients.

The workspace budget (engine.rows_per_chunk) covers both chunks of logits, each in its head's dtype
(logits_dtype=float32: kept in float32, the student's d logits then written into a chunk of its own in the inputs'
dtype). skip_ignored_rows=True: the chunks run over the kept rows only (the engine's kept_rows, row_selections and
take_rows: their indices found with one host synchronisation, both heads' rows gathered, d h_s written back by
index). The teacher's hidden, weight and bias are constants.
"""

import torch

from ...core.options import KERNEL_DTYPES
from ...linear import engine
from . import launch

__all__ = ["NO_GRADS", "chunked_backward", "chunked_forward", "kept_rows_of", "side_chunking"]


NO_GRADS = (False, False, False)


def side_chunking(chunking, hidden):
    """chunking for one head: float32 logits only where its compute dtype is bf16 / fp16 (float32 and float64 heads
    already make float32 or wider logits)."""
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    return chunking._replace(float32_logits=chunking.float32_logits and half)


def _head_workspace(hidden, weight, bias, head_chunking, step):
    """One head's logits workspace (step, V) and its logits operands (logits_operands: a float32 copy only on the
    CPU, for float32 logits)."""
    dtype = torch.float32 if head_chunking.float32_logits else hidden.dtype
    workspace = torch.empty(step, weight.shape[0], dtype=dtype, device=hidden.device)
    return workspace, *engine.logits_operands(weight, bias, head_chunking)


def _row_chunks(student, teacher, labels, chunking, with_grads, kept=None):
    """Yields (rows, student hidden chunk, labels chunk or None, student logits, d student logits, teacher logits,
    first) chunk by chunk; the logits are views of workspaces that the next chunk overwrites. student, teacher:
    (hidden, weight, bias) in their compute dtypes, the teacher's weight and bias already its first V_s rows. d
    student logits: where the backward kernel writes (the student logits' own chunk, or next to float32 logits a
    chunk in the student's dtype, the products' operand). The budget counts both chunks of logits (logit_bytes: 4
    bytes a float32 logit, plus the student's gradient chunk in a pass with gradients). rows: a slice, or with
    `kept` (skip_ignored_rows) a slice of the kept rows' indices, both heads' hidden rows gathered (the engine's
    row_selections)."""
    (h_s, w_s, b_s), (h_t, w_t, b_t) = student, teacher
    student_chunking, teacher_chunking = side_chunking(chunking, h_s), side_chunking(chunking, h_t)
    vocab = w_s.shape[0]
    itemsize = engine.logit_bytes(h_s, student_chunking, with_grads) + engine.logit_bytes(h_t, teacher_chunking, False)
    step = engine.rows_per_chunk(engine.selected_count(h_s.shape[0], kept), vocab, itemsize, chunking.workspace_bytes)
    student_workspace, w_s, b_s = _head_workspace(h_s, w_s, b_s, student_chunking, step)
    teacher_workspace, w_t, b_t = _head_workspace(h_t, w_t, b_t, teacher_chunking, step)
    grad_workspace = student_workspace
    if with_grads and student_workspace.dtype != h_s.dtype:
        grad_workspace = torch.empty(step, vocab, dtype=h_s.dtype, device=h_s.device)
    for rows, width, first in engine.row_selections(h_s.shape[0], step, kept):
        hidden_chunk = engine.take_rows(h_s, rows)
        student_logits = engine.chunk_logits(student_workspace[:width], hidden_chunk, w_s, b_s)
        teacher_logits = engine.chunk_logits(teacher_workspace[:width], engine.take_rows(h_t, rows), w_t, b_t)
        labels_chunk = None if labels is None else engine.take_rows(labels, rows)
        yield rows, hidden_chunk, labels_chunk, student_logits, grad_workspace[:width], teacher_logits, first


def _in_compute_dtype(student, teacher):
    """Each head's weight and bias in its hidden's dtype (a cast copy only under autocast); a float64 teacher next
    to a kernel-dtype student is read as float32 (the kernels take no float64)."""
    student = (student[0], *engine.in_compute_dtype(*student))
    h_t, w_t, b_t = teacher
    if h_t.dtype not in KERNEL_DTYPES:
        h_t = h_t.to(torch.float32)
    return student, (h_t, *engine.in_compute_dtype(h_t, w_t, b_t))


def kept_rows_of(labels, options, chunking, kept=engine.FIND):
    """The kept rows of a pass: handed over (the eager "none" Function's backward gets its forward's), or found here
    (engine.kept_rows: one host synchronisation with skip_ignored_rows, None without)."""
    return engine.kept_rows(labels, options.ignore_index, chunking, "linear_jsd") if kept is engine.FIND else kept


def chunked_forward(student, teacher, labels, options, chunking, upstream=None, needs=NO_GRADS, kept=engine.FIND):
    """Per-row (loss, lse_s, lse_t, kl) (N,) float32 and, with any of `needs` (student hidden, weight, bias), the
    gradients of sum_rows upstream * loss_row (upstream: a 0-d float32 device tensor), chunk by chunk. chunking:
    workspace_bytes, accumulate_in_float32, float32_logits and skip_ignored_rows (chunk_rows unused). With kept
    rows the chunks cover only those; the others keep what the forward kernel gives an ignored row (0 in each
    statistic) and their rows of d hidden stay 0."""
    h_s, w_s, b_s = student
    with engine.kernel_context(h_s):
        kept = kept_rows_of(labels, options, chunking, kept)
        student_c, teacher_c = _in_compute_dtype(student, teacher)
        n_rows, device = h_s.shape[0], h_s.device
        if kept is None:
            out = launch.new_stats(n_rows, device)
        else:  # rows no chunk writes
            out = torch.zeros(4, n_rows, dtype=torch.float32, device=device).unbind(0)
        grads = engine.new_grads(h_s, w_s, b_s, needs, chunking, kept)
        for rows, hidden_chunk, labels_chunk, s_logits, s_grad, t_logits, first in _row_chunks(
            student_c, teacher_c, labels, chunking, any(needs), kept
        ):
            # A slice: the kernel writes into the full buffers (views); kept rows' indices: into the chunk's own,
            # scattered back.
            gathered = not isinstance(rows, slice)
            chunk_out = launch.new_stats(s_logits.shape[0], device) if gathered else [b[rows] for b in out]
            launch.jsd_forward(s_logits, t_logits, labels_chunk, options, chunk_out)
            if gathered:
                for whole, part in zip(out, chunk_out, strict=True):
                    whole[rows] = part
            if any(needs):  # d loss / d logits (in place of the student logits, or beside them), then the products
                launch.jsd_backward(upstream, s_logits, t_logits, labels_chunk, chunk_out[1:], s_grad, options)
                engine.accumulate_grads(s_grad, hidden_chunk, student_c[1], rows, grads, first)
        return out, engine.finish_grads(grads, w_s, b_s)


def chunked_backward(upstream, student, teacher, labels, stats, options, chunking, needs, kept=engine.FIND):
    """The gradients of sum_rows upstream_row * loss_row (upstream (N,) float32, any stride) from the forward's
    per-row stats = (lse_s, lse_t, kl), recomputing both chunks' logits (over the kept rows only, with them)."""
    h_s, w_s, b_s = student
    with engine.kernel_context(h_s):
        if not any(needs):
            return engine.new_grads(h_s, w_s, b_s, needs, chunking)
        kept = kept_rows_of(labels, options, chunking, kept)
        grads = engine.new_grads(h_s, w_s, b_s, needs, chunking, kept)
        student_c, teacher_c = _in_compute_dtype(student, teacher)
        for rows, hidden_chunk, labels_chunk, s_logits, s_grad, t_logits, first in _row_chunks(
            student_c, teacher_c, labels, chunking, True, kept
        ):
            chunk_stats = tuple(engine.take_rows(s, rows) for s in stats)
            chunk_upstream = engine.take_rows(upstream, rows)
            launch.jsd_backward(chunk_upstream, s_logits, t_logits, labels_chunk, chunk_stats, s_grad, options)
            engine.accumulate_grads(s_grad, hidden_chunk, student_c[1], rows, grads, first)
        return engine.finish_grads(grads, w_s, b_s)
