"""The custom_vjp of the distillation loss around its kernels, and the jitted kernel path ``kernel_loss``.

Each kernel launch (launch.jsd_forward, launch.jsd_backward) is one op here, on any leading shape: batchable under
vmap (a vmapped launch is the same launch with the batch as one more leading axis), and under jit with several
devices a custom_partitioning op (fastce_jax/distributed/partitioning.py's approach, with its loss-neutral helpers
from distributed/layout.py) that runs on each device's block of rows, whatever mesh axes shard the leading
dimensions, with no communication (a "mean" then sums N floats); a sharded vocabulary is gathered (replicated)
around the launches. The teacher is a constant: it enters under ``jax.lax.stop_gradient``, so differentiating with
respect to it gives zeros, whether or not the kernels run. The public ``jsd`` is api.py's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from ...core.options import COMPILED, INTERPRETED
from ...distributed.layout import row_shardings
from .launch import JsdConfig, jsd_backward, jsd_forward
from .options import MIXTURE, JsdOptions, reduce_rows
from .reference import reference_backward, reference_rows

__all__ = ["JsdLaunch", "kernel_loss"]

# ----------------------------------------------------------------------------------------------------------------
# The kernel launches (any leading shape; vmap puts its axis in front of the rows).
# ----------------------------------------------------------------------------------------------------------------


class JsdLaunch(NamedTuple):
    """Static arguments of one launch (hashable)."""

    opts: JsdOptions
    interpret: bool
    has_labels: bool
    config: JsdConfig
    partitioned: bool  # several devices: the launches go through custom_partitioning (rows sharded)


def _split(args, st: JsdLaunch, n_rows: int):
    """(row operands, labels or None, beta operand or None) of a launch's operands (the first n_rows are per
    row: the logits, then the labels when there are labels; a mixture's beta operand last)."""
    rows = args[:n_rows]
    labels = rows[2] if st.has_labels else None
    beta = args[n_rows] if st.opts.kind == MIXTURE else None
    return rows, labels, beta


def _local_forward(st: JsdLaunch, *args):
    rows, labels, beta = _split(args, st, 2 + st.has_labels)
    student, teacher = rows[:2]
    lead = student.shape[:-1]
    flat = (student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1]))
    outs = jsd_forward(
        *flat, None if labels is None else labels.reshape(-1), beta, st.opts, interpret=st.interpret,
        config=st.config,
    )  # fmt: skip
    return tuple(o.reshape(lead) for o in outs)


def _local_backward(st: JsdLaunch, *args):
    # (student, teacher, lse_s, lse_t, kl, g, labels?, beta?)
    rows, labels, beta = _split(args[:2] + args[6:], st, 2 + st.has_labels)
    student, teacher = rows[:2]
    v = student.shape[-1]
    stats = [a.reshape(-1) for a in args[2:6]]
    d = jsd_backward(
        student.reshape(-1, v), teacher.reshape(-1, teacher.shape[-1]), None if labels is None else labels.reshape(-1),
        beta, *stats, st.opts, inplace=True, interpret=st.interpret, config=st.config,
    )  # fmt: skip
    return d.reshape(student.shape)


def _partitioned(local, st: JsdLaunch, n_rows: int, n_out: int):
    """local(st, *args) as a custom_partitioning op: under jit, each device runs the kernels on its block of rows
    (no communication: the rows are independent); several devices only."""
    n_shared = int(st.opts.kind == MIXTURE)
    n_logits = 2

    def layout(arg_shapes):
        return row_shardings(arg_shapes[0], n_logits, len(arg_shapes) - n_logits - n_shared, n_shared)

    def partition(mesh, arg_shapes, result_shape):
        mesh, operands, per_row = layout(arg_shapes)
        # The backward's one result, the student's gradient, is sharded like the student.
        results = operands[0] if n_out == 1 else (per_row,) * n_out
        return mesh, functools.partial(local, st), results, operands

    def infer(mesh, arg_shapes, result_shape):
        _, operands, per_row = layout(arg_shapes)
        return operands[0] if n_out == 1 else (per_row,) * n_out

    @custom_partitioning
    def op(*args):
        return local(st, *args)

    ins = "... v, ... w" + ", ..." * (n_rows - n_logits) + ", b" * n_shared
    outs = "... v" if n_out == 1 else ", ".join(["..."] * n_out)
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=f"{ins} -> {outs}")
    return op


