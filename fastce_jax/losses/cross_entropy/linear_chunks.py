"""The fused linear cross-entropy's per-chunk work on the LM-head engine (fastce_jax/linear/engine.py): the loss of
``cross_entropy(hidden @ weight.T + bias, labels)`` chunk by chunk, without the (N, V) logits.

Per chunk (engine.run_chunks): the logits from one matmul (engine.chunk_logits), the forward kernels give each row's
loss and log-sum-exp (``ce_forward``) and the extra outputs asked for (``extra_names``), the backward kernel
overwrites the same fresh logits with d loss / d logits (``ce_backward_in_place``), and engine.accumulate_grads
folds that into the gradients. ``chunked_forward`` (losses, lse, and with per-row upstream factors the gradients
computed in the forward pass) and ``chunked_backward`` (the gradients from the saved lse, each chunk's logits
recomputed) are the two loops; ``StaticConfig`` is the hashable configuration of one call.

Entropy's gradient: a differentiated entropy output adds g_H,t p_j (mz_t - z_j) dz/dx to the backward kernel's
d logits (mz = lse - H per row, saved by the forward), so the per-token path's recomputing backward carries it at
no extra matmul; "mean" / "sum" run a recomputing backward for it (as for a differentiated z_loss output).

The labels reach the kernels as given, with the caller's ignore_index (as in cross_entropy).

The loops run on the whole arrays they are given; linear_autograd.py routes a partitioned call (several devices)
through fastce_jax/distributed/linear_sharded.py, whose per-device computation is these loops on each device's block
(a vocabulary block's kernels combined over the devices by distributed/partitioning.py's local_forward and
local_backward).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from ...core.options import NO_EXTRAS, Extras, Options
from ...distributed import partitioning
from ...linear import engine
from .launch import BackwardConfig, ForwardConfig

__all__ = [
    "StaticConfig",
    "ce_forward",
    "ce_backward_in_place",
    "extra_names",
    "chunked_forward",
    "chunked_backward",
]


class StaticConfig(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument)."""

    options: Options
    interpret: bool  # Pallas interpret mode (off GPU)
    reduction: str
    chunk_rows: int
    dtype: str  # compute dtype of the matmul operands (the inputs' promoted dtype)
    f32_weight_grad: bool
    with_bias: bool
    forward_config: ForwardConfig
    backward_config: BackwardConfig
    returns: Extras = NO_EXTRAS  # the extra outputs asked for
    skip_ignored_rows: bool = False  # chunks over the kept rows first; chunks without one skipped (lax.cond)
    partitioned: bool = False  # the chunk loop through distributed/linear_sharded.py's custom_partitioning
    vocab_layout: object = None  # inside a partitioned loop: (mesh, vocabulary axes, V) of a vocabulary block
    logits_dtype: str | None = None  # logits_dtype="float32": the chunk's logits in float32 from dtype operands
    weight_hv: bool = False  # weight_layout="hv": the weight is (H, V) (a Flax Dense kernel), its gradient too


def ce_forward(logits, labels, st: StaticConfig, class_weight=None):
    """The chunk's forward kernels: (loss, lse, *extras) per row (extra_names' order)."""
    if st.vocab_layout is not None:  # a device's vocabulary block: the statistics combined over the devices
        mesh, axes, vocab_total = st.vocab_layout
        return partitioning.local_forward(
            logits, labels, st.options, st.interpret, None, mesh=mesh, vocab_axes=axes, vocab_total=vocab_total,
            extras=(st.returns.accuracy, st.returns.entropy),
        )  # fmt: skip
    kw = {"returns": st.returns} if st.returns else {}
    if class_weight is not None:
        kw["weight"] = class_weight
    return tuple(
        partitioning.forward(
            logits, labels, st.options, interpret=st.interpret, config=st.forward_config, partitioned=False, **kw
        )
    )


