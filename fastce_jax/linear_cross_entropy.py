"""Fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)` without the (N, V) logits.

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

Reductions (jax.custom_vjp).
- "mean" / "sum": the gradients are computed in the forward pass of the VJP and are its residuals (the reduction's
  per-token factor is traced, no host synchronisation); the backward only multiplies them by the upstream scalar.
  6·N·H·V flops in all; a plain forward (no VJP) computes no gradients (2·N·H·V flops).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most workspace_bytes) and O(N + V) floats.

Ignored rows: by default every row costs its matmuls. skip_ignored_rows=True orders the chunk loop's rows kept
first (a stable argsort of the ignored mask, traced), gathers each chunk's rows of hidden and scatters its rows of
d hidden back, and runs each chunk under a lax.cond on whether it holds a kept row: the chunks after the last kept
row compute nothing. The kept-row count stays on the device (nothing for the caller to wait on, jit-compatible),
but XLA's GPU runtime executes a conditional outside a command buffer by copying its predicate to the host and
waiting for it (ConditionalThunk): one wait per chunk, unless XLA_FLAGS' --xla_gpu_enable_command_buffer includes
CONDITIONAL (a CUDA-graph conditional node). bench/tools/skip_probe.py measures what that costs.

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(accumulate_in_float32=True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.

The labels reach the kernels as given, with the caller's ignore_index (as in cross_entropy).

Sharded heads (the last section of this module): the chunked kernel path under sharded inputs, each device running
the chunk loop on its block.

The chunk loop (a fori_loop around matmuls and pallas_calls) is opaque to XLA's partitioner, which would gather the
weight and the rows onto every device around it. So, as sharding.py does for cross_entropy, the loop's two entry
points (the forward, with the gradients for "mean"/"sum", and the backward of "none") are each wrapped in
``jax.experimental.custom_partitioning``; the partition callback reads the shardings that propagation gave hidden
(its rows, over some mesh axes) and the weight (its vocabulary rows, over others) and answers with the per-device
computation:

* rows sharded: the device's rows against the whole weight, as on one device; the weight (and bias) gradient is
  summed over the rows' axes (the data-parallel gradient reduction, one all-reduce of the device's weight block).
* vocabulary sharded: the device's weight rows, the vocabulary offset its index along the vocabulary axes. Per
  chunk the kernels' vocab-parallel statistics, then one ``pmax`` of the chunk's rows and one ``psum`` of 3x them
  (sharding.local_forward) give every device the chunk's global lse and loss; the kernels' vocab-parallel
  backward then gives the chunk's d logits of the device's columns (sharding.local_backward), folded into the
  device's d weight (no communication) and its share of d hidden, summed over the vocabulary axes once at the
  end (an all-reduce of the device's rows x H).
* both at once (rows over 'data', vocabulary over 'model').

Nothing weight-sized is gathered and nothing logits-sized is communicated. The hidden dimension H is never split:
a weight or hidden sharded along H is gathered along it first (by XLA, to the shardings the callback asks for).
Rows or vocabulary that their mesh axes do not divide are replicated instead. Each device's chunk is at most the
call's chunk rows (computed for the whole vocabulary), so a vocabulary-sharded device materialises less.

The return_* outputs' statistics ride on the same combine (sharding.local_forward with extras); a differentiated
z_loss output's backward is the backward op with the lse cotangent.

vmap: custom_partitioning has no batching rule; a vmapped call runs the unpartitioned loop (jax.vmap of it).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import contract, kernels, sharding
from .contract import Options

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


def _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows=False):
    for name, value in (("workspace_bytes", workspace_bytes), ("chunk_rows", chunk_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    contract.check_flag(accumulate_in_float32, "accumulate_in_float32")
    return contract.check_flag(skip_ignored_rows, "skip_ignored_rows")


class _Static(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument)."""

    options: Options
    interpret: bool  # Pallas interpret mode (off GPU)
    reduction: str
    chunk_rows: int
    dtype: str  # compute dtype of the logits
    f32_weight_grad: bool
    with_bias: bool
    forward_config: kernels.ForwardConfig
    backward_config: kernels.BackwardConfig
    returns: contract.Extras = contract.NO_EXTRAS  # the extra outputs asked for
    skip_ignored_rows: bool = False  # chunks over the kept rows first; chunks without one skipped (lax.cond)
    partitioned: bool = False  # the chunk loop through custom_partitioning (several devices)
    vocab_layout: object = None  # inside a partitioned loop: (mesh, vocabulary axes, V) of a vocabulary block


