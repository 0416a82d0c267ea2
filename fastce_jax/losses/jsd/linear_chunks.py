"""The distillation loss from hidden states: ``linear_jsd``, ``jsd(h_s @ W_s.T + b_s, h_t @ W_t.T + b_t, ...)``
without either model's (N, V) logits.

Chunks of rows (a ``lax.fori_loop``, chunks.py's helpers and budget): per chunk the student's logits (rows, V) and
the teacher's (rows, V_t) come from one matmul each, in their inputs' dtypes with float32 accumulation; the jsd
forward kernels give each row's loss and statistics (the chunk's rows split into column segments, so that a chunk
of a few hundred rows fills the GPU: kernels/jsd.py). The workspace budget (``workspace_bytes``, 256 MiB by
default) covers both chunks of logits together; the forward's per-segment partials (at most 24 bytes a row plus
50 KiB, 60 KiB for a 384-row chunk) are outside it. A teacher head wider than the student's (V_t > V, a padded
vocabulary) is multiplied whole: JAX has no view of its first V rows, and a slice would copy the teacher's weight
(V x H_t) for every call, so the chunk's teacher product covers its V_t - V extra columns too and the kernels read
the first V. logits_dtype="float32" (bf16 / fp16 inputs): both chunks of logits float32 from the operands as they
are (chunks.chunk_logits), 4 bytes a logit against the budget; accumulate_in_float32: d W_s carried in float32 over
the chunks (chunks._accumulate_grads).

Gradients (student hidden, weight, bias only; the teacher's hidden, weight and bias enter under stop_gradient):
- "mean" / "sum": computed in the forward pass of the VJP (the backward kernel writes d logits into the student's
  chunk of logits, then d hidden = d logits W_s, d W_s += d logits^T h_s, d b_s += its column sums); the backward
  only scales them by the upstream scalar. A call that is not differentiated computes no gradient.
- "none": the forward keeps lse_s, lse_t and kl_s per row (3 N floats); the backward recomputes both chunks of
  logits and runs the backward kernel with the per-row upstream.
skip_ignored_rows=True: the fused linear CE's ordering and skipping (chunks.row_order, chunk_span, run_chunks): the
kept rows first, each chunk's rows of both hidden states gathered and d hidden scattered back, a chunk without a
kept row skipped under lax.cond; the kept count stays on the device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import contract, jsd_contract
from ..jsd import counted_rows, reduce_rows, reference_loss, reference_terms
from ..jsd_contract import MIXTURE, JsdOptions
from ..kernels import jsd as jsd_kernels
from . import chunks
from .api import _check_chunking, check_logits_dtype
from .autograd import _finish_grads


class LinearJsdConfig(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument). chunk_rows, dtype, f32_weight_grad,
    with_bias and weight_hv are the fields chunks.py's helpers read."""

    opts: JsdOptions
    interpret: bool
    reduction: str
    chunk_rows: int
    dtype: str  # the student's compute dtype (its inputs' promoted dtype)
    teacher_dtype: str
    with_bias: bool  # the student has a bias
    config: jsd_kernels.JsdConfig
    f32_weight_grad: bool = False  # accumulate_in_float32: d W_s summed over the chunks in float32
    weight_hv: bool = False  # chunks.py's layout flag: linear_jsd takes (V, H) weights only
    logits_dtype: str | None = None  # logits_dtype="float32" for a bf16 / fp16 student: its logits in float32
    teacher_logits_dtype: str | None = None  # the same for the teacher
    skip_ignored_rows: bool = False  # the kept rows first, chunks without one skipped (chunks.run_chunks)


# --- the chunk loops -----------------------------------------------------------------------------------------------


def _order(labels, st: LinearJsdConfig):
    """skip_ignored_rows' row order (chunks.row_order: the kept rows first), or None (the rows in their order)."""
    return chunks.row_order(labels, st.opts.ignore_index, st.skip_ignored_rows)


def _rows(array, start, st: LinearJsdConfig, index):
    return None if array is None else chunks._rows_of(array, start, st, index)


