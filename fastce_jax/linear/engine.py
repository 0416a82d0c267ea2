"""The chunk loop of the fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)`
chunk by chunk, without the (N, V) logits.

Chunks. The rows are processed in chunks of `rows_per_chunk(n_rows, vocab, itemsize, workspace_bytes, chunk_rows)`
rows: the workspace budget (the `workspace_bytes` keyword, by default `DEFAULT_WORKSPACE_BYTES` = 256 MiB of logits)
split evenly over as few chunks as it allows, rounded up to a multiple of `ROWS_MULTIPLE` (whole matmul tiles); the
`chunk_rows` keyword, when given, overrides it. Per chunk (a `lax.fori_loop` step): the
logits come from one matmul in the inputs' dtype, fastce's forward kernel gives each row's loss and log-sum-exp
(`_ce_forward`), the backward kernel overwrites the same fresh logits with d loss / d logits
(`_ce_backward_in_place`), and two matmuls fold that into the chunk's rows of d hidden and into d weight (a column
sum into d bias). The last chunk is not padded (shapes are static): its start is clamped to N - chunk rows, and the
rows it shares with the chunk before get an upstream gradient of 0 and keep the values already written, so no
padded copy of hidden or of its gradient is made.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats. logits_dtype="float32" (bf16 / fp16 inputs):
the chunk matmul takes the operands as they are and returns float32 logits (preferred_element_type), the kernels
read float32 and the budget counts 4 bytes per logit (half the rows per chunk of bf16 logits).

Entropy's gradient: a differentiated entropy output adds g_H,t p_j (mz_t - z_j) dz/dx to the backward kernel's
d logits (mz = lse - H per row, saved by the forward), so the per-token path's recomputing backward carries it at
no extra matmul; "mean" / "sum" run a recomputing backward for it (as for a differentiated z_loss output).

Ignored rows: by default every row costs its matmuls. skip_ignored_rows=True orders the chunk loop's rows kept
first (a stable argsort of the ignored mask, traced), gathers each chunk's rows of hidden and scatters its rows of
d hidden back, and runs each chunk under a lax.cond on whether it holds a kept row: the chunks after the last kept
row compute nothing. The kept-row count stays on the device (nothing for the caller to wait on, jit-compatible),
but XLA's GPU runtime executes a conditional outside a command buffer by copying its predicate to the host and
waiting for it (ConditionalThunk): one wait per chunk, unless XLA_FLAGS' --xla_gpu_enable_command_buffer includes
CONDITIONAL (a CUDA-graph conditional node); docs/fused-linear.md gives what that costs on the H200. linear_jsd's
loop (jsd.py) orders and skips the same way through the same helpers (row_order, chunk_span, run_chunks).

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(accumulate_in_float32=True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.

The labels reach the kernels as given, with the caller's ignore_index (as in cross_entropy).

The loop runs on the whole arrays it is given; autograd.py routes a partitioned call (several devices) through
sharded.py, whose per-device computation is this loop on each device's block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import contract, kernels, ops
from ..contract import Options

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


class StaticConfig(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument)."""

    options: Options
    interpret: bool  # Pallas interpret mode (off GPU)
    reduction: str
    chunk_rows: int
    dtype: str  # compute dtype of the matmul operands (the inputs' promoted dtype)
    f32_weight_grad: bool
    with_bias: bool
    forward_config: kernels.ForwardConfig
    backward_config: kernels.BackwardConfig
    returns: contract.Extras = contract.NO_EXTRAS  # the extra outputs asked for
    skip_ignored_rows: bool = False  # chunks over the kept rows first; chunks without one skipped (lax.cond)
    partitioned: bool = False  # the chunk loop through sharded.py's custom_partitioning (several devices)
    vocab_layout: object = None  # inside a partitioned loop: (mesh, vocabulary axes, V) of a vocabulary block
    logits_dtype: str | None = None  # logits_dtype="float32": the chunk's logits in float32 from dtype operands
    weight_hv: bool = False  # weight_layout="hv": the weight is (H, V) (a Flax Dense kernel), its gradient too


def vocab_axis(st: StaticConfig) -> int:
    """The weight's vocabulary axis: 0 for (V, H), 1 for weight_layout="hv" (H, V)."""
    return 1 if st.weight_hv else 0


def _ce_forward(logits, labels, st: StaticConfig, class_weight=None):
    if st.vocab_layout is not None:  # a device's vocabulary block: the statistics combined over the devices
        mesh, axes, vocab_total = st.vocab_layout
        return ops.local_forward(
            logits, labels, st.options, st.interpret, None, mesh=mesh, vocab_axes=axes, vocab_total=vocab_total,
            extras=(st.returns.accuracy, st.returns.entropy),
        )  # fmt: skip
    kw = {"returns": st.returns} if st.returns else {}
    if class_weight is not None:
        kw["weight"] = class_weight
    return tuple(
        ops.forward(
            logits, labels, st.options, interpret=st.interpret, config=st.forward_config, partitioned=False, **kw
        )
    )