def _ce_forward(logits, labels, st: _Static, class_weight=None):
    if st.vocab_layout is not None:  # a device's vocabulary block: the statistics combined over the devices
        mesh, axes, vocab_total = st.vocab_layout
        return sharding.local_forward(
            logits, labels, st.options, st.interpret, None, mesh=mesh, vocab_axes=axes, vocab_total=vocab_total,
            extras=(st.returns.accuracy, st.returns.entropy),
        )  # fmt: skip
    kw = {"returns": st.returns} if st.returns else {}
    if class_weight is not None:
        kw["weight"] = class_weight
    return tuple(
        sharding.forward(
            logits, labels, st.options, interpret=st.interpret, config=st.forward_config, partitioned=False, **kw
        )
    )


def _ce_backward_in_place(logits, labels, lse, g, st: _Static, g_lse=None, class_weight=None):
    if st.vocab_layout is not None:
        mesh, axes, vocab_total = st.vocab_layout
        return sharding.local_backward(
            logits, labels, lse, g, st.options, True, st.interpret, None, mesh=mesh, vocab_axes=axes,
            vocab_total=vocab_total, g_lse=g_lse,
        )  # fmt: skip
    return sharding.backward(
        logits,
        labels,
        lse,
        g,
        st.options,
        inplace=True,
        interpret=st.interpret,
        config=st.backward_config,
        partitioned=False,
        **({} if g_lse is None else {"g_lse": g_lse}),
        **({} if class_weight is None else {"weight": class_weight}),
    )


def extra_names(st: _Static):
    """The per-token extra outputs the forward kernels give besides (loss, lse), in their order."""
    return tuple(name for name in ("accuracy", "entropy") if getattr(st.returns, name))


# --- the chunked computation ---------------------------------------------------------------------------------------


class _Order(NamedTuple):
    """skip_ignored_rows: the chunk loop's row order, the kept rows first (in their own order, a stable sort), and
    how many rows are kept (traced: it stays on the device)."""

    rows: jax.Array  # (N,) int32: position p of the loop is row rows[p]
    n_kept: jax.Array  # int32 scalar


def _row_order(labels, st: _Static):
    """The _Order of skip_ignored_rows, or None (the rows in their order; also when no label can be ignored)."""
    ign = contract.ignore_value(labels.dtype, st.options.ignore_index)
    if not st.skip_ignored_rows or ign is None:
        return None
    ignored = (labels == ign).astype(jnp.int32)
    rows = jnp.argsort(ignored, stable=True).astype(jnp.int32)
    return _Order(rows, (labels.shape[0] - jnp.sum(ignored)).astype(jnp.int32))


def _rows_of(array, start, st: _Static, index):
    """array's chunk rows: a slice at start, or with skip_ignored_rows the rows `index` (a gather)."""
    if index is None:
        return jax.lax.dynamic_slice_in_dim(array, start, st.chunk_rows, axis=0)
    return jnp.take(array, index, axis=0, unique_indices=True, indices_are_sorted=False, mode="clip")


def _chunk_inputs(k, hidden, labels, st: _Static, order=None):
    """Chunk k's rows: its clamped start, the mask of rows that are new in this chunk, its hidden rows and labels,
    and the rows' indices with skip_ignored_rows (None otherwise)."""
    n = hidden.shape[0]
    rows = st.chunk_rows
    start = jnp.minimum(k * rows, n - rows)
    fresh = start + jnp.arange(rows) >= k * rows
    index = None if order is None else jax.lax.dynamic_slice_in_dim(order.rows, start, rows)
    return start, fresh, _rows_of(hidden, start, st, index), _rows_of(labels, start, st, index), index


def _chunk_upstream(g_tokens, start, fresh, st: _Static, index=None):
    """Chunk rows' upstream factors, 0 on the rows an earlier chunk already covered (so they add nothing to the
    weight and bias gradients; their hidden rows are not written)."""
    return jnp.where(fresh, _rows_of(g_tokens, start, st, index), 0.0)


def _chunk_logits(h_c, weight, bias, dtype):
    """h_c @ weight.T + bias in dtype (float32 accumulation inside the matmul)."""
    dt = jnp.dtype(dtype)
    logits = jax.lax.dot_general(h_c.astype(dt), weight.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=dt)
    if bias is not None:
        logits = logits + bias.astype(dt)
    return logits