def _chunk_logits(k, student, teacher, labels, st: LinearJsdConfig, order):
    """(start, fresh, index, student hidden rows, labels rows, student logits, teacher logits) of chunk k
    (chunks.chunk_span: index, the rows' indices with skip_ignored_rows, else None)."""
    h_s, w_s, b_s = student
    h_t, w_t, b_t = teacher
    start, fresh, index = chunks.chunk_span(k, h_s.shape[0], st, order)
    hs_c = _rows(h_s, start, st, index)
    z_s = chunks.chunk_logits(hs_c, w_s, b_s, st.dtype, st.logits_dtype)
    z_t = chunks.chunk_logits(_rows(h_t, start, st, index), w_t, b_t, st.teacher_dtype, st.teacher_logits_dtype)
    return start, fresh, index, hs_c, _rows(labels, start, st, index), z_s, z_t


def _backward_into_chunk(z_s, z_t, y_c, beta, stats, g_c, st: LinearJsdConfig):
    return jsd_kernels.jsd_backward(
        z_s, z_t, y_c, beta, *stats, g_c, st.opts, inplace=True, interpret=st.interpret, config=st.config
    )


def chunked_forward(student, teacher, labels, beta, g_rows, st: LinearJsdConfig, keep_stats=False):
    """The chunk loop: per-row losses (N,); with g_rows (N,) the student's gradients of sum_t g_t loss_t (d hidden
    and d weight in the compute dtype, d bias float32 or None); with keep_stats the per-row (lse_s, lse_t, kl_s).
    skip_ignored_rows: rows no chunk covers keep the carry's zeros, what the kernels give an ignored row."""
    h_s, w_s, _ = student
    n = h_s.shape[0]
    want_grads = g_rows is not None
    names = ("lse_s", "lse_t", "kl") if keep_stats else ()
    order = _order(labels, st)

    def step(k, carry, first):
        start, fresh, index, hs_c, y_c, z_s, z_t = _chunk_logits(k, student, teacher, labels, st, order)
        loss_c, *stats_c = jsd_kernels.jsd_forward(
            z_s, z_t, y_c, beta, st.opts, interpret=st.interpret, config=st.config
        )
        out = {"losses": chunks._put_rows(carry["losses"], start, fresh, loss_c, index)}
        out.update({name: chunks._put_rows(carry[name], start, fresh, v, index) for name, v in zip(names, stats_c)})
        if want_grads:
            g_c = chunks._chunk_upstream(g_rows, start, fresh, st, index)
            d_logits = _backward_into_chunk(z_s, z_t, y_c, beta, stats_c, g_c, st)
            out.update(chunks._accumulate_grads(d_logits, hs_c, w_s, start, fresh, carry, first, st, index))
        return out

    def initial():
        carry = {name: jnp.zeros((n,), jnp.float32) for name in ("losses", *names)}
        if want_grads:
            carry["dh"] = jnp.zeros((n, h_s.shape[1]), st.dtype)
        return carry

    carry = chunks.run_chunks(n, st, order, initial, step, w_s if want_grads else None)
    grads = (carry["dh"], carry["dw"], carry.get("db")) if want_grads else None
    return carry["losses"], grads, tuple(carry[name] for name in names)


def chunked_backward(student, teacher, labels, beta, stats, g_rows, st: LinearJsdConfig):
    """The student's gradients of sum_t g_t loss_t from the saved per-row statistics: each chunk's logits are
    recomputed, then the backward kernel alone."""
    h_s, w_s, _ = student
    n = h_s.shape[0]
    order = _order(labels, st)

    def step(k, carry, first):
        start, fresh, index, hs_c, y_c, z_s, z_t = _chunk_logits(k, student, teacher, labels, st, order)
        stats_c = [_rows(s, start, st, index) for s in stats]
        g_c = chunks._chunk_upstream(g_rows, start, fresh, st, index)
        d_logits = _backward_into_chunk(z_s, z_t, y_c, beta, stats_c, g_c, st)
        return chunks._accumulate_grads(d_logits, hs_c, w_s, start, fresh, carry, first, st, index)

    def initial():
        return {"dh": jnp.zeros((n, h_s.shape[1]), st.dtype)}

    carry = chunks.run_chunks(n, st, order, initial, step, w_s)
    return carry["dh"], carry["dw"], carry.get("db")


# --- custom_vjps ----------------------------------------------------------------------------------------------------


