"""The fused linear distillation loss: `linear_jsd`, fastce_torch.jsd(student_hidden @ W_s.T + b_s,
teacher_hidden @ W_t.T + b_t, ...) without the (N, V) logits of either model, on the LM-head engine (linear/engine.py):
the chunk loops are linear_chunks.py, the eager Functions and custom ops linear_autograd.py.

Chunks of rows (the engine's rows_per_chunk: the workspace budget, DEFAULT_WORKSPACE_BYTES = 256 MiB by default,
covers both chunks of logits, student's and teacher's, each in its head's dtype), matmuls accumulating in float32 and
rounding once to the inputs' dtype. accumulate_in_float32: d W_s summed over the chunks in float32. The teacher's
hidden, weight and bias are constants (detached: no gradient, whether or not they require one). Gradients are
computed only with grad mode on and a student input requiring one.
"""

import torch

from ...core.options import use_kernel
from ...linear import engine
from .linear_autograd import PerRowJsd, ReducedJsd, per_row_forward_op, reduced_op
from .linear_chunks import chunked_forward, side_chunking
from .options import check_heads, check_jsd_labels, check_jsd_options, row_divisor
from .reference import reduced, reference_row_losses

__all__ = ["linear_jsd"]


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
    options = check_jsd_options(
        beta, temperature, ignore_index, reduction, student_softcapping, teacher_softcapping, backend
    )
    check_heads((student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias))
    check_jsd_labels(labels, student_hidden, "student_hidden")
    vocab = student_weight.shape[0]
    chunking = engine.check_chunking(workspace_bytes, None, accumulate_in_float32, skip_ignored_rows)
    leading = student_hidden.shape[:-1]
    h_s, w_s, b_s = engine.autocast_or_common_dtype(student_hidden, student_weight, student_bias)
    # The teacher: constants, its weight's (and bias's) first V_s rows as views.
    teacher = (teacher_hidden, teacher_weight[:vocab], None if teacher_bias is None else teacher_bias[:vocab])
    h_t, w_t, b_t = (None if t is None else t.detach() for t in engine.autocast_or_common_dtype(*teacher))
    float32_logits = any([engine.check_logits_dtype(logits_dtype, h.dtype) for h in (h_s, h_t)])
    chunking = chunking._replace(float32_logits=float32_logits)
    divisor = row_divisor(labels, leading.numel(), reduction, ignore_index, h_s.device)
    if not use_kernel(h_s, backend):
        student_logits = engine.reference_logits(h_s, w_s, b_s, side_chunking(chunking, h_s))
        w_t, b_t = w_t.to(h_t.dtype), None if b_t is None else b_t.to(h_t.dtype)
        teacher_logits = engine.reference_logits(h_t, w_t, b_t, side_chunking(chunking, h_t))
        return reduced(reference_row_losses(student_logits, teacher_logits, labels, options), divisor)
    h_s, h_t = h_s.reshape(-1, h_s.shape[-1]), h_t.reshape(-1, h_t.shape[-1])
    flat_labels = None if labels is None else labels.reshape(-1).contiguous()
    heads = (h_s, w_s, b_s, h_t, w_t, b_t, flat_labels)
    if reduction == "none":
        if torch.compiler.is_compiling():
            loss = per_row_forward_op(*heads, *options, *chunking)[0]
        elif any(engine.gradients_needed(h_s, w_s, b_s)):
            loss = PerRowJsd.apply(*heads, options, chunking)
        else:  # nothing to differentiate: nothing kept
            loss = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), flat_labels, options, chunking)[0][0]
        return loss.view(leading)
    needs = engine.gradients_needed(h_s, w_s, b_s)
    if torch.compiler.is_compiling():
        return reduced_op(*heads, divisor, *options, *chunking, *needs)[0]
    if any(needs):
        return ReducedJsd.apply(*heads, options, divisor, chunking, needs)
    loss = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), flat_labels, options, chunking)[0][0]
    return reduced(loss, divisor)