def _put_rows(buffer, start, fresh, values, index=None):
    """Write values into buffer[start:start+rows] (or its rows `index`) where fresh, keep the old rows elsewhere."""
    mask = fresh.reshape(fresh.shape + (1,) * (values.ndim - 1))
    if index is not None:
        old = jnp.take(buffer, index, axis=0, unique_indices=True, mode="clip")
        return buffer.at[index].set(jnp.where(mask, values, old), unique_indices=True, mode="clip")
    old = jax.lax.dynamic_slice_in_dim(buffer, start, values.shape[0], axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, values, old), start, axis=0)


def _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st: _Static, index=None):
    """The carry's gradients with chunk k's added: its fresh rows of dhidden (compute dtype), its product into
    dweight (float32 with accumulate_in_float32, else the compute dtype), its column sums into dbias
    (float32). Chunk 0 (``first``) starts dweight and dbias instead of adding to zeros."""
    dt = jnp.dtype(st.dtype)
    dh_c = jax.lax.dot_general(dlogits, weight.astype(dt), (((1,), (0,)), ((), ())), preferred_element_type=dt)
    acc = jnp.float32 if st.f32_weight_grad else dt
    dw_c = jax.lax.dot_general(dlogits, h_c.astype(dt), (((0,), (0,)), ((), ())), preferred_element_type=acc)
    out = dict(dh=_put_rows(carry["dh"], start, fresh, dh_c, index), dw=dw_c if first else carry["dw"] + dw_c)
    if st.with_bias:
        db_c = jnp.sum(dlogits.astype(jnp.float32), axis=0)
        out["db"] = db_c if first else carry["db"] + db_c
    return out


