"""Sharded heads of the fused linear cross-entropy: the chunked kernel path (losses/cross_entropy/linear_chunks.py)
under sharded inputs, each device running the chunk loop on its block.

The chunk loop (a fori_loop around matmuls and pallas_calls) is opaque to XLA's partitioner, which would gather the
weight and the rows onto every device around it. So, as partitioning.py does for cross_entropy, the loop's two entry
points (the forward, with the gradients for "mean"/"sum", and the backward of "none") are each wrapped in
``jax.experimental.custom_partitioning``; the partition callback reads the shardings that propagation gave hidden
(its rows, over some mesh axes) and the weight (its vocabulary rows, over others) and answers with the per-device
computation:

* rows sharded: the device's rows against the whole weight, as on one device; the weight (and bias) gradient is
  summed over the rows' axes (the data-parallel gradient reduction, one all-reduce of the device's weight block).
* vocabulary sharded: the device's weight rows, the vocabulary offset its index along the vocabulary axes. Per
  chunk the kernels' vocab-parallel statistics, then one ``pmax`` of the chunk's rows and one ``psum`` of 3x them
  (partitioning.local_forward) give every device the chunk's global lse and loss; the kernels' vocab-parallel
  backward then gives the chunk's d logits of the device's columns (partitioning.local_backward), folded into the
  device's d weight (no communication) and its share of d hidden, summed over the vocabulary axes once at the
  end (an all-reduce of the device's rows x H).
* both at once (rows over 'data', vocabulary over 'model').

Nothing weight-sized is gathered and nothing logits-sized is communicated. The hidden dimension H is never split:
a weight or hidden sharded along H is gathered along it first (by XLA, to the shardings the callback asks for).
Rows or vocabulary that their mesh axes do not divide are replicated instead. Each device's chunk is at most the
call's chunk rows (computed for the whole vocabulary), so a vocabulary-sharded device materialises less.

The return_* outputs' statistics ride on the same combine (partitioning.local_forward with extras); a differentiated
z_loss output's backward is the backward op with the lse cotangent, a differentiated entropy output's the backward
op with its cotangent and mz = lse - H per row (both global already: no communication beyond d hidden's).
Temperature is folded into the options and token weights into the per-row upstream factors: both ride along.

vmap: custom_partitioning has no batching rule; a vmapped call runs the unpartitioned loop (jax.vmap of it).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..linear.engine import vocab_axis
from ..losses.cross_entropy.launch import backward_config, forward_config
from ..losses.cross_entropy.linear_chunks import chunked_backward, chunked_forward, extra_names
from .layout import mesh_axes, mesh_entry

__all__ = ["fused_forward", "fused_backward"]


def _dim_axes(arg, mesh, dim):
    """The mesh axes arg's dimension `dim` is sharded over, () if none or if they do not divide it evenly."""
    sharding = arg.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        return ()
    spec = tuple(sharding.spec) + (None,) * (len(arg.shape) - len(sharding.spec))
    axes = mesh_axes(spec[dim])
    if axes and arg.shape[dim] % math.prod(mesh.shape[a] for a in axes) != 0:
        return ()
    return axes


def _plan(arg_shapes, st):
    """(mesh, rows axes, vocabulary axes) from hidden's and the weight's shardings (its vocabulary axis is 1 with
    weight_layout="hv")."""
    hidden, weight = arg_shapes[0], arg_shapes[1]
    named = [a.sharding for a in (hidden, weight) if isinstance(a.sharding, NamedSharding)]
    if not named:
        devices = sorted(hidden.sharding.device_set, key=lambda d: d.id)
        return Mesh(np.array(devices), ("fastce_replicated",)), (), ()
    mesh = named[0].mesh
    rows = _dim_axes(hidden, mesh, 0)
    v_axis = vocab_axis(st)
    vocab = tuple(a for a in _dim_axes(weight, mesh, v_axis) if a not in rows)
    if vocab and weight.shape[v_axis] % math.prod(mesh.shape[a] for a in vocab) != 0:
        vocab = ()
    return mesh, rows, vocab