def ce_backward_in_place(logits, labels, lse, g, st: StaticConfig, g_lse=None, class_weight=None, entropy=None):
    """d logits of the chunk (in place). g_lse: the lse cotangent (a returned z_loss's) or None; entropy: (the
    entropy output's cotangent, mz = lse - entropy) per row, or None."""
    kw = {} if g_lse is None else {"g_lse": g_lse}
    if entropy is not None:
        kw.update(g_entropy=entropy[0], mz=entropy[1])
    if st.vocab_layout is not None:
        mesh, axes, vocab_total = st.vocab_layout
        return partitioning.local_backward(
            logits, labels, lse, g, st.options, True, st.interpret, None, mesh=mesh, vocab_axes=axes,
            vocab_total=vocab_total, **kw,
        )  # fmt: skip
    return partitioning.backward(
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


def _chunk_inputs(k, hidden, labels, st: StaticConfig, order=None):
    """Chunk k's rows: engine.chunk_span's start and mask, its hidden rows and labels, and the rows' indices."""
    start, fresh, index = engine.chunk_span(k, hidden.shape[0], st, order)
    return start, fresh, engine.rows_of(hidden, start, st, index), engine.rows_of(labels, start, st, index), index


def chunked_forward(hidden, weight, bias, labels, g_tokens, st: StaticConfig, class_weight=None):
    """The chunk loop on the arrays given. Per-token losses and lse (N,) and, when g_tokens (N,) is given, the
    gradients of sum_t g_t * loss_t: (dhidden in the compute dtype, dweight in float32 or the compute dtype, dbias
    float32 or None); then a dict of the per-token extra outputs st.returns asks for (accuracy, entropy), collected
    chunk by chunk."""
    n = hidden.shape[0]
    want_grads = g_tokens is not None
    extras = extra_names(st)
    order = engine.row_order(labels, st.options.ignore_index, st.skip_ignored_rows)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = engine.chunk_logits(h_c, weight, bias, st.dtype, st.logits_dtype, st.weight_hv)
        loss_c, lse_c, *extra_c = ce_forward(logits, y_c, st, class_weight)
        out = dict(
            losses=engine.put_rows(carry["losses"], start, fresh, loss_c, index),
            lse=engine.put_rows(carry["lse"], start, fresh, lse_c, index),
        )
        out.update({name: engine.put_rows(carry[name], start, fresh, v, index) for name, v in zip(extras, extra_c)})
        if want_grads:
            g_c = engine.chunk_upstream(g_tokens, start, fresh, st, index)
            dlogits = ce_backward_in_place(logits, y_c, lse_c, g_c, st, class_weight=class_weight)
            out.update(engine.accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index))
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

    carry = engine.run_chunks(n, st, order, initial, step, weight if want_grads else None)
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
    order = engine.row_order(labels, st.options.ignore_index, st.skip_ignored_rows)

    def step(k, carry, first):
        start, fresh, h_c, y_c, index = _chunk_inputs(k, hidden, labels, st, order)
        logits = engine.chunk_logits(h_c, weight, bias, st.dtype, st.logits_dtype, st.weight_hv)
        lse_c = engine.rows_of(lse, start, st, index)
        g_c = engine.chunk_upstream(g_tokens, start, fresh, st, index)
        gl_c = None if g_lse is None else engine.chunk_upstream(g_lse, start, fresh, st, index)
        ent_c = None
        if entropy is not None:
            ent_c = (
                engine.chunk_upstream(entropy[0], start, fresh, st, index),
                engine.rows_of(entropy[1], start, st, index),
            )
        dlogits = ce_backward_in_place(logits, y_c, lse_c, g_c, st, gl_c, class_weight, ent_c)
        return engine.accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st, index)

    def initial():
        return dict(dh=jnp.zeros((n, hidden.shape[1]), st.dtype))

    carry = engine.run_chunks(n, st, order, initial, step, weight)
    return carry["dh"], carry["dw"], carry.get("db")
