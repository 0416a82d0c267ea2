"""The op layer every cross-entropy kernel call goes through (``forward``, ``backward``): the kernels under sharded
logits, each device running them on its own block, with jvp rules for higher-order autodiff. The loss-neutral
helpers (the plan of a sharding, shard_index, the vmap rule) are layout.py's.

A pallas_call is opaque to XLA's partitioner, which would gather the whole
logits onto every device around it.  So the two kernel launches (forward:
per-token loss and lse; backward: the gradient) are each wrapped in
``jax.experimental.custom_partitioning``: when XLA partitions a jitted
program it calls ``_partition_*`` below with the shardings the logits actually
have, and we answer with the per-device computation:

* rows sharded (any leading axes, any mesh axes): the kernels run unchanged on
  the device's rows; no communication at all (a "mean" then sums N floats,
  which XLA does with a scalar all-reduce).
* vocabulary sharded (the last axis): each device runs the kernels' vocab-parallel
  mode on its columns, giving per-row (lse_local, z_label_local, sum_z_local);
  one ``pmax`` of N floats and one ``psum`` of 3N floats combine them into the
  global lse and loss.  The backward needs the global lse only, which the
  forward left on every device of the row: no communication.
* both at once (e.g. rows over 'data', vocabulary over 'model').

custom_partitioning rather than a ``shard_map`` inside: under ``jit`` with the
default (auto) mesh axes the logits' sharding is decided by XLA's propagation
after tracing, so a shard_map written at trace time would have to guess it (or
make the user pass it) and would force a reshard whenever the guess is wrong.
The partition callback sees the sharding that propagation chose.  Inside a
user's fully manual ``shard_map`` JAX inlines the local computation (the
logits there are already one device's block), and with one device it inlines
it too.

The custom_partitioning primitive has no batching rule, so each op is wrapped in
``jax.custom_batching.custom_vmap``: the kernels work row by row, so a vmapped
call is the same op with the batch as one more leading axis.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from ..core.kernel_helpers import INT32_MAX
from ..core.options import NO_EXTRAS, Extras, Options, lse_differentiated
from ..core.reference import (
    outputs_from_statistics,
    reference_backward,
    reference_row_outputs,
    reference_token_losses,
    token_loss_from_statistics,
)
from ..losses.cross_entropy import launch
from .layout import as_leading_batch, plan, shard_index, shardings, single_device

__all__ = ["local_forward", "local_backward", "forward", "backward"]

# ----------------------------------------------------------------------------
# What one device computes.
# ----------------------------------------------------------------------------


def local_forward(
    logits,
    labels,
    options: Options,
    interpret: bool,
    config,
    mesh=None,
    vocab_axes=(),
    vocab_total=None,
    extras=(False, False),
):
    """(loss, lse) shaped like labels, of this device's block of logits (..., V_local), then accuracy and / or
    entropy per token where ``extras`` = (argmax, entropy) asks for them; config: the kernels' tiles for the whole
    rows (a vocab-parallel block takes the default tiles of its own width)."""
    v_local = logits.shape[-1]
    x2, y1 = logits.reshape(-1, v_local), labels.reshape(-1)
    want_argmax, want_entropy = extras
    kw = {"extras": extras} if any(extras) else {}
    if not vocab_axes:
        outs = launch.forward(x2, y1, options, interpret=interpret, config=config, **kw)
    else:
        start = shard_index(mesh, vocab_axes) * v_local
        lse_local, z_label, sum_z, *rest = launch.forward(
            x2, y1, options, interpret=interpret, vocab_start=start, vocab_total=vocab_total, **kw
        )
        # lse = log sum_shards exp(lse_local), shifted by the largest (an all -inf
        # row shifts by 0, as in the kernels; NaN stays NaN).
        if want_argmax:
            # The row's largest z rides along the lse's all-reduce: 2N floats.
            top, big = jax.lax.pmax(jnp.stack([lse_local, rest[0]]), vocab_axes)
        else:
            top = jax.lax.pmax(lse_local, vocab_axes)
        top = jnp.where(top == -jnp.inf, 0.0, top)
        weight = jnp.exp(lse_local - top)
        # The entropy's partial is this shard's softmax mean of z, weighted by its share of the row's mass.
        parts = [weight, z_label, sum_z] + ([weight * rest[-1]] if want_entropy else [])
        sums = jax.lax.psum(jnp.stack(parts), vocab_axes)
        lse = top + jnp.log(sums[0])
        loss = token_loss_from_statistics(lse, sums[1], sums[2], y1, options, vocab_total)
        argmax = mean_z = None
        if want_argmax:
            # The smallest global column holding the row's max: argmax's first index on ties (N ints).
            argmax = jax.lax.pmin(jnp.where(rest[0] == big, rest[1], INT32_MAX), vocab_axes)
        if want_entropy:
            mean_z = jnp.where(sums[0] > 0.0, sums[3] / sums[0], 0.0)
        accuracy, entropy = outputs_from_statistics(lse, argmax, mean_z, y1, options, vocab_total)
        outs = (loss, lse) + tuple(v for v in (accuracy, entropy) if v is not None)
    return tuple(o.reshape(labels.shape) for o in outs)


def local_backward(
    logits,
    labels,
    lse,
    g,
    options: Options,
    inplace: bool,
    interpret: bool,
    config,
    mesh=None,
    vocab_axes=(),
    vocab_total=None,
    g_lse=None,
    g_entropy=None,
    mz=None,
):
    """dL/dlogits of this device's block; lse is the global one, so nothing is communicated. g_lse: the per-token
    cotangent of lse too (the returned z_loss's gradient), or None. g_entropy, mz: the per-token cotangent of the
    entropy output and mz = lse - entropy (global: nothing is communicated either), or None (both)."""
    v_local = logits.shape[-1]
    flat = (logits.reshape(-1, v_local), labels.reshape(-1), lse.reshape(-1), g.reshape(-1))
    kw = {} if g_lse is None else {"g_lse": g_lse.reshape(-1)}
    if g_entropy is not None:
        kw.update(g_entropy=g_entropy.reshape(-1), mz=mz.reshape(-1))
    if not vocab_axes:
        d = launch.backward(*flat, options, inplace=inplace, interpret=interpret, config=config, **kw)
    else:
        start = shard_index(mesh, vocab_axes) * v_local
        d = launch.backward(
            *flat, options, inplace=inplace, interpret=interpret, vocab_start=start, vocab_total=vocab_total, **kw
        )
    return d.reshape(logits.shape)


# ----------------------------------------------------------------------------
# Partitioning rules.
# ----------------------------------------------------------------------------


def _partition_forward(options, interpret, config, extras, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab_axes = plan(arg_shapes[0])
    logits_sharding, row_sharding = shardings(mesh, rows, vocab_axes)
    lower = functools.partial(
        local_forward,
        options=options,
        interpret=interpret,
        config=config,
        mesh=mesh,
        vocab_axes=vocab_axes,
        vocab_total=arg_shapes[0].shape[-1],
        extras=extras,
    )
    return mesh, lower, (row_sharding,) * (2 + sum(extras)), (logits_sharding, row_sharding)


def _infer_forward(options, interpret, config, extras, mesh, arg_shapes, result_shape):
    del options, interpret, config, mesh, result_shape
    _, row_sharding = shardings(*plan(arg_shapes[0]))
    return (row_sharding,) * (2 + sum(extras))


def _local_backward_args(logits, labels, lse, g, *cotangents, **static):
    """local_backward with the optional per-token operands positional, told apart by their number: (), (g_lse,),
    (g_entropy, mz) or (g_lse, g_entropy, mz)."""
    g_lse = cotangents[0] if len(cotangents) in (1, 3) else None
    g_entropy, mz = cotangents[-2:] if len(cotangents) >= 2 else (None, None)
    return local_backward(logits, labels, lse, g, g_lse=g_lse, g_entropy=g_entropy, mz=mz, **static)


def _partition_backward(options, inplace, interpret, config, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab_axes = plan(arg_shapes[0])
    logits_sharding, row_sharding = shardings(mesh, rows, vocab_axes)
    lower = functools.partial(
        _local_backward_args,
        options=options,
        inplace=inplace,
        interpret=interpret,
        config=config,
        mesh=mesh,
        vocab_axes=vocab_axes,
        vocab_total=arg_shapes[0].shape[-1],
    )
    return mesh, lower, logits_sharding, (logits_sharding,) + (row_sharding,) * (len(arg_shapes) - 1)


def _infer_backward(options, inplace, interpret, config, mesh, arg_shapes, result_shape):
    del options, inplace, interpret, config, mesh, result_shape
    return shardings(*plan(arg_shapes[0]))[0]


# ----------------------------------------------------------------------------
# The ops (one per static configuration), with their vmap rules.
# ----------------------------------------------------------------------------


@functools.cache
def _forward_op(options: Options, interpret: bool, config, extras=(False, False)):
    kw = {"extras": extras} if any(extras) else {}

    @custom_partitioning
    def op(logits, labels):
        return local_forward(logits, labels, options, interpret, config, **kw)

    n_out = 2 + sum(extras)
    op.def_partition(
        partition=functools.partial(_partition_forward, options, interpret, config, extras),
        infer_sharding_from_operands=functools.partial(_infer_forward, options, interpret, config, extras),
        sharding_rule="... v, ... -> " + ", ".join(["..."] * n_out),
    )

    @jax.custom_batching.custom_vmap
    def batchable(logits, labels):
        return op(logits, labels)

    @batchable.def_vmap
    def _(axis_size, in_batched, logits, labels):
        return batchable(*as_leading_batch(axis_size, in_batched, (logits, labels))), (True,) * n_out

    # jit: an eager call is partitioned too (custom_partitioning's eager
    # implementation would run the whole computation unpartitioned).
    return jax.jit(batchable)


@functools.cache
def _backward_op(
    options: Options, inplace: bool, interpret: bool, config, lse_cotangent: bool = False, entropy_cotangent=False
):
    @custom_partitioning
    def op(*args):
        return _local_backward_args(*args, options=options, inplace=inplace, interpret=interpret, config=config)

    op.def_partition(
        partition=functools.partial(_partition_backward, options, inplace, interpret, config),
        infer_sharding_from_operands=functools.partial(_infer_backward, options, inplace, interpret, config),
        sharding_rule="... v, ..., ..., ..." + ", ..." * (lse_cotangent + 2 * entropy_cotangent) + " -> ... v",
    )

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return op(*args)

    @batchable.def_vmap
    def _(axis_size, in_batched, *args):
        return batchable(*as_leading_batch(axis_size, in_batched, args)), True

    return jax.jit(batchable)


class _Launch(NamedTuple):
    """The static arguments of one launch (hashable: custom_jvp nondiff arguments)."""

    options: Options
    interpret: bool
    config: object  # launch.ForwardConfig / BackwardConfig, or None for the defaults
    partitioned: bool  # through custom_partitioning (sharded logits) or the kernels on the whole array
    inplace: bool = False
    extras: tuple = (False, False)  # forward: (accuracy, entropy) per token besides (loss, lse)
    lse_cotangent: bool = False  # lse is differentiated (a returned z_loss): its tangent / cotangent is real
    entropy_cotangent: bool = False  # backward: the entropy output is differentiated (g_entropy and mz given)


def _forward_kw(st: _Launch):
    return {"extras": st.extras} if any(st.extras) else {}


# Each launch has a jvp rule that is the jvp of the reference: first derivatives go through the callers'
# custom_vjp and run the kernels; differentiating *through* a launch (only higher-order autodiff does: grad of
# grad, jax.hessian, jvp of grad) gets the reference's exact derivative instead of failing inside Pallas.
@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _forward(logits, labels, st: _Launch):
    if not st.partitioned or single_device():
        return local_forward(logits, labels, st.options, st.interpret, st.config, **_forward_kw(st))
    return _forward_op(st.options, st.interpret, st.config, *((st.extras,) if any(st.extras) else ()))(logits, labels)


def _backward_operands(logits, labels, lse, g, g_lse, g_entropy, mz, st: _Launch):
    return (
        (logits, labels, lse, g)
        + ((g_lse,) if st.lse_cotangent else ())
        + ((g_entropy, mz) if st.entropy_cotangent else ())
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def _backward(logits, labels, lse, g, g_lse, g_entropy, mz, st: _Launch):
    args = _backward_operands(logits, labels, lse, g, g_lse, g_entropy, mz, st)
    if not st.partitioned or single_device():
        return _local_backward_args(
            *args, options=st.options, inplace=st.inplace, interpret=st.interpret, config=st.config
        )
    flags = (st.lse_cotangent, True) if st.entropy_cotangent else (True,) if st.lse_cotangent else ()
    return _backward_op(st.options, st.inplace, st.interpret, st.config, *flags)(*args)


@_forward.defjvp
def _forward_jvp(st: _Launch, primals, tangents):
    logits, labels = primals
    outs = _forward(logits, labels, st)
    return outs, _reference_forward_jvp(st, logits, labels, tangents[0], outs)


def _reference_forward_jvp(st: _Launch, logits, labels, logits_dot, outs, weight=None):
    """The tangents of a forward launch's outputs (loss, lse, accuracy?, entropy?): the reference's for the loss,
    for lse when a returned z_loss differentiates it and for the entropy; accuracy is not differentiable. (lse is
    otherwise read only by the backward launch, whose rule recomputes it from the logits: tangent 0.)"""
    want_accuracy, want_entropy = st.extras
    if not (st.lse_cotangent or want_entropy):
        _, loss_dot = jax.jvp(lambda x: reference_token_losses(x, labels, st.options, weight), (logits,), (logits_dot,))
        return (loss_dot, jnp.zeros_like(outs[1])) + tuple(jnp.zeros_like(o) for o in outs[2:])

    def differentiable(x):
        loss, lse, _, entropy = reference_row_outputs(x, labels, st.options, Extras(entropy=want_entropy), weight)
        return (loss, lse) + ((entropy,) if want_entropy else ())

    _, dots = jax.jvp(differentiable, (logits,), (logits_dot,))
    lse_dot = dots[1] if st.lse_cotangent else jnp.zeros_like(outs[1])
    accuracy_dot = (jnp.zeros_like(outs[2]),) if want_accuracy else ()
    return (dots[0], lse_dot) + accuracy_dot + tuple(dots[2:])


def _reference_backward_jvp(st: _Launch, primals, tangents, weight=None):
    """The tangent of a backward launch: the jvp of the reference backward in the logits and the cotangents used.
    lse and mz are functions of the logits: the reference recomputes them, so their own tangents are not added."""
    logits, labels = primals[:2]
    # primals: (logits, labels, lse, g, g_lse, g_entropy, mz); the cotangents this launch reads, by position.
    used = [3] + ([4] if st.lse_cotangent else []) + ([5] if st.entropy_cotangent else [])

    def backward_of(x, *upstream):
        named = dict(zip(used, upstream))
        return reference_backward(x, labels, named[3], st.options, named.get(4), weight, named.get(5))

    _, dlogits_dot = jax.jvp(
        backward_of, (logits, *(primals[i] for i in used)), (tangents[0], *(tangents[i] for i in used))
    )
    return dlogits_dot


@_backward.defjvp
def _backward_jvp(st: _Launch, primals, tangents):
    return _backward(*primals, st), _reference_backward_jvp(st, primals, tangents)


# Class weights: the kernels run on the whole array (no custom_partitioning rule: sharded logits are gathered by
# XLA), with the same jvp rules as above (the weighted reference's), the weights a constant.
@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _weighted_forward(logits, labels, weight, st: _Launch):
    v = logits.shape[-1]
    kw = _forward_kw(st)
    outs = launch.forward(
        logits.reshape(-1, v), labels.reshape(-1), st.options, interpret=st.interpret, config=st.config, weight=weight,
        **kw,
    )  # fmt: skip
    return tuple(o.reshape(labels.shape) for o in outs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def _weighted_backward(logits, labels, lse, g, g_lse, g_entropy, mz, weight, st: _Launch):
    v = logits.shape[-1]
    flat = (logits.reshape(-1, v), labels.reshape(-1), lse.reshape(-1), g.reshape(-1))
    kw = {"g_lse": g_lse.reshape(-1)} if st.lse_cotangent else {}
    if st.entropy_cotangent:
        kw.update(g_entropy=g_entropy.reshape(-1), mz=mz.reshape(-1))
    d = launch.backward(
        *flat, st.options, inplace=st.inplace, interpret=st.interpret, config=st.config, weight=weight, **kw
    )
    return d.reshape(logits.shape)


@_weighted_forward.defjvp
def _weighted_forward_jvp(st: _Launch, primals, tangents):
    logits, labels, weight = primals
    outs = _weighted_forward(logits, labels, weight, st)
    return outs, _reference_forward_jvp(st, logits, labels, tangents[0], outs, weight)


@_weighted_backward.defjvp
def _weighted_backward_jvp(st: _Launch, primals, tangents):
    weight = primals[7]
    dlogits = _weighted_backward(*primals, st)
    return dlogits, _reference_backward_jvp(st, primals[:7], tangents[:7], weight)


def forward(
    logits,
    labels,
    options: Options,
    *,
    interpret: bool,
    config=None,
    partitioned: bool = True,
    returns=NO_EXTRAS,
    weight=None,
):
    """(loss, lse), float32 shaped like labels, of logits (..., V) however they are sharded, then accuracy and / or
    entropy per token where ``returns`` (core.options.Extras) asks for them; config: the forward kernel's tiles
    (default ``launch.forward_config(V)``); partitioned=False runs the kernels on the whole array
    (linear_cross_entropy's chunks). weight: class weights (V,) or None; with them the kernels always run on the
    whole array."""
    st = _Launch(options, interpret, config, partitioned)
    if returns:
        st = st._replace(extras=(returns.accuracy, returns.entropy), lse_cotangent=lse_differentiated(options, returns))
    if weight is not None:
        return _weighted_forward(logits, labels, weight, st)
    return _forward(logits, labels, st)


def backward(
    logits,
    labels,
    lse,
    g,
    options: Options,
    *,
    inplace: bool,
    interpret: bool,
    config=None,
    partitioned: bool = True,
    g_lse=None,
    weight=None,
    g_entropy=None,
    mz=None,
):
    """dL/dlogits (..., V), sharded like logits; g is the per-token upstream shaped like labels; config: the
    backward kernel's tiles (default ``launch.backward_config(V)``); g_lse: None, or the per-token cotangent of
    lse (shaped like labels), whose gradient is added; weight: class weights (V,) or None (see ``forward``).
    g_entropy, mz: None (both), or the per-token cotangent of the entropy output H and mz = lse - H (shaped like
    labels; the global values when the vocabulary is sharded): g_entropy * p_j (mz - z_j) * dz/dx is added."""
    if (g_entropy is None) != (mz is None):
        raise ValueError("g_entropy and mz go together (the entropy's cotangent and lse - entropy per row)")
    st = _Launch(
        options, interpret, config, partitioned, inplace, lse_cotangent=g_lse is not None,
        entropy_cotangent=g_entropy is not None,
    )  # fmt: skip
    if weight is not None:
        return _weighted_backward(logits, labels, lse, g, g_lse, g_entropy, mz, weight, st)
    return _backward(logits, labels, lse, g, g_lse, g_entropy, mz, st)
