"""The public ``linear_jsd``: ``jsd(student_hidden @ student_weight.T + student_bias, teacher_hidden @
teacher_weight.T + teacher_bias, labels, ...)`` without either model's (N, V) logits: its checks, the reference path
(both logits materialised) and the call of the chunked kernel path (linear_autograd.kernel_loss).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core.launch import quiet_triton
from ...core.options import on_gpu
from ...linear import engine
from . import linear_autograd
from .launch import beta_operand, jsd_config
from .linear_chunks import LinearJsdConfig
from .options import MIXTURE, JsdOptions, check_heads, check_jsd_labels, check_jsd_options
from .reference import reference_loss, reference_terms

__all__ = ["linear_jsd"]


@functools.partial(jax.jit, static_argnames=("opts", "reduction", "dtypes"))
def _reference_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, terms, *, opts: JsdOptions, reduction: str, dtypes):
    """backend="reference": both models' logits materialised (plain matmuls in their dtypes, or float32 logits:
    dtypes = (student, teacher, student logits, teacher logits)), then jsd's reference; jitted once per static
    configuration."""
    z_s = engine.chunk_logits(h_s, w_s, b_s, dtypes[0], dtypes[2])
    z_t = engine.chunk_logits(h_t, w_t, b_t, dtypes[1], dtypes[3])
    return reference_loss(z_s, z_t, labels, terms, opts, reduction)


# --- public API -----------------------------------------------------------------------------------------------------


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
    """``jsd(student_hidden @ student_weight.T + student_bias, teacher_hidden @ teacher_weight.T + teacher_bias,
    labels, ...)`` without the (N, V) logits of either model (``fastce_jax.jsd`` defines the loss and every
    keyword it shares).

    Args:
      student_hidden: (..., H_s); student_weight: (V, H_s), the lm_head layout; student_bias: (V,) or None.
      teacher_hidden: (..., H_t), the student's leading shape; teacher_weight: (V_t, H_t) with V_t >= V (a padded
        head: its first V rows are compared); teacher_bias: (V_t,) or None.
      workspace_bytes: the budget of one chunk of both models' logits (None: 256 MiB).
      accumulate_in_float32: sum a bf16 / fp16 student weight's gradient over the chunks in float32, rounded once
        (linear_cross_entropy's keyword; 4 V H bytes more).
      logits_dtype: None (each model's logits in its inputs' dtype) or "float32" / jnp.float32: with bf16 / fp16
        inputs both chunk GEMMs take the operands as they are and give float32 logits (``preferred_element_type``,
        no float32 copy of either weight); the budget counts 4 bytes a logit. The JSD gradient p_s - p_t is a
        difference of nearly equal numbers: logits rounded to bf16 move it by percents at a realistic logit
        spread. d logits is rounded to the student's dtype for the products (as linear_cross_entropy's).
      skip_ignored_rows: True (the kernel path only; linear_cross_entropy's keyword, the same meaning): the chunk
        loop takes the rows whose label is not ignore_index first (a stable sort on the device, both heads' hidden
        rows gathered chunk by chunk) and runs each chunk under a lax.cond on whether it holds a kept row, so the
        chunks past the last kept row compute nothing. The same loss and gradients (0 and a zero d hidden on
        ignored rows; "mean" divides by the same count); the kept count stays on the device (jit, grad and vmap
        work; under vmap with batched labels the cond computes both branches). Nothing to skip without labels.
      backend: "auto" (the chunked kernel path for GPU arrays, "reference" elsewhere; traced, the arrays are
        assumed on the default backend, as linear_cross_entropy does), "kernel" or "reference" (the plain
        matmuls, then jsd's jnp reference: it materialises both logits). A float64 student or teacher is computed
        by the reference in float64.

    Each model's logits are computed in its inputs' promoted dtype (float32 accumulation). The loss is float32
    (float64 for a float64 student). Gradients reach the student's hidden, weight and bias, in their dtypes; the
    teacher's get zeros (stop_gradient). jit, grad and vmap work.
    """
    opts, beta = check_jsd_options(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcapping=student_softcapping, teacher_softcapping=teacher_softcapping, backend=backend,
    )  # fmt: skip
    (student, dtype), (teacher, teacher_dtype) = check_heads(
        (student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias)
    )
    lead = tuple(student[0].shape[:-1])
    vocab, vocab_t = student[1].shape[0], teacher[1].shape[0]
    labels = check_jsd_labels(labels, lead, opts.ignore_index, "student_hidden")
    skip_ignored_rows = engine.check_chunking(workspace_bytes, None, accumulate_in_float32, skip_ignored_rows)
    logits_dtypes = (
        engine.check_logits_dtype(logits_dtype, dtype),
        engine.check_logits_dtype(logits_dtype, teacher_dtype),
    )
    if backend == "auto":
        backend = "kernel" if on_gpu(student[0]) else "reference"
    labels = None if labels is None else jnp.asarray(labels).reshape(-1)
    h_s, h_t = student[0].reshape(-1, student[0].shape[-1]), teacher[0].reshape(-1, teacher[0].shape[-1])
    n_rows = h_s.shape[0]
    if backend == "reference" or n_rows == 0 or jnp.float64 in (dtype, teacher_dtype):
        loss = _reference_loss(
            h_s,
            *student[1:],
            h_t,
            *teacher[1:],
            labels,
            reference_terms(beta, opts, dtype),
            opts=opts,
            reduction=reduction,
            dtypes=(dtype.name, teacher_dtype.name, *logits_dtypes),
        )
        return loss.reshape(lead) if reduction == "none" else loss
    itemsizes = [4 if f32 else d.itemsize for f32, d in zip(logits_dtypes, (dtype, teacher_dtype))]
    logits_bytes = vocab * itemsizes[0] + vocab_t * itemsizes[1]
    st = LinearJsdConfig(
        opts=opts,
        interpret=not on_gpu(h_s),
        reduction=reduction,
        chunk_rows=engine.rows_per_chunk(n_rows, logits_bytes, 1, workspace_bytes),
        dtype=dtype.name,
        teacher_dtype=teacher_dtype.name,
        with_bias=student[2] is not None,
        config=jsd_config(vocab),
        f32_weight_grad=bool(accumulate_in_float32),
        logits_dtype=logits_dtypes[0],
        teacher_logits_dtype=logits_dtypes[1],
        skip_ignored_rows=skip_ignored_rows,
    )
    operand = beta_operand(beta) if opts.kind == MIXTURE else None
    with quiet_triton(st.interpret):
        loss = linear_autograd.kernel_loss(
            h_s, student[1], student[2], h_t, teacher[1], teacher[2], labels, operand, st=st
        )
    return loss.reshape(lead) if reduction == "none" else loss
