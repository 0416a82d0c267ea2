"""The fused linear distillation loss's chunk loops on the LM-head engine: ``linear_jsd`` (linear_api.py),
``jsd(h_s @ W_s.T + b_s, h_t @ W_t.T + b_t, ...)`` without either model's (N, V) logits; its custom_vjps are
linear_autograd.py's.

Chunks of rows (a ``lax.fori_loop``: the LM-head engine's loop, helpers and budget, fastce_jax/linear/engine.py): per
chunk the student's logits (rows, V) and the teacher's (rows, V_t) come from one matmul each, in their inputs' dtypes
with float32 accumulation; the jsd forward kernels give each row's loss and statistics (the chunk's rows split into
column segments, so that a chunk of a few hundred rows fills the GPU: launch.py). The workspace budget
(``workspace_bytes``, 256 MiB by default) covers both chunks of logits together; the forward's per-segment partials (at
most 24 bytes a row plus 50 KiB, 60 KiB for a 384-row chunk) are outside it. A teacher head wider than the student's
(V_t > V, a padded vocabulary) is multiplied whole: JAX has no view of its first V rows, and a slice would copy the
teacher's weight (V x H_t) for every call, so the chunk's teacher product covers its V_t - V extra columns too and the
kernels read the first V. logits_dtype="float32" (bf16 / fp16 inputs): both chunks of logits float32 from the operands
as they are (engine.chunk_logits), 4 bytes a logit against the budget; accumulate_in_float32: d W_s carried in float32
over the chunks (engine.accumulate_grads).

Gradients (student hidden, weight, bias only; the teacher's hidden, weight and bias enter under stop_gradient):
- "mean" / "sum": computed in the forward pass of the VJP (the backward kernel writes d logits into the student's
  chunk of logits, then d hidden = d logits W_s, d W_s += d logits^T h_s, d b_s += its column sums); the backward
  only scales them by the upstream scalar. A call that is not differentiated computes no gradient.
- "none": the forward keeps lse_s, lse_t and kl_s per row (3 N floats); the backward recomputes both chunks of
  logits and runs the backward kernel with the per-row upstream.
skip_ignored_rows=True: the fused linear CE's ordering and skipping (engine.row_order, chunk_span, run_chunks): the
kept rows first, each chunk's rows of both hidden states gathered and d hidden scattered back, a chunk without a
kept row skipped under lax.cond; the kept count stays on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from ...linear import engine
from .launch import JsdConfig, jsd_backward, jsd_forward
from .options import JsdOptions

__all__ = ["LinearJsdConfig", "chunked_forward", "chunked_backward"]


class LinearJsdConfig(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument). chunk_rows, dtype, f32_weight_grad,
    with_bias and weight_hv are the fields the engine's helpers read."""

    opts: JsdOptions
    interpret: bool
    reduction: str
    chunk_rows: int
    dtype: str  # the student's compute dtype (its inputs' promoted dtype)
    teacher_dtype: str
    with_bias: bool  # the student has a bias
    config: JsdConfig
    f32_weight_grad: bool = False  # accumulate_in_float32: d W_s summed over the chunks in float32
    weight_hv: bool = False  # the engine's layout flag: linear_jsd takes (V, H) weights only
    logits_dtype: str | None = None  # logits_dtype="float32" for a bf16 / fp16 student: its logits in float32
    teacher_logits_dtype: str | None = None  # the same for the teacher
    skip_ignored_rows: bool = False  # the kept rows first, chunks without one skipped (engine.run_chunks)


# --- the chunk loops -----------------------------------------------------------------------------------------------


def _order(labels, st: LinearJsdConfig):
    """skip_ignored_rows' row order (engine.row_order: the kept rows first), or None (the rows in their order)."""
    return engine.row_order(labels, st.opts.ignore_index, st.skip_ignored_rows)


def _rows(array, start, st: LinearJsdConfig, index):
    return None if array is None else engine.rows_of(array, start, st, index)


def _chunk_logits(k, student, teacher, labels, st: LinearJsdConfig, order):
    """(start, fresh, index, student hidden rows, labels rows, student logits, teacher logits) of chunk k
    (engine.chunk_span: index, the rows' indices with skip_ignored_rows, else None)."""
    h_s, w_s, b_s = student
    h_t, w_t, b_t = teacher
    start, fresh, index = engine.chunk_span(k, h_s.shape[0], st, order)
    hs_c = _rows(h_s, start, st, index)
    z_s = engine.chunk_logits(hs_c, w_s, b_s, st.dtype, st.logits_dtype)
    z_t = engine.chunk_logits(_rows(h_t, start, st, index), w_t, b_t, st.teacher_dtype, st.teacher_logits_dtype)
    return start, fresh, index, hs_c, _rows(labels, start, st, index), z_s, z_t


def _backward_into_chunk(z_s, z_t, y_c, beta, stats, g_c, st: LinearJsdConfig):
    return jsd_backward(
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
        loss_c, *stats_c = jsd_forward(z_s, z_t, y_c, beta, st.opts, interpret=st.interpret, config=st.config)
        out = {"losses": engine.put_rows(carry["losses"], start, fresh, loss_c, index)}
        out.update({name: engine.put_rows(carry[name], start, fresh, v, index) for name, v in zip(names, stats_c)})
        if want_grads:
            g_c = engine.chunk_upstream(g_rows, start, fresh, st, index)
            d_logits = _backward_into_chunk(z_s, z_t, y_c, beta, stats_c, g_c, st)
            out.update(engine.accumulate_grads(d_logits, hs_c, w_s, start, fresh, carry, first, st, index))
        return out

    def initial():
        carry = {name: jnp.zeros((n,), jnp.float32) for name in ("losses", *names)}
        if want_grads:
            carry["dh"] = jnp.zeros((n, h_s.shape[1]), st.dtype)
        return carry

    carry = engine.run_chunks(n, st, order, initial, step, w_s if want_grads else None)
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
        g_c = engine.chunk_upstream(g_rows, start, fresh, st, index)
        d_logits = _backward_into_chunk(z_s, z_t, y_c, beta, stats_c, g_c, st)
        return engine.accumulate_grads(d_logits, hs_c, w_s, start, fresh, carry, first, st, index)

    def initial():
        return {"dh": jnp.zeros((n, h_s.shape[1]), st.dtype)}

    carry = engine.run_chunks(n, st, order, initial, step, w_s)
    return carry["dh"], carry["dw"], carry.get("db")