def _launch_op(local, st: JsdLaunch, n_rows: int, n_out: int):
    """local(st, *args) as one op: partitioned by rows when there are several devices, batchable under vmap (a
    vmapped launch is the same launch with the batch as one more leading axis of its n_rows per-row operands;
    the kernels work row by row), jitted (an eager call is partitioned too)."""
    inner = _partitioned(local, st, n_rows, n_out) if st.partitioned else functools.partial(local, st)

    @jax.custom_batching.custom_vmap
    def op(*args):
        return inner(*args)

    @op.def_vmap
    def _(axis_size, in_batched, *args):
        return op(*_leading_batch(axis_size, in_batched, args, n_rows)), (True,) * n_out if n_out > 1 else True

    return jax.jit(op)


@functools.cache
def _forward_op(st: JsdLaunch):
    return _launch_op(_local_forward, st, 2 + st.has_labels, 4)


@functools.cache
def _backward_op(st: JsdLaunch):
    return _launch_op(_local_backward, st, 6 + st.has_labels, 1)


def _leading_batch(axis_size, in_batched, args, n_rows: int):
    """The per-row operands with the vmapped axis first (broadcast where not batched); the shared beta operand
    as it is."""
    if any(in_batched[n_rows:]):
        raise NotImplementedError("fastce_jax.jsd: beta cannot vary under vmap")
    rows = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args[:n_rows], in_batched)]
    return rows + list(args[n_rows:])


def _operands(labels, beta):
    return (() if labels is None else (labels,)) + (() if beta is None else (beta,))


def _terms_from_operand(beta, opts: JsdOptions):
    """The beta terms the reference reads, from the kernels' float32 operand (a mixture's only; the non-GPU
    branch of a platform-dependent trace)."""
    return None if opts.kind != MIXTURE else tuple(beta[i] for i in range(4))


def _route_forward(student, teacher, labels, beta, st: JsdLaunch, mode: str):
    extra = _operands(labels, beta)

    def compiled(x, t, *rest, interpret=False):
        return _forward_op(st._replace(interpret=interpret))(x, t, *rest)

    if mode in (COMPILED, INTERPRETED):
        return compiled(student, teacher, *extra, interpret=mode == INTERPRETED)

    def elsewhere(x, t, *rest):
        return reference_rows(x, t, labels, _terms_from_operand(beta, st.opts), st.opts)

    return jax.lax.platform_dependent(student, teacher, *extra, cuda=compiled, rocm=compiled, default=elsewhere)


def _route_backward(student, teacher, labels, beta, stats, g, st: JsdLaunch, mode: str):
    extra = _operands(labels, beta)

    def compiled(x, t, *rest, interpret=False):
        return _backward_op(st._replace(interpret=interpret))(x, t, *stats, g, *rest)

    if mode in (COMPILED, INTERPRETED):
        return compiled(student, teacher, *extra, interpret=mode == INTERPRETED)

    def elsewhere(x, t, *rest):
        return reference_backward(x, t, labels, _terms_from_operand(beta, st.opts), g, st.opts)

    return jax.lax.platform_dependent(student, teacher, *extra, cuda=compiled, rocm=compiled, default=elsewhere)


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp around the kernels.
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel_rows(student, teacher, labels, beta, st: JsdLaunch, mode: str):
    """Per-row losses (the leading shape). A call that is not differentiated runs this: nothing is kept."""
    return _route_forward(student, teacher, labels, beta, st, mode)[0]


def _kernel_rows_fwd(student, teacher, labels, beta, st: JsdLaunch, mode: str):
    loss, *stats = _route_forward(student, teacher, labels, beta, st, mode)
    # The logits in their own dtypes (no float32 copy) and 3 floats per row.
    return loss, (student, teacher, labels, beta, tuple(stats))


def _kernel_rows_bwd(st: JsdLaunch, mode: str, residuals, g):
    student, teacher, labels, beta, stats = residuals
    d_student = _route_backward(student, teacher, labels, beta, stats, g.astype(jnp.float32), st, mode)
    # No gradient for the teacher (a constant), the labels or beta.
    return d_student, None, None, None


_kernel_rows.defvjp(_kernel_rows_fwd, _kernel_rows_bwd)


@functools.partial(jax.jit, static_argnames=("st", "mode", "reduction"))
def kernel_loss(student, teacher, labels, beta, *, st: JsdLaunch, mode: str, reduction: str):
    """The kernel path, jitted once per static configuration (every beta in (0, 1) shares it: beta is an
    operand); under an outer jit it is inlined."""
    losses = _kernel_rows(student, jax.lax.stop_gradient(teacher), labels, beta, st, mode)
    return reduce_rows(losses, labels, reduction, st.opts.ignore_index)