def _loop(n_rows, st: _Static, first, body):
    """Chunk 0 by ``first`` (it creates the carry, so the weight gradient starts as chunk 0's product instead of
    zeros plus it), the others by ``body`` in a fori_loop."""
    n_chunks = -(-n_rows // st.chunk_rows)
    carry = first()
    if n_chunks > 1:
        carry = jax.lax.fori_loop(1, n_chunks, body, carry)
    return carry


def _skipping_loop(n_rows, st: _Static, order: _Order, initial, body):
    """skip_ignored_rows: every chunk by ``body`` (chunk 0 adds to the zeros of ``initial()``'s carry) under a
    lax.cond on the device: a chunk none of whose new rows is kept (the kept rows come first, so every chunk after
    the last kept row) runs nothing and passes the carry on."""

    def chunk(k, carry):
        return jax.lax.cond(k * st.chunk_rows < order.n_kept, functools.partial(body, k), lambda c: c, carry)

    return jax.lax.fori_loop(0, -(-n_rows // st.chunk_rows), chunk, initial())


def _zero_weight_grads(weight, st: _Static):
    """The weight and bias gradients' carry before any chunk (skip_ignored_rows: chunk 0 may be skipped)."""
    dt = jnp.dtype(st.dtype)
    out = dict(dw=jnp.zeros(weight.shape, jnp.float32 if st.f32_weight_grad else dt))
    if st.with_bias:
        out["db"] = jnp.zeros((weight.shape[0],), jnp.float32)
    return out


def chunked_forward(hidden, weight, bias, labels, g_tokens, st: _Static, class_weight=None):
    """Per-token losses and lse (N,) and, when g_tokens (N,) is given, the gradients of sum_t g_t * loss_t:
    (dhidden in the compute dtype, dweight in float32 or the compute dtype, dbias float32 or None); then a dict of
    the per-token extra outputs st.returns asks for (accuracy, entropy), collected chunk by chunk."""
    if st.partitioned:
        return fused_forward(hidden, weight, bias, labels, g_tokens, st)
    n = hidden.shape[0]
    want_grads = g_tokens is not None
    extras = extra_names(st)
    order = _row_order(labels, st)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = _chunk_logits(h_c, weight, bias, st.dtype)
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
            if order is not None:
                carry.update(_zero_weight_grads(weight, st))
        return carry

    if order is None:
        carry = _loop(n, st, lambda: step(0, initial(), first=True), functools.partial(step, first=False))
    else:
        carry = _skipping_loop(n, st, order, initial, functools.partial(step, first=False))
    grads = (carry["dh"], carry["dw"], carry.get("db")) if want_grads else None
    return carry["losses"], carry["lse"], grads, {name: carry[name] for name in extras}


def chunked_backward(hidden, weight, bias, labels, lse, g_tokens, st: _Static, g_lse=None, class_weight=None):
    """Gradients of sum_t g_t * loss_t (+ sum_t g_lse_t * lse_t when g_lse is given: a returned z_loss's) from the
    saved lse: each chunk's logits are recomputed, no forward kernel."""
    if st.partitioned:
        return fused_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse)
    n = hidden.shape[0]
    order = _row_order(labels, st)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = _chunk_logits(h_c, weight, bias, st.dtype)
        lse_c = _rows_of(lse, start, st, index)
        g_c = _chunk_upstream(g_tokens, start, fresh, st, index)
        gl_c = None if g_lse is None else _chunk_upstream(g_lse, start, fresh, st, index)
        dlogits = _ce_backward_in_place(logits, y_c, lse_c, g_c, st, gl_c, class_weight)
        return _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index)

    def initial():
        return dict(dh=jnp.zeros((n, hidden.shape[1]), st.dtype))

    if order is None:
        carry = _loop(n, st, lambda: step(0, initial(), first=True), functools.partial(step, first=False))
    else:
        carry = _skipping_loop(
            n, st, order, lambda: {**initial(), **_zero_weight_grads(weight, st)}, functools.partial(step, first=False)
        )
    return carry["dh"], carry["dw"], carry.get("db")


def _finish_grads(grads, hidden, weight, bias, scale=None, extra=None):
    """Scale (by the upstream, when given) and cast each gradient to its input's dtype: one fused pass each; extra:
    gradients to add before the cast (the returned z_loss's), or None."""
    dh, dw, db = grads
    extra = (None, None, None) if extra is None else extra

    def fin(g, like, more):
        # A bf16 gradient times the float32 scale is computed in float32 and rounded once.
        g = g if scale is None else g * scale
        return (g if more is None else g + more).astype(like.dtype)

    return fin(dh, hidden, extra[0]), fin(dw, weight, extra[1]), None if bias is None else fin(db, bias, extra[2])


def _with_extras(loss, lse, extra: dict, st: _Static):
    """What the custom_vjps return: the loss alone, or (loss, lse, *extras) when extra outputs are asked for."""
    return (loss, lse, *extra.values()) if st.returns else loss


# --- custom_vjp: "mean"/"sum" (the gradients are residuals) and "none" (lse is) ------------------------------------


def _token_scale(labels, n_items, st: _Static, class_weight=None):
    """d loss / d loss_t of the reduction: 1 / contract.loss_divisor (traced; no host synchronisation)."""
    divisor = contract.loss_divisor(labels, st.reduction, n_items, st.options.ignore_index, weight=class_weight)
    return jnp.broadcast_to(1.0 / divisor, labels.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _reduced_loss(hidden, weight, bias, labels, n_items, class_weight, st: _Static):
    losses, lse, _, extra = chunked_forward(hidden, weight, bias, labels, None, st, class_weight)
    loss = contract.reduce_losses(losses, labels, st.reduction, n_items, st.options.ignore_index, class_weight)
    return _with_extras(loss, lse, extra, st)


def _reduced_fwd(hidden, weight, bias, labels, n_items, class_weight, st: _Static):
    g_tokens = _token_scale(labels, n_items, st, class_weight)
    losses, lse, grads, extra = chunked_forward(hidden, weight, bias, labels, g_tokens, st, class_weight)
    loss = contract.reduce_losses(losses, labels, st.reduction, n_items, st.options.ignore_index, class_weight)
    # Zero-size stand-ins keep the input dtypes for the backward's casts.
    likes = (jnp.zeros((0,), hidden.dtype), jnp.zeros((0,), weight.dtype), None if bias is None else bias[:0])
    # A returned z_loss: its gradient (through lse) is only known in the backward, which recomputes the chunks.
    inputs = (hidden, weight, bias, labels, lse) if contract.lse_differentiated(st.options, st.returns) else None
    return _with_extras(loss, lse, extra, st), (grads, likes, inputs, class_weight)


def _reduced_bwd(st: _Static, residuals, g):
    grads, (h_like, w_like, b_like), inputs, class_weight = residuals
    extra = None
    if st.returns:
        g, g_lse = g[0], g[1]
        if inputs is not None:
            hidden, weight, bias, labels, lse = inputs

            def z_loss_part():
                zeros = jnp.zeros(labels.shape, jnp.float32)
                # Unweighted: g_lse already holds the class weights' factor of the z_loss output.
                return chunked_backward(hidden, weight, bias, labels, lse, zeros, st, g_lse.astype(jnp.float32))

            def nothing():
                return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(z_loss_part))

            # Only a z_loss output that is differentiated costs the recomputing pass (logging it costs nothing).
            extra = jax.lax.cond(jnp.any(g_lse != 0), z_loss_part, nothing)
    dh, dw, db = _finish_grads(grads, h_like, w_like, b_like, scale=g, extra=extra)
    return dh, dw, db, None, None, None if class_weight is None else jnp.zeros_like(class_weight)


_reduced_loss.defvjp(_reduced_fwd, _reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _per_token_losses(hidden, weight, bias, labels, class_weight, st: _Static):
    losses, lse, _, extra = chunked_forward(hidden, weight, bias, labels, None, st, class_weight)
    return _with_extras(losses, lse, extra, st)


def _per_token_fwd(hidden, weight, bias, labels, class_weight, st: _Static):
    losses, lse, _, extra = chunked_forward(hidden, weight, bias, labels, None, st, class_weight)
    return _with_extras(losses, lse, extra, st), (hidden, weight, bias, labels, lse, class_weight)


def _per_token_bwd(st: _Static, residuals, g):
    hidden, weight, bias, labels, lse, class_weight = residuals
    g_lse = None
    if st.returns:
        g, g_lse = g[0], (g[1].astype(jnp.float32) if contract.lse_differentiated(st.options, st.returns) else None)
    grads = chunked_backward(hidden, weight, bias, labels, lse, g.astype(jnp.float32), st, g_lse, class_weight)
    dh, dw, db = _finish_grads(grads, hidden, weight, bias)
    return dh, dw, db, None, None if class_weight is None else jnp.zeros_like(class_weight)


_per_token_losses.defvjp(_per_token_fwd, _per_token_bwd)


# --- the function --------------------------------------------------------------------------------------------------


def _check_tensors(hidden, weight, bias):
    hidden = contract.check_float_array(hidden, "hidden")
    weight = contract.check_float_array(weight, "weight")
    if bias is not None:
        bias = contract.check_float_array(bias, "bias")
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) = (V, {hidden.shape[-1]}) with V >= 1 (nn.Linear / lm_head layout), "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    return hidden, weight, bias


@functools.partial(jax.jit, static_argnames=("st",))
def _kernel_loss(h2, weight, bias, labels, n_items, class_weight=None, *, st: _Static):
    """The chunked kernel path, jitted once per static configuration (an eager call reuses its trace)."""
    if st.reduction == "none":
        outs = _per_token_losses(h2, weight, bias, labels, class_weight, st)
    else:
        outs = _reduced_loss(h2, weight, bias, labels, n_items, class_weight, st)
    if not st.returns:
        return outs
    loss, lse, *rest = outs
    extra = dict(zip(extra_names(st), rest))
    return contract.with_outputs(
        loss,
        lse,
        extra.get("accuracy"),
        extra.get("entropy"),
        labels,
        st.reduction,
        n_items,
        st.options,
        st.returns,
        weight.shape[0],
        class_weight,
    )


def linear_cross_entropy(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    validate_labels=False,
    shift=0,
    workspace_bytes=None,
    chunk_rows=None,
    accumulate_in_float32=False,
    skip_ignored_rows=False,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    class_weight=None,
):
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` without the (N, V) logits.

    Args:
      hidden: float32/bfloat16/float16/float64 (..., H), e.g. the final hidden states (a float64 common dtype is
        computed in float64 by the reference, whatever ``backend`` says).
      weight: (V, H), the LM head as ``nn.Linear`` / transformers' ``lm_head`` store it (a Flax
        ``Dense`` kernel is (H, V): pass its ``.T``).
      labels: int32/int64 (...), hidden's leading shape.
      bias: optional (V,).
      ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss,
      validate_labels: as in ``fastce_jax.cross_entropy`` (CONTRACT.md).
      shift: as in ``fastce_jax.cross_entropy``, along hidden's second-to-last (sequence) axis: the loss of
        ``linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])`` without slicing hidden.
      backend: "auto" (the chunked kernel path for GPU arrays, "reference" elsewhere), "kernel" (the chunked
        path always; Pallas interpret mode off GPU) or "reference" (the plain matmul, then the jnp reference
        loss: it materialises the logits). Traced (under jit), "auto" assumes the arrays live on the default
        backend: to jit over CPU arrays in a process whose default backend is a GPU, pass backend="reference"
        (cross_entropy, whose fallback needs no matmul, decides that when the computation is lowered).

    The logits are computed in the inputs' common dtype (with float32 accumulation inside the matmul, as XLA's
    GPU matmuls do); the loss is float32 (float64 for a float64 common dtype). Gradients flow to hidden, weight
    and bias, in their dtypes. The extra memory is the gradients plus one chunk of logits (at most
    ``workspace_bytes``; see the module docstring).

    Chunking (the kernel path only; neither changes the loss beyond rounding): ``workspace_bytes`` bounds the chunk
    of logits materialised at a time (None: DEFAULT_WORKSPACE_BYTES = 256 MiB), ``chunk_rows`` (an int) forces the
    rows per chunk whatever the budget; ``accumulate_in_float32=True`` sums a bf16/fp16 weight's gradient over the
    chunks in a float32 accumulator (one rounding instead of one per chunk, 4·V·H more bytes).

    skip_ignored_rows=True (the kernel path only): the chunk loop takes the rows whose label is not ignore_index
    first (a stable sort of the ignored mask; each chunk gathers its rows of hidden and scatters its rows of d
    hidden back), and a chunk with no kept row runs under a ``lax.cond`` that skips its matmuls and kernels on the
    device, so ignored rows (padding, prompt tokens) cost no matmul work beyond the one chunk holding the last kept
    row. jit, grad, second order and vmap work (under vmap with batched labels the cond becomes a select: both
    branches run, nothing is saved). The same loss and gradients (d hidden exactly 0 on ignored rows), every
    output in the original order. Nothing is read on the host by fastce, but on a GPU XLA runs each chunk's
    conditional by reading its predicate on the host (a wait per chunk; see the module docstring).

    return_z_loss, return_lse, return_accuracy, return_entropy: as in ``fastce_jax.cross_entropy``, collected chunk
    by chunk from the same forward kernels (no logits kept). Differentiating the returned z_loss (with z_loss != 0)
    recomputes each chunk's logits in the backward ("mean" / "sum": only when its cotangent is nonzero).

    class_weight: class weights (V,), ``cross_entropy``'s ``weight`` (the positional ``weight`` is the LM head
      here), in every chunk's kernels; "mean" divides by the non-ignored tokens' summed class weights.

    Returns:
      float32 loss: a scalar, or shaped like ``labels`` for reduction="none"; with any return_* True a
      ``CrossEntropyOutput(loss, z_loss, lse, accuracy, entropy)``, None for what was not asked.
    """
    hidden, weight, bias = _check_tensors(hidden, weight, bias)
    options = contract.check_options(
        ignore_index=ignore_index,
        reduction=reduction,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
    )
    labels = contract.check_labels(labels, hidden.shape[:-1], options.ignore_index)
    check = contract.check_flag(validate_labels, "validate_labels")
    n_items = contract.check_n_items(n_items)
    returns = contract.check_extras(
        return_z_loss=return_z_loss,
        return_lse=return_lse,
        return_accuracy=return_accuracy,
        return_entropy=return_entropy,
    )
    skip_ignored_rows = _check_chunking(workspace_bytes, chunk_rows, accumulate_in_float32, skip_ignored_rows)
    kept = None
    if shift := contract.check_shift(shift):
        labels, kept = contract.shifted_labels(labels, shift, options.ignore_index)
    vocab, dim = weight.shape
    class_weight = contract.check_class_weight(class_weight, vocab, "class_weight")
    if check:
        contract.validate_labels(labels, vocab, options.ignore_index)
    dtype = jnp.dtype(jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,))))
    if backend == "auto":
        backend = "kernel" if contract.on_gpu(hidden) else "reference"
    lead = tuple(hidden.shape[:-1])
    h2 = hidden.reshape(-1, dim)
    labels = jnp.asarray(labels)
    # No tokens: no chunk to launch; float64: the chunks compute in float32.
    if backend == "reference" or h2.shape[0] == 0 or dtype == jnp.float64:
        logits = _chunk_logits(h2, weight, bias, dtype).reshape(lead + (vocab,))
        if returns:
            losses, lse, accuracy, entropy = contract.reference_row_outputs(
                logits, labels, options, returns, class_weight
            )
            loss = contract.reduce_outputs(
                losses, lse, accuracy, entropy, labels, reduction, n_items, options, returns, vocab, class_weight
            )
        else:
            losses = contract.reference_token_losses(logits, labels, options, class_weight)
            loss = contract.reduce_losses(losses, labels, reduction, n_items, options.ignore_index, class_weight)
    else:
        st = _Static(
            options=options,
            interpret=not contract.on_gpu(hidden),
            reduction=reduction,
            chunk_rows=rows_per_chunk(h2.shape[0], vocab, dtype.itemsize, workspace_bytes, chunk_rows),
            dtype=dtype.name,
            f32_weight_grad=bool(accumulate_in_float32),
            with_bias=bias is not None,
            forward_config=kernels.forward_config(vocab),
            backward_config=kernels.backward_config(vocab),
            returns=returns,
            skip_ignored_rows=skip_ignored_rows,
            # Several devices: the loop runs on each device's block of rows and vocabulary (this module's last section);
            # class weights have no partitioning rule: such a call runs the loop on the whole (gathered) arrays.
            partitioned=jax.device_count() > 1 and class_weight is None,
        )
        with kernels.quiet_triton(st.interpret):
            loss = _kernel_loss(h2, weight, bias, labels.reshape(-1), n_items, class_weight, st=st)
        if isinstance(loss, contract.CrossEntropyOutput):
            per_token = loss._fields if reduction == "none" else ("lse",)
            loss = loss._replace(
                **{f: getattr(loss, f).reshape(lead) for f in per_token if getattr(loss, f) is not None}
            )
        else:
            loss = loss.reshape(lead) if reduction == "none" else loss
    return contract.keep_positions(loss, kept, reduction)


# --- sharded heads ------------------------------------------------------------------------------------------


def _axes(entry):
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _dim_axes(arg, mesh, dim):
    """The mesh axes arg's dimension `dim` is sharded over, () if none or if they do not divide it evenly."""
    sharding = arg.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        return ()
    spec = tuple(sharding.spec) + (None,) * (len(arg.shape) - len(sharding.spec))
    axes = _axes(spec[dim])
    if axes and arg.shape[dim] % math.prod(mesh.shape[a] for a in axes) != 0:
        return ()
    return axes


def _plan(arg_shapes):
    """(mesh, rows axes, vocabulary axes) from hidden's and the weight's shardings."""
    hidden, weight = arg_shapes[0], arg_shapes[1]
    named = [a.sharding for a in (hidden, weight) if isinstance(a.sharding, NamedSharding)]
    if not named:
        devices = sorted(hidden.sharding.device_set, key=lambda d: d.id)
        return Mesh(np.array(devices), ("fastce_replicated",)), (), ()
    mesh = named[0].mesh
    rows = _dim_axes(hidden, mesh, 0)
    vocab = tuple(a for a in _dim_axes(weight, mesh, 0) if a not in rows)
    if vocab and weight.shape[0] % math.prod(mesh.shape[a] for a in vocab) != 0:
        vocab = ()
    return mesh, rows, vocab


def _local_static(st, n_local, v_local, mesh, vocab_axes, vocab_total):
    layout = (mesh, vocab_axes, vocab_total) if vocab_axes else None
    return st._replace(
        chunk_rows=min(st.chunk_rows, n_local),
        partitioned=False,
        vocab_layout=layout,
        forward_config=kernels.forward_config(v_local),
        backward_config=kernels.backward_config(v_local),
    )


def _reduced_grads(grads, rows, vocab):
    """d hidden summed over the vocabulary axes (each device held its columns' share), d weight and d bias over
    the rows' axes (each device held its rows' share)."""
    dh, dw, db = grads
    if vocab:
        dh = jax.lax.psum(dh, vocab)
    if rows:
        dw = jax.lax.psum(dw, rows)
        db = None if db is None else jax.lax.psum(db, rows)
    return dh, dw, db


def _split(args, st):
    """(hidden, weight, bias or None, labels, rest) of an op's operands."""
    if st.with_bias:
        hidden, weight, bias, labels, *rest = args
    else:
        (hidden, weight, labels, *rest), bias = args, None
    return hidden, weight, bias, labels, rest


def _outputs(grads, st):
    return grads[:2] + ((grads[2],) if st.with_bias else ())


def _n_extras(st):
    return len(extra_names(st))


def _forward_local(*args, st, with_grads, mesh=None, rows=(), vocab=(), vocab_total=None):
    """(losses, lse, the per-token extra outputs st.returns asks for, then with_grads the gradients)."""
    hidden, weight, bias, labels, rest = _split(args, st)
    local = _local_static(st, hidden.shape[0], weight.shape[0], mesh, vocab, vocab_total or weight.shape[0])
    g_tokens = rest[0] if with_grads else None
    losses, lse, grads, extra = chunked_forward(hidden, weight, bias, labels, g_tokens, local)
    out = (losses, lse, *extra.values())
    return out + (_outputs(_reduced_grads(grads, rows, vocab), st) if with_grads else ())


def _backward_local(*args, st, with_lse=False, mesh=None, rows=(), vocab=(), vocab_total=None):
    hidden, weight, bias, labels, (lse, g, *g_lse) = _split(args, st)
    local = _local_static(st, hidden.shape[0], weight.shape[0], mesh, vocab, vocab_total or weight.shape[0])
    grads = chunked_backward(hidden, weight, bias, labels, lse, g, local, g_lse[0] if with_lse else None)
    return _outputs(_reduced_grads(grads, rows, vocab), st)


def _shardings(mesh, rows, vocab, st, n_row_args):
    """(the operands' shardings, row-, hidden- and weight-shaped result shardings)."""
    row = NamedSharding(mesh, P(_entry(rows)))
    hid = NamedSharding(mesh, P(_entry(rows), None))
    wgt = NamedSharding(mesh, P(_entry(vocab), None))
    vec = NamedSharding(mesh, P(_entry(vocab)))
    operands = (hid, wgt) + ((vec,) if st.with_bias else ()) + (row,) * (1 + n_row_args)
    grads = (hid, wgt) + ((vec,) if st.with_bias else ())
    return operands, row, grads


def _n_row_args(kind, with_grads):
    """Per-row operands after labels: the forward's upstream factors (with gradients); the backward's lse, upstream
    and (with_grads there: the lse cotangent) its upstream too."""
    return int(with_grads) if kind == "forward" else 2 + int(with_grads)


def _partition(kind, st, with_grads, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab = _plan(arg_shapes)
    operands, row, grads = _shardings(mesh, rows, vocab, st, _n_row_args(kind, with_grads))
    static = dict(st=st, mesh=mesh, rows=rows, vocab=vocab, vocab_total=arg_shapes[1].shape[0])
    if kind == "forward":
        lower = functools.partial(_forward_local, with_grads=with_grads, **static)
        results = (row,) * (2 + _n_extras(st)) + (grads if with_grads else ())
    else:
        lower = functools.partial(_backward_local, with_lse=with_grads, **static)
        results = grads
    return mesh, lower, results, operands


def _infer(kind, st, with_grads, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab = _plan(arg_shapes)
    _, row, grads = _shardings(mesh, rows, vocab, st, 0)
    if kind == "forward":
        return (row,) * (2 + _n_extras(st)) + (grads if with_grads else ())
    return grads


def _rule(kind, st, with_grads):
    """The Shardy rule: n the rows, v the vocabulary, h the hidden width."""
    weights = ("v h",) + (("v",) if st.with_bias else ())
    operands = ("n h", *weights, "n") + ("n",) * _n_row_args(kind, with_grads)
    if kind == "forward":
        results = ("n",) * (2 + _n_extras(st)) + (("n h", *weights) if with_grads else ())
    else:
        results = ("n h", *weights)
    return ", ".join(operands) + " -> " + ", ".join(results)


@functools.cache
def _op(kind, st, with_grads=False):
    """kind "forward" (with_grads: also the gradients) or "backward" (with_grads: an lse cotangent as well)."""
    plain = (
        functools.partial(_forward_local, st=st, with_grads=with_grads)
        if kind == "forward"
        else functools.partial(_backward_local, st=st, with_lse=with_grads)
    )

    @custom_partitioning
    def op(*args):
        return plain(*args)

    op.def_partition(
        partition=functools.partial(_partition, kind, st, with_grads),
        infer_sharding_from_operands=functools.partial(_infer, kind, st, with_grads),
        sharding_rule=_rule(kind, st, with_grads),
    )

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return op(*args)

    @batchable.def_vmap
    def _(axis_size, in_batched, *args):
        axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(plain, in_axes=axes)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return batchable


def fused_forward(hidden, weight, bias, labels, g_tokens, st):
    """linear_cross_entropy.chunked_forward, partitioned."""
    with_grads = g_tokens is not None
    args = (hidden, weight) + (() if bias is None else (bias,)) + (labels,) + ((g_tokens,) if with_grads else ())
    out = _op("forward", st, with_grads)(*args)
    n_extras = _n_extras(st)
    losses, lse, extra = out[0], out[1], dict(zip(extra_names(st), out[2 : 2 + n_extras]))
    grads = None
    if with_grads:
        dh, dw, *db = out[2 + n_extras :]
        grads = (dh, dw, db[0] if st.with_bias else None)
    return losses, lse, grads, extra


def fused_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse=None):
    """linear_cross_entropy.chunked_backward, partitioned."""
    with_lse = g_lse is not None
    args = (
        (hidden, weight) + (() if bias is None else (bias,)) + (labels, lse, g_tokens) + ((g_lse,) if with_lse else ())
    )
    out = _op("backward", st, with_lse)(*args)
    return out[0], out[1], out[2] if st.with_bias else None