def _local_static(st, n_local, v_local, mesh, vocab_axes, vocab_total):
    layout = (mesh, vocab_axes, vocab_total) if vocab_axes else None
    return st._replace(
        chunk_rows=min(st.chunk_rows, n_local),
        partitioned=False,
        vocab_layout=layout,
        forward_config=forward_config(v_local),
        backward_config=backward_config(v_local),
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
    v_local = weight.shape[vocab_axis(st)]
    local = _local_static(st, hidden.shape[0], v_local, mesh, vocab, vocab_total or v_local)
    g_tokens = rest[0] if with_grads else None
    losses, lse, grads, extra = chunked_forward(hidden, weight, bias, labels, g_tokens, local)
    out = (losses, lse, *extra.values())
    return out + (_outputs(_reduced_grads(grads, rows, vocab), st) if with_grads else ())


def _backward_local(*args, st, cotangents=(False, False), mesh=None, rows=(), vocab=(), vocab_total=None):
    """cotangents: (with the lse cotangent, with the entropy's cotangent and mz), the operands after g in order."""
    hidden, weight, bias, labels, (lse, g, *rest) = _split(args, st)
    with_lse, with_entropy = cotangents
    g_lse = rest.pop(0) if with_lse else None
    entropy = tuple(rest) if with_entropy else None  # (g_entropy, mz): the global mz, nothing to communicate
    v_local = weight.shape[vocab_axis(st)]
    local = _local_static(st, hidden.shape[0], v_local, mesh, vocab, vocab_total or v_local)
    grads = chunked_backward(hidden, weight, bias, labels, lse, g, local, g_lse, entropy=entropy)
    return _outputs(_reduced_grads(grads, rows, vocab), st)


def _shardings(mesh, rows, vocab, st, n_row_args):
    """(the operands' shardings, row-, hidden- and weight-shaped result shardings)."""
    row = NamedSharding(mesh, P(mesh_entry(rows)))
    hid = NamedSharding(mesh, P(mesh_entry(rows), None))
    wgt = NamedSharding(mesh, P(None, mesh_entry(vocab)) if st.weight_hv else P(mesh_entry(vocab), None))
    vec = NamedSharding(mesh, P(mesh_entry(vocab)))
    operands = (hid, wgt) + ((vec,) if st.with_bias else ()) + (row,) * (1 + n_row_args)
    grads = (hid, wgt) + ((vec,) if st.with_bias else ())
    return operands, row, grads


def _n_row_args(kind, flags):
    """Per-row operands after labels: the forward's upstream factors (flags: with gradients); the backward's lse,
    upstream, then (flags = (with_lse, with_entropy)) the lse cotangent, the entropy's cotangent and mz."""
    if kind == "forward":
        return int(flags)
    with_lse, with_entropy = flags
    return 2 + int(with_lse) + 2 * int(with_entropy)


def _partition(kind, st, flags, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab = _plan(arg_shapes, st)
    operands, row, grads = _shardings(mesh, rows, vocab, st, _n_row_args(kind, flags))
    static = dict(st=st, mesh=mesh, rows=rows, vocab=vocab, vocab_total=arg_shapes[1].shape[vocab_axis(st)])
    if kind == "forward":
        lower = functools.partial(_forward_local, with_grads=flags, **static)
        results = (row,) * (2 + _n_extras(st)) + (grads if flags else ())
    else:
        lower = functools.partial(_backward_local, cotangents=flags, **static)
        results = grads
    return mesh, lower, results, operands


def _infer(kind, st, flags, mesh, arg_shapes, result_shape):
    del result_shape
    mesh, rows, vocab = _plan(arg_shapes, st)
    _, row, grads = _shardings(mesh, rows, vocab, st, 0)
    if kind == "forward":
        return (row,) * (2 + _n_extras(st)) + (grads if flags else ())
    return grads


def _rule(kind, st, flags):
    """The Shardy rule: n the rows, v the vocabulary, h the hidden width."""
    weights = ("h v" if st.weight_hv else "v h",) + (("v",) if st.with_bias else ())
    operands = ("n h", *weights, "n") + ("n",) * _n_row_args(kind, flags)
    if kind == "forward":
        results = ("n",) * (2 + _n_extras(st)) + (("n h", *weights) if flags else ())
    else:
        results = ("n h", *weights)
    return ", ".join(operands) + " -> " + ", ".join(results)


@functools.cache
def _op(kind, st, flags=False):
    """kind "forward" (flags: with the gradients) or "backward" (flags: (with an lse cotangent, with the entropy's
    cotangent and mz))."""
    plain = (
        functools.partial(_forward_local, st=st, with_grads=flags)
        if kind == "forward"
        else functools.partial(_backward_local, st=st, cotangents=flags)
    )

    @custom_partitioning
    def op(*args):
        return plain(*args)

    op.def_partition(
        partition=functools.partial(_partition, kind, st, flags),
        infer_sharding_from_operands=functools.partial(_infer, kind, st, flags),
        sharding_rule=_rule(kind, st, flags),
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
    """linear_chunks.chunked_forward, partitioned."""
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


def fused_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse=None, entropy=None):
    """linear_chunks.chunked_backward, partitioned; entropy: (g_entropy, mz) per row or None."""
    flags = (g_lse is not None, entropy is not None)
    args = (hidden, weight) + (() if bias is None else (bias,)) + (labels, lse, g_tokens)
    args += ((g_lse,) if g_lse is not None else ()) + (tuple(entropy) if entropy is not None else ())
    out = _op("backward", st, flags)(*args)
    return out[0], out[1], out[2] if st.with_bias else None