def _ce_backward_in_place(logits, labels, lse, g, st: StaticConfig, g_lse=None, class_weight=None, entropy=None):
    """d logits of the chunk (in place). g_lse: the lse cotangent (a returned z_loss's) or None; entropy: (the
    entropy output's cotangent, mz = lse - entropy) per row, or None."""
    kw = {} if g_lse is None else {"g_lse": g_lse}
    if entropy is not None:
        kw.update(g_entropy=entropy[0], mz=entropy[1])
    if st.vocab_layout is not None:
        mesh, axes, vocab_total = st.vocab_layout
        return ops.local_backward(
            logits, labels, lse, g, st.options, True, st.interpret, None, mesh=mesh, vocab_axes=axes,
            vocab_total=vocab_total, **kw,
        )  # fmt: skip
    return ops.backward(
        logits,
        labels,
        lse,
        g,
        st.options,
        inplace=True,
        interpret=st.interpret,
        config=st.backward_config,
        partitioned=False,
        **kw,
        **({} if class_weight is None else {"weight": class_weight}),
    )


def extra_names(st: StaticConfig):
    """The per-token extra outputs the forward kernels give besides (loss, lse), in their order."""
    return tuple(name for name in ("accuracy", "entropy") if getattr(st.returns, name))


# --- the chunked computation ---------------------------------------------------------------------------------------


class _Order(NamedTuple):
    """skip_ignored_rows: the chunk loop's row order, the kept rows first (in their own order, a stable sort), and
    how many rows are kept (traced: it stays on the device)."""

    rows: jax.Array  # (N,) int32: position p of the loop is row rows[p]
    n_kept: jax.Array  # int32 scalar


def row_order(labels, ignore_index: int, skip_ignored_rows: bool):
    """The _Order of skip_ignored_rows, or None (the rows in their order; also without labels or when no label can
    be ignored)."""
    if not skip_ignored_rows or labels is None:
        return None
    ign = contract.ignore_value(labels.dtype, ignore_index)
    if ign is None:
        return None
    ignored = (labels == ign).astype(jnp.int32)
    rows = jnp.argsort(ignored, stable=True).astype(jnp.int32)
    return _Order(rows, (labels.shape[0] - jnp.sum(ignored)).astype(jnp.int32))


def _rows_of(array, start, st: StaticConfig, index):
    """array's chunk rows: a slice at start, or with skip_ignored_rows the rows `index` (a gather)."""
    if index is None:
        return jax.lax.dynamic_slice_in_dim(array, start, st.chunk_rows, axis=0)
    return jnp.take(array, index, axis=0, unique_indices=True, indices_are_sorted=False, mode="clip")


def chunk_span(k, n_rows: int, st, order=None):
    """Chunk k of n_rows rows: its clamped start, the mask of rows that are new in this chunk, and the rows' indices
    with skip_ignored_rows (an _Order; None otherwise). st: any config with chunk_rows (the fused linear CE's and
    linear_jsd's)."""
    rows = st.chunk_rows
    start = jnp.minimum(k * rows, n_rows - rows)
    fresh = start + jnp.arange(rows) >= k * rows
    index = None if order is None else jax.lax.dynamic_slice_in_dim(order.rows, start, rows)
    return start, fresh, index


def _chunk_inputs(k, hidden, labels, st: StaticConfig, order=None):
    """Chunk k's rows: chunk_span's start and mask, its hidden rows and labels, and the rows' indices."""
    start, fresh, index = chunk_span(k, hidden.shape[0], st, order)
    return start, fresh, _rows_of(hidden, start, st, index), _rows_of(labels, start, st, index), index


def _chunk_upstream(g_tokens, start, fresh, st: StaticConfig, index=None):
    """Chunk rows' upstream factors, 0 on the rows an earlier chunk already covered (so they add nothing to the
    weight and bias gradients; their hidden rows are not written)."""
    return jnp.where(fresh, _rows_of(g_tokens, start, st, index), 0.0)


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


def _put_rows(buffer, start, fresh, values, index=None):
    """Write values into buffer[start:start+rows] (or its rows `index`) where fresh, keep the old rows elsewhere."""
    mask = fresh.reshape(fresh.shape + (1,) * (values.ndim - 1))
    if index is not None:
        old = jnp.take(buffer, index, axis=0, unique_indices=True, mode="clip")
        return buffer.at[index].set(jnp.where(mask, values, old), unique_indices=True, mode="clip")
    old = jax.lax.dynamic_slice_in_dim(buffer, start, values.shape[0], axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, values, old), start, axis=0)


def _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st: StaticConfig, index=None):
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
    out = dict(dh=_put_rows(carry["dh"], start, fresh, dh_c, index), dw=dw_c if first else carry["dw"] + dw_c)
    if st.with_bias:
        db_c = jnp.sum(d_f32.astype(jnp.float32), axis=0)
        out["db"] = db_c if first else carry["db"] + db_c
    return out


