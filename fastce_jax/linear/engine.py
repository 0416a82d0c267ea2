"""The LM-head engine: the chunk loop every fused linear loss runs on (linear_cross_entropy, linear_log_probs,
linear_jsd), loss-neutral and public. A loss computes the logits of a chunk of rows with ``chunk_logits``, runs its
own row kernels on them, and hands d logits back to ``accumulate_grads``; ``run_chunks`` drives the loop. Imports
core/ only, never a loss.

Chunks. The rows are processed in chunks of ``rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes,
chunk_rows)`` rows: the workspace budget (the ``workspace_bytes`` keyword, by default ``DEFAULT_WORKSPACE_BYTES`` =
256 MiB of logits) split evenly over as few chunks as it allows, rounded up to a multiple of ``ROWS_MULTIPLE``
(whole matmul tiles); the ``chunk_rows`` keyword, when given, overrides it. Per chunk (a ``lax.fori_loop`` step,
``run_chunks``): the logits come from one matmul in the inputs' dtype (``chunk_logits``), the loss's kernels give
each row's statistics and overwrite the same fresh logits with d loss / d logits, and two matmuls fold that into the
chunk's rows of d hidden and into d weight (a column sum into d bias: ``accumulate_grads``). The last chunk is not
padded (shapes are static): its start is clamped to N - chunk rows (``chunk_span``), and the rows it shares with the
chunk before get an upstream gradient of 0 (``chunk_upstream``) and keep the values already written (``put_rows``),
so no padded copy of hidden or of its gradient is made.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats. logits_dtype="float32" (bf16 / fp16 inputs,
``check_logits_dtype``): the chunk matmul takes the operands as they are and returns float32 logits
(preferred_element_type), the kernels read float32 and the budget counts 4 bytes per logit (half the rows per chunk
of bf16 logits).

Ignored rows: by default every row costs its matmuls. skip_ignored_rows=True orders the chunk loop's rows kept
first (``row_order``: a stable argsort of the ignored mask, traced, as a ``RowOrder``), gathers each chunk's rows of
hidden (``rows_of``) and scatters its rows of d hidden back (``put_rows``), and runs each chunk under a lax.cond on
whether it holds a kept row: the chunks after the last kept row compute nothing. The kept-row count stays on the
device (nothing for the caller to wait on, jit-compatible), but XLA's GPU runtime executes a conditional outside a
command buffer by copying its predicate to the host and waiting for it (ConditionalThunk): one wait per chunk,
unless XLA_FLAGS' --xla_gpu_enable_command_buffer includes CONDITIONAL (a CUDA-graph conditional node);
docs/fused-linear.md gives what that costs on the H200.

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(accumulate_in_float32=True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.
``finish_grads`` scales (by the upstream) and casts each gradient to its input's dtype once at the end.

The names: DEFAULT_WORKSPACE_BYTES, ROWS_MULTIPLE, rows_per_chunk (the budget); check_chunking, check_logits_dtype
(the keywords every linear loss shares); vocab_axis (the weight's vocabulary axis); RowOrder, row_order, chunk_span,
rows_of, chunk_upstream, put_rows (a chunk's rows); chunk_logits (its matmul); accumulate_grads, zero_weight_grads,
finish_grads (the gradients); run_chunks (the loop). A config ``st`` is any record with the fields they read:
chunk_rows, dtype, f32_weight_grad, with_bias, weight_hv (the fused linear CE's StaticConfig, linear_jsd's
LinearJsdConfig).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core.options import check_flag, ignore_value

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "ROWS_MULTIPLE",
    "rows_per_chunk",
    "check_chunking",
    "LOGITS_DTYPE_ERROR",
    "check_logits_dtype",
    "vocab_axis",
    "RowOrder",
    "row_order",
    "rows_of",
    "chunk_span",
    "chunk_upstream",
    "chunk_logits",
    "put_rows",
    "accumulate_grads",
    "finish_grads",
    "zero_weight_grads",
    "run_chunks",
]

# At 256 MiB the workspace holds 1024 rows of bf16 logits at V=128256, 512 at V=256000.
DEFAULT_WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many


def rows_per_chunk(n_rows: int, vocab: int, itemsize: int, workspace_bytes=None, chunk_rows=None) -> int:
    """Rows per chunk: chunk_rows when given; else the workspace budget (DEFAULT_WORKSPACE_BYTES when None) split
    evenly over as few chunks as it allows (so the clamped last chunk repeats little work), rounded up to
    ROWS_MULTIPLE when the budget holds that many rows; never more than n_rows, at least 1."""
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


def check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False):
    """The chunking keywords every linear loss shares: workspace_bytes and chunk_rows positive ints or None,
    accumulate_in_float32 and skip_ignored_rows bools; returns skip_ignored_rows as a bool."""
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    check_flag(accumulate_in_float32, "accumulate_in_float32")
    return check_flag(skip_ignored_rows, "skip_ignored_rows")


LOGITS_DTYPE_ERROR = 'logits_dtype must be None, "float32" or jnp.float32, got {!r}'


def check_logits_dtype(logits_dtype, dtype):
    """The chunks' logits dtype: None (the operands' dtype, as today) or float32; a no-op (None) when the operands
    are float32 or float64 already."""
    if logits_dtype is None:
        return None
    f32 = (
        (isinstance(logits_dtype, str) and logits_dtype == "float32")
        or logits_dtype is jnp.float32
        or logits_dtype is np.float32
        or (isinstance(logits_dtype, np.dtype) and logits_dtype == np.float32)
    )
    if not f32:
        raise ValueError(LOGITS_DTYPE_ERROR.format(logits_dtype))
    return None if dtype.itemsize >= 4 else "float32"


def vocab_axis(st) -> int:
    """The weight's vocabulary axis: 0 for (V, H), 1 for weight_layout="hv" (H, V)."""
    return 1 if st.weight_hv else 0