def _row_scale(labels, n_rows: int, st: LinearJsdConfig):
    """d loss / d loss_t of "mean" / "sum" per row (traced, no host synchronisation); ignored rows get whatever:
    the kernels give them a zero gradient."""
    unit = jnp.ones((n_rows,), jnp.float32)
    return unit / counted_rows(labels, n_rows, st.opts.ignore_index) if st.reduction == "mean" else unit


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _reduced_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    losses, _, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st)
    return reduce_rows(losses, labels, st.reduction, st.opts.ignore_index)


def _reduced_fwd(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    g_rows = _row_scale(labels, h_s.shape[0], st)
    losses, grads, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, g_rows, st)
    # Zero-size stand-ins keep the inputs' dtypes for the backward's casts.
    likes = (h_s[:0], w_s[:0], None if b_s is None else b_s[:0])
    return reduce_rows(losses, labels, st.reduction, st.opts.ignore_index), (grads, likes)


def _reduced_bwd(st: LinearJsdConfig, residuals, g):
    grads, likes = residuals
    return (*_finish_grads(grads, *likes, scale=g.astype(jnp.float32)), None, None, None, None, None)


_reduced_loss.defvjp(_reduced_fwd, _reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _row_losses(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    return chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st)[0]


def _row_losses_fwd(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    losses, _, stats = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st, keep_stats=True)
    return losses, (h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, stats)


def _row_losses_bwd(st: LinearJsdConfig, residuals, g):
    h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, stats = residuals
    student = (h_s, w_s, b_s)
    grads = chunked_backward(student, (h_t, w_t, b_t), labels, beta, stats, g.astype(jnp.float32), st)
    return (*_finish_grads(grads, *student), None, None, None, None, None)


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


@functools.partial(jax.jit, static_argnames=("st",))
def _kernel_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, *, st: LinearJsdConfig):
    """The chunked kernel path, jitted once per static configuration (every beta in (0, 1) shares it)."""
    h_t, w_t, b_t = jax.lax.stop_gradient((h_t, w_t, b_t))
    loss_fn = _row_losses if st.reduction == "none" else _reduced_loss
    return loss_fn(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st)


@functools.partial(jax.jit, static_argnames=("opts", "reduction", "dtypes"))
def _reference_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, terms, *, opts: JsdOptions, reduction: str, dtypes):
    """backend="reference": both models' logits materialised (plain matmuls in their dtypes, or float32 logits:
    dtypes = (student, teacher, student logits, teacher logits)), then jsd's reference; jitted once per static
    configuration."""
    z_s = chunks.chunk_logits(h_s, w_s, b_s, dtypes[0], dtypes[2])
    z_t = chunks.chunk_logits(h_t, w_t, b_t, dtypes[1], dtypes[3])
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
    opts, beta = jsd_contract.check_jsd_options(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcapping=student_softcapping, teacher_softcapping=teacher_softcapping, backend=backend,
    )  # fmt: skip
    (student, dtype), (teacher, teacher_dtype) = jsd_contract.check_heads(
        (student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias)
    )
    lead = tuple(student[0].shape[:-1])
    vocab, vocab_t = student[1].shape[0], teacher[1].shape[0]
    labels = jsd_contract.check_jsd_labels(labels, lead, opts.ignore_index, "student_hidden")
    skip_ignored_rows = _check_chunking(workspace_bytes, None, accumulate_in_float32, skip_ignored_rows)
    logits_dtypes = (check_logits_dtype(logits_dtype, dtype), check_logits_dtype(logits_dtype, teacher_dtype))
    if backend == "auto":
        backend = "kernel" if contract.on_gpu(student[0]) else "reference"
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
        interpret=not contract.on_gpu(h_s),
        reduction=reduction,
        chunk_rows=chunks.rows_per_chunk(n_rows, logits_bytes, 1, workspace_bytes),
        dtype=dtype.name,
        teacher_dtype=teacher_dtype.name,
        with_bias=student[2] is not None,
        config=jsd_kernels.jsd_config(vocab),
        f32_weight_grad=bool(accumulate_in_float32),
        logits_dtype=logits_dtypes[0],
        teacher_logits_dtype=logits_dtypes[1],
        skip_ignored_rows=skip_ignored_rows,
    )
    beta_operand = jsd_kernels.beta_operand(beta) if opts.kind == MIXTURE else None
    with jsd_kernels.quiet_triton(st.interpret):
        loss = _kernel_loss(h_s, student[1], student[2], h_t, teacher[1], teacher[2], labels, beta_operand, st=st)
    return loss.reshape(lead) if reduction == "none" else loss