def _loop(n_rows, st: StaticConfig, first, body):
    """Chunk 0 by ``first`` (it creates the carry, so the weight gradient starts as chunk 0's product instead of
    zeros plus it), the others by ``body`` in a fori_loop."""
    n_chunks = -(-n_rows // st.chunk_rows)
    carry = first()
    if n_chunks > 1:
        carry = jax.lax.fori_loop(1, n_chunks, body, carry)
    return carry


def _skipping_loop(n_rows, st: StaticConfig, order: _Order, initial, body):
    """skip_ignored_rows: every chunk by ``body`` (chunk 0 adds to the zeros of ``initial()``'s carry) under a
    lax.cond on the device: a chunk none of whose new rows is kept (the kept rows come first, so every chunk after
    the last kept row) runs nothing and passes the carry on."""

    def chunk(k, carry):
        return jax.lax.cond(k * st.chunk_rows < order.n_kept, functools.partial(body, k), lambda c: c, carry)

    return jax.lax.fori_loop(0, -(-n_rows // st.chunk_rows), chunk, initial())


def _zero_weight_grads(weight, st: StaticConfig):
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
    start = initial if weight is None else lambda: {**initial(), **_zero_weight_grads(weight, st)}
    return _skipping_loop(n_rows, st, order, start, body)


def chunked_forward(hidden, weight, bias, labels, g_tokens, st: StaticConfig, class_weight=None):
    """The chunk loop on the arrays given. Per-token losses and lse (N,) and, when g_tokens (N,) is given, the
    gradients of sum_t g_t * loss_t: (dhidden in the compute dtype, dweight in float32 or the compute dtype, dbias
    float32 or None); then a dict of the per-token extra outputs st.returns asks for (accuracy, entropy), collected
    chunk by chunk."""
    n = hidden.shape[0]
    want_grads = g_tokens is not None
    extras = extra_names(st)
    order = row_order(labels, st.options.ignore_index, st.skip_ignored_rows)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = chunk_logits(h_c, weight, bias, st.dtype, st.logits_dtype, st.weight_hv)
        loss_c, lse_c, *extra_c = _ce_forward(logits, y_c, st, class_weight)
        out = dict(
            losses=_put_rows(carry["losses"], start, fresh, loss_c, index),
            lse=_put_rows(carry["lse"], start, fresh, lse_c, index),
        )
        out.update({name: _put_rows(carry[name], start, fresh, v, index) for name, v in zip(extras, extra_c)})
        if want_grads:
            g_c = _chunk_upstream(g_tokens, start, fresh, st, index)
            dlogits = _ce_backward_in_place(logits, y_c, lse_c, g_c, st, class_weight=class_weight)
            out.update(_accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index))
        return out

    def initial():
        # Rows no chunk writes (skipped ones) keep what the kernels give an ignored row: loss, accuracy and
        # entropy 0, lse -inf.
        carry = dict(
            losses=jnp.zeros((n,), jnp.float32), lse=jnp.full((n,), 0.0 if order is None else -jnp.inf, jnp.float32)
        )
        carry.update({name: jnp.zeros((n,), jnp.float32) for name in extras})
        if want_grads:
            carry["dh"] = jnp.zeros((n, hidden.shape[1]), st.dtype)
        return carry

    carry = run_chunks(n, st, order, initial, step, weight if want_grads else None)
    grads = (carry["dh"], carry["dw"], carry.get("db")) if want_grads else None
    return carry["losses"], carry["lse"], grads, {name: carry[name] for name in extras}


def chunked_backward(
    hidden, weight, bias, labels, lse, g_tokens, st: StaticConfig, g_lse=None, class_weight=None, entropy=None
):
    """The chunk loop on the arrays given. Gradients of sum_t g_t * loss_t (+ sum_t g_lse_t * lse_t when g_lse is
    given: a returned z_loss's; + sum_t g_H,t * H_t when entropy = (g_H, mz = lse - H) per row is given: a returned
    entropy's) from the saved lse: each chunk's logits are recomputed, no forward kernel; the entropy's term rides
    in the same backward kernel (no extra matmul)."""
    n = hidden.shape[0]
    order = row_order(labels, st.options.ignore_index, st.skip_ignored_rows)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = chunk_logits(h_c, weight, bias, st.dtype, st.logits_dtype, st.weight_hv)
        lse_c = _rows_of(lse, start, st, index)
        g_c = _chunk_upstream(g_tokens, start, fresh, st, index)
        gl_c = None if g_lse is None else _chunk_upstream(g_lse, start, fresh, st, index)
        ent_c = None
        if entropy is not None:
            ent_c = (_chunk_upstream(entropy[0], start, fresh, st, index), _rows_of(entropy[1], start, st, index))
        dlogits = _ce_backward_in_place(logits, y_c, lse_c, g_c, st, gl_c, class_weight, ent_c)
        return _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index)

    def initial():
        return dict(dh=jnp.zeros((n, hidden.shape[1]), st.dtype))

    carry = run_chunks(n, st, order, initial, step, weight)
    return carry["dh"], carry["dw"], carry.get("db")