class RowOrder(NamedTuple):
    """skip_ignored_rows: the chunk loop's row order, the kept rows first (in their own order, a stable sort), and
    how many rows are kept (traced: it stays on the device)."""

    rows: jax.Array  # (N,) int32: position p of the loop is row rows[p]
    n_kept: jax.Array  # int32 scalar


def row_order(labels, ignore_index: int, skip_ignored_rows: bool):
    """The RowOrder of skip_ignored_rows, or None (the rows in their order; also without labels or when no label can
    be ignored)."""
    if not skip_ignored_rows or labels is None:
        return None
    ign = ignore_value(labels.dtype, ignore_index)
    if ign is None:
        return None
    ignored = (labels == ign).astype(jnp.int32)
    rows = jnp.argsort(ignored, stable=True).astype(jnp.int32)
    return RowOrder(rows, (labels.shape[0] - jnp.sum(ignored)).astype(jnp.int32))


def rows_of(array, start, st, index):
    """array's chunk rows: a slice at start, or with skip_ignored_rows the rows `index` (a gather)."""
    if index is None:
        return jax.lax.dynamic_slice_in_dim(array, start, st.chunk_rows, axis=0)
    return jnp.take(array, index, axis=0, unique_indices=True, indices_are_sorted=False, mode="clip")


def chunk_span(k, n_rows: int, st, order=None):
    """Chunk k of n_rows rows: its clamped start, the mask of rows that are new in this chunk, and the rows' indices
    with skip_ignored_rows (a RowOrder; None otherwise). st: any config with chunk_rows (the fused linear CE's and
    linear_jsd's)."""
    rows = st.chunk_rows
    start = jnp.minimum(k * rows, n_rows - rows)
    fresh = start + jnp.arange(rows) >= k * rows
    index = None if order is None else jax.lax.dynamic_slice_in_dim(order.rows, start, rows)
    return start, fresh, index


def chunk_upstream(g_tokens, start, fresh, st, index=None):
    """Chunk rows' upstream factors, 0 on the rows an earlier chunk already covered (so they add nothing to the
    weight and bias gradients; their hidden rows are not written)."""
    return jnp.where(fresh, rows_of(g_tokens, start, st, index), 0.0)


def chunk_logits(h_c, weight, bias, dtype, logits_dtype=None, hv=False):
    """h_c @ weight.T + bias from dtype operands (float32 accumulation inside the matmul), rounded to dtype, or with
    logits_dtype float32 kept in float32 (the bias added in float32): no float32 copy of either operand. hv: weight
    is (H, V) and the matmul contracts its axis 0 as stored (no transposed copy)."""
    dt = jnp.dtype(dtype)
    out = dt if logits_dtype is None else jnp.dtype(logits_dtype)
    dims = (((1,), (0 if hv else 1,)), ((), ()))
    logits = jax.lax.dot_general(h_c.astype(dt), weight.astype(dt), dims, preferred_element_type=out)
    if bias is not None:
        logits = logits + bias.astype(out)
    return logits


def put_rows(buffer, start, fresh, values, index=None):
    """Write values into buffer[start:start+rows] (or its rows `index`) where fresh, keep the old rows elsewhere."""
    mask = fresh.reshape(fresh.shape + (1,) * (values.ndim - 1))
    if index is not None:
        old = jnp.take(buffer, index, axis=0, unique_indices=True, mode="clip")
        return buffer.at[index].set(jnp.where(mask, values, old), unique_indices=True, mode="clip")
    old = jax.lax.dynamic_slice_in_dim(buffer, start, values.shape[0], axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, values, old), start, axis=0)


def accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index=None):
    """The carry's gradients with chunk k's added: its fresh rows of dhidden (compute dtype), its product into
    dweight (float32 with accumulate_in_float32, else the compute dtype), its column sums into dbias
    (float32). Chunk 0 (``first``) starts dweight and dbias instead of adding to zeros."""
    dt = jnp.dtype(st.dtype)
    d_f32 = dlogits  # float32 with logits_dtype="float32": the bias gradient sums it before any rounding
    # The products take d logits in the operands' dtype, as an unfused lm_head's backward does: float32 d logits
    # times a bf16 weight would promote the weight, a weight-sized float32 copy per chunk, for no accuracy the
    # bf16 result keeps (measured, N=512, H=256, V=4096 against float64: rms error of d hidden and d weight relative
    # to their rms 1.69e-3 from bf16 d logits, 1.66e-3 from float32: the gradients' own rounding dominates).
    dlogits = dlogits.astype(dt)
    # weight_layout="hv": the same products contracting the (H, V) weight's V axis, and d weight made (H, V) (h_c^T
    # d logits rather than its transpose): no transposed copy of the weight or of its gradient.
    v_axis = vocab_axis(st)
    dims = (((1,), (v_axis,)), ((), ()))
    dh_c = jax.lax.dot_general(dlogits, weight.astype(dt), dims, preferred_element_type=dt)
    acc = jnp.float32 if st.f32_weight_grad else dt
    pair = (h_c.astype(dt), dlogits) if st.weight_hv else (dlogits, h_c.astype(dt))
    dw_c = jax.lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=acc)
    out = dict(dh=put_rows(carry["dh"], start, fresh, dh_c, index), dw=dw_c if first else carry["dw"] + dw_c)
    if st.with_bias:
        db_c = jnp.sum(d_f32.astype(jnp.float32), axis=0)
        out["db"] = db_c if first else carry["db"] + db_c
    return out


def finish_grads(grads, hidden, weight, bias, scale=None, extra=None):
    """Scale (by the upstream, when given) and cast each gradient to its input's dtype: one fused pass each; extra:
    gradients to add before the cast (the returned z_loss's), or None."""
    dh, dw, db = grads
    extra = (None, None, None) if extra is None else extra

    def fin(g, like, more):
        # A bf16 gradient times the float32 scale is computed in float32 and rounded once.
        g = g if scale is None else g * scale
        return (g if more is None else g + more).astype(like.dtype)

    return fin(dh, hidden, extra[0]), fin(dw, weight, extra[1]), None if bias is None else fin(db, bias, extra[2])


def _loop(n_rows, st, first, body):
    """Chunk 0 by ``first`` (it creates the carry, so the weight gradient starts as chunk 0's product instead of
    zeros plus it), the others by ``body`` in a fori_loop."""
    n_chunks = -(-n_rows // st.chunk_rows)
    carry = first()
    if n_chunks > 1:
        carry = jax.lax.fori_loop(1, n_chunks, body, carry)
    return carry


def _skipping_loop(n_rows, st, order: RowOrder, initial, body):
    """skip_ignored_rows: every chunk by ``body`` (chunk 0 adds to the zeros of ``initial()``'s carry) under a
    lax.cond on the device: a chunk none of whose new rows is kept (the kept rows come first, so every chunk after
    the last kept row) runs nothing and passes the carry on."""

    def chunk(k, carry):
        return jax.lax.cond(k * st.chunk_rows < order.n_kept, functools.partial(body, k), lambda c: c, carry)

    return jax.lax.fori_loop(0, -(-n_rows // st.chunk_rows), chunk, initial())


def zero_weight_grads(weight, st):
    """The weight and bias gradients' carry before any chunk (skip_ignored_rows: chunk 0 may be skipped)."""
    dt = jnp.dtype(st.dtype)
    out = dict(dw=jnp.zeros(weight.shape, jnp.float32 if st.f32_weight_grad else dt))
    if st.with_bias:
        out["db"] = jnp.zeros((weight.shape[vocab_axis(st)],), jnp.float32)
    return out


def run_chunks(n_rows, st, order, initial, step, weight=None):
    """The chunk loop of ``step(k, carry, first)`` from ``initial()``'s carry (the fused linear CE's and
    linear_jsd's): without an order chunk 0 first (first=True: it starts the weight gradients) then the others in a
    fori_loop; with an order (skip_ignored_rows) every chunk under lax.cond, the carry then starting with zero
    weight and bias gradients when ``weight`` is given (a pass that computes them). Returns the last carry."""
    body = functools.partial(step, first=False)
    if order is None:
        return _loop(n_rows, st, lambda: step(0, initial(), first=True), body)
    start = initial if weight is None else lambda: {**initial(), **zero_weight_grads(weight, st)}
    return _skipping_loop(n_rows, st, order, start, body)
