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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

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
    partitioned: bool = False  # the chunk loop through sharded_linear's custom_partitioning (several devices)
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
        from . import sharded_linear

        return sharded_linear.fused_forward(hidden, weight, bias, labels, g_tokens, st)
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
        from . import sharded_linear

        return sharded_linear.fused_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse)
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
            # Several devices: the loop runs on each device's block of rows and vocabulary (sharded_linear.py);
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
