"""Distillation loss between a student's and a teacher's logits: ``jsd`` (issue 38; CONTRACT.md), TRL's generalized
Jensen-Shannon divergence, forward KL at beta = 0 and reverse KL at beta = 1.

Layers: the argument checks (jsd_contract.py), the jnp reference (``reference_rows``: backend="reference",
float64 inputs, and the non-GPU branch of a platform-dependent trace), the custom_vjp around the kernels
(kernels/jsd.py) and the public ``jsd``. The teacher is a constant: it enters under ``jax.lax.stop_gradient``, so
differentiating with respect to it gives zeros, whether or not the kernels run.

Sharded logits (several devices, under jit): each kernel launch is a custom_partitioning op (ops.py's approach)
that runs on each device's block of rows, whatever mesh axes shard the leading dimensions, with no communication
(a "mean" then sums N floats); a sharded vocabulary is gathered (replicated) around the launches.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import contract, jsd_contract, ops
from .cross_entropy import COMPILED, INTERPRETED, _route
from .jsd_contract import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions
from .kernels import jsd as jsd_kernels

# ----------------------------------------------------------------------------------------------------------------
# The jnp reference.
# ----------------------------------------------------------------------------------------------------------------


def _log_softmax(u):
    """log softmax over the last axis, with the row's max stopped (an all -inf row shifts by 0)."""
    m = jax.lax.stop_gradient(jnp.max(u, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    lse = m + jnp.log(jnp.sum(jnp.exp(u - m), axis=-1, keepdims=True))
    return u - lse, lse[..., 0]


def reference_rows(student, teacher, labels, beta_terms, opts: JsdOptions):
    """(loss, lse_s, lse_t, kl_s) per row of student logits (..., V) and teacher logits (..., V_t >= V) in jnp,
    the kernels' outputs (float32; float64 for float64 student logits); differentiable in the student by plain
    autodiff (the teacher is stop_gradient'ed). beta_terms: kernels.jsd.beta_terms(beta), floats or traced
    scalars (a mixture's only). Ignored rows are zeroed before any math, so their gradient is exactly 0; a
    probability of 0 (a -inf logit) takes no part in any term or gradient."""
    dtype = contract.compute_dtype(student.dtype)
    vocab = student.shape[-1]
    teacher = jax.lax.stop_gradient(teacher[..., :vocab])
    ignored = None
    ign = None if labels is None else contract.ignore_value(labels.dtype, opts.ignore_index)
    if ign is not None:
        ignored = labels == ign
        student = jnp.where(ignored[..., None], jnp.zeros((), student.dtype), student)
        teacher = jnp.where(ignored[..., None], jnp.zeros((), teacher.dtype), teacher)
    ls, lse_s = _log_softmax(contract.transform(student.astype(dtype), opts.student))
    lt, lse_t = _log_softmax(contract.transform(teacher.astype(dtype), opts.teacher))
    dead_s, dead_t = ls == -jnp.inf, lt == -jnp.inf
    # Log-probabilities with 0 where the probability is 0: no inf reaches a product or its derivative.
    ls0, lt0 = jnp.where(dead_s, 0.0, ls), jnp.where(dead_t, 0.0, lt)
    p_s, p_t = jnp.exp(ls), jnp.exp(lt)
    if opts.kind == FORWARD_KL:
        loss = kl = jnp.sum(jnp.where(dead_t, 0.0, p_t * (lt0 - ls)), axis=-1)
    elif opts.kind == REVERSE_KL:
        loss = kl = jnp.sum(jnp.where(dead_s, 0.0, p_s * (ls0 - lt)), axis=-1)
    else:
        beta, one_minus_beta, log_beta, log_one_minus_beta = beta_terms
        a, b = log_one_minus_beta + ls0, log_beta + lt0
        lm = jnp.where(dead_s, b, jnp.where(dead_t, a, jnp.logaddexp(a, b)))
        kl_t = jnp.sum(jnp.where(dead_t, 0.0, p_t * (lt0 - lm)), axis=-1)
        kl = jnp.sum(jnp.where(dead_s, 0.0, p_s * (ls0 - lm)), axis=-1)
        loss = beta * kl_t + one_minus_beta * kl
    if ignored is not None:
        loss, kl = jnp.where(ignored, 0.0, loss), jnp.where(ignored, 0.0, kl)
    return loss, lse_s, lse_t, kl


def reference_backward(student, teacher, labels, beta_terms, g, opts: JsdOptions):
    """d(sum_rows g * loss) / d student of reference_rows."""
    _, vjp = jax.vjp(lambda x: reference_rows(x, teacher, labels, beta_terms, opts)[0], student)
    return vjp(g.astype(contract.compute_dtype(student.dtype)))[0]


def reference_terms(beta: float, opts: JsdOptions, dtype):
    """A mixture's beta terms as a (4,) array of the computation's dtype (float64 for float64 logits), else None."""
    if opts.kind != MIXTURE:
        return None
    return jnp.asarray(jsd_kernels.beta_terms(beta), contract.compute_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("opts", "reduction"))
def reference_loss(student, teacher, labels, terms, opts: JsdOptions, reduction: str):
    """backend="reference": reference_rows reduced, jitted once per static configuration (beta is an operand)."""
    terms = None if terms is None else tuple(terms[i] for i in range(4))
    losses = reference_rows(student, teacher, labels, terms, opts)[0]
    return reduce_rows(losses, labels, reduction, opts.ignore_index)


def counted_rows(labels, n_rows: int, ignore_index: int, dtype=jnp.float32):
    """The "mean" divisor: the number of rows whose label is not ignore_index (labels None: n_rows), at least 1
    (all ignored gives a mean of 0). Traced: no host synchronisation."""
    ign = None if labels is None else contract.ignore_value(labels.dtype, ignore_index)
    count = n_rows if ign is None else jnp.sum(labels != ign)
    return jnp.maximum(count, 1).astype(dtype)


def reduce_rows(losses, labels, reduction: str, ignore_index: int):
    """The per-row losses reduced: "none" as they are, "sum", or "mean" over the counted rows (counted_rows)."""
    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    return total / counted_rows(labels, losses.size, ignore_index, total.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The kernel launches (any leading shape; vmap puts its axis in front of the rows).
# ----------------------------------------------------------------------------------------------------------------


class _Launch(NamedTuple):
    """Static arguments of one launch (hashable)."""

    opts: JsdOptions
    interpret: bool
    has_labels: bool
    config: jsd_kernels.JsdConfig
    partitioned: bool  # several devices: the launches go through custom_partitioning (rows sharded)


def _split(args, st: _Launch, n_rows: int):
    """(row operands, labels or None, beta operand or None) of a launch's operands (the first n_rows are per
    row: the logits, then the labels when there are labels; a mixture's beta operand last)."""
    rows = args[:n_rows]
    labels = rows[2] if st.has_labels else None
    beta = args[n_rows] if st.opts.kind == MIXTURE else None
    return rows, labels, beta


def _local_forward(st: _Launch, *args):
    rows, labels, beta = _split(args, st, 2 + st.has_labels)
    student, teacher = rows[:2]
    lead = student.shape[:-1]
    flat = (student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1]))
    outs = jsd_kernels.jsd_forward(
        *flat, None if labels is None else labels.reshape(-1), beta, st.opts, interpret=st.interpret,
        config=st.config,
    )  # fmt: skip
    return tuple(o.reshape(lead) for o in outs)


def _local_backward(st: _Launch, *args):
    # (student, teacher, lse_s, lse_t, kl, g, labels?, beta?)
    rows, labels, beta = _split(args[:2] + args[6:], st, 2 + st.has_labels)
    student, teacher = rows[:2]
    v = student.shape[-1]
    stats = [a.reshape(-1) for a in args[2:6]]
    d = jsd_kernels.jsd_backward(
        student.reshape(-1, v), teacher.reshape(-1, teacher.shape[-1]), None if labels is None else labels.reshape(-1),
        beta, *stats, st.opts, inplace=True, interpret=st.interpret, config=st.config,
    )  # fmt: skip
    return d.reshape(student.shape)


def _row_shardings(arg, n_logits: int, n_rows: int, n_shared: int):
    """(mesh, operand shardings, per-row sharding) for logits ``arg`` as XLA sharded them: the rows keep their
    sharding (ops._plan: mesh axes that divide them), the vocabulary is replicated (a sharded one is gathered),
    the per-row operands follow the rows, the beta operand is replicated."""
    mesh, rows, _ = ops._plan(arg)
    logits, per_row = NamedSharding(mesh, P(*rows, None)), NamedSharding(mesh, P(*rows))
    return mesh, (logits,) * n_logits + (per_row,) * n_rows + (NamedSharding(mesh, P()),) * n_shared, per_row


def _partitioned(local, st: _Launch, n_rows: int, n_out: int):
    """local(st, *args) as a custom_partitioning op: under jit, each device runs the kernels on its block of rows
    (no communication: the rows are independent); several devices only."""
    n_shared = int(st.opts.kind == MIXTURE)
    n_logits = 2

    def layout(arg_shapes):
        return _row_shardings(arg_shapes[0], n_logits, len(arg_shapes) - n_logits - n_shared, n_shared)

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


def _launch_op(local, st: _Launch, n_rows: int, n_out: int):
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
def _forward_op(st: _Launch):
    return _launch_op(_local_forward, st, 2 + st.has_labels, 4)


@functools.cache
def _backward_op(st: _Launch):
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


def _route_forward(student, teacher, labels, beta, st: _Launch, mode: str):
    extra = _operands(labels, beta)

    def compiled(x, t, *rest, interpret=False):
        return _forward_op(st._replace(interpret=interpret))(x, t, *rest)

    if mode in (COMPILED, INTERPRETED):
        return compiled(student, teacher, *extra, interpret=mode == INTERPRETED)

    def elsewhere(x, t, *rest):
        return reference_rows(x, t, labels, _terms_from_operand(beta, st.opts), st.opts)

    return jax.lax.platform_dependent(student, teacher, *extra, cuda=compiled, rocm=compiled, default=elsewhere)


def _route_backward(student, teacher, labels, beta, stats, g, st: _Launch, mode: str):
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
def _kernel_rows(student, teacher, labels, beta, st: _Launch, mode: str):
    """Per-row losses (the leading shape). A call that is not differentiated runs this: nothing is kept."""
    return _route_forward(student, teacher, labels, beta, st, mode)[0]


def _kernel_rows_fwd(student, teacher, labels, beta, st: _Launch, mode: str):
    loss, *stats = _route_forward(student, teacher, labels, beta, st, mode)
    # The logits in their own dtypes (no float32 copy) and 3 floats per row.
    return loss, (student, teacher, labels, beta, tuple(stats))


def _kernel_rows_bwd(st: _Launch, mode: str, residuals, g):
    student, teacher, labels, beta, stats = residuals
    d_student = _route_backward(student, teacher, labels, beta, stats, g.astype(jnp.float32), st, mode)
    # No gradient for the teacher (a constant), the labels or beta.
    return d_student, None, None, None


_kernel_rows.defvjp(_kernel_rows_fwd, _kernel_rows_bwd)


@functools.partial(jax.jit, static_argnames=("st", "mode", "reduction"))
def _kernel_loss(student, teacher, labels, beta, *, st: _Launch, mode: str, reduction: str):
    """The kernel path, jitted once per static configuration (every beta in (0, 1) shares it: beta is an
    operand); under an outer jit it is inlined."""
    losses = _kernel_rows(student, jax.lax.stop_gradient(teacher), labels, beta, st, mode)
    return reduce_rows(losses, labels, reduction, st.opts.ignore_index)


# ----------------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------------


def jsd(
    student_logits,
    teacher_logits,
    labels=None,
    *,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
    student_softcapping=0.0,
    teacher_softcapping=0.0,
    backend="auto",
):
    """TRL's generalized Jensen-Shannon divergence between the student's and the teacher's next-token
    distributions, per token, reduced.

    With p_s = softmax(z_s / T), p_t = softmax(z_t / T) (z: the logits after soft-capping, c * tanh(x / c), c = 0
    off): beta = 0 is KL(p_t || p_s) (forward KL), beta = 1 is KL(p_s || p_t) (reverse KL), and 0 < beta < 1 is
    beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 - beta) p_s + beta p_t.

    Args:
      student_logits: float32/bfloat16/float16/float64 (..., V).
      teacher_logits: (..., V_t), the same leading shape, V_t >= V: a wider (padded) teacher head is compared on
        its first V columns, its softmax taken over them (exact when its extra columns are -inf or carry no
        mass); the other columns are never read.
      labels: None (every token counts) or int32/int64 (...): only a mask, tokens whose label is ``ignore_index``
        count for nothing (loss 0, gradient 0, their logits never read); other values are not read.
      beta: a float in [0, 1]. temperature: T > 0. student_softcapping, teacher_softcapping: c >= 0 (0: off).
      reduction: "mean" (over the counted tokens; 0 when none is counted), "sum" or "none" (per token, the
        leading shape).
      backend: "auto" (the kernels for GPU arrays, the jnp reference elsewhere; under a trace in a process with a
        GPU backend decided when lowered), "kernel" (the Pallas kernels always; interpret mode off GPU) or
        "reference" (plain jnp, every transform). float64 student logits are computed in float64 by the reference.

    The loss is float32 (float64 for float64 student logits); a NaN in a token's logits makes that token's loss
    and gradient NaN only. The student gets the gradient (in its dtype); the teacher is a constant
    (``stop_gradient``: its gradient is zero). jit, grad and vmap work; a call that is not differentiated keeps
    nothing for a backward.
    """
    opts, beta = jsd_contract.check_jsd_options(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcapping=student_softcapping, teacher_softcapping=teacher_softcapping, backend=backend,
    )  # fmt: skip
    student, teacher = jsd_contract.check_logits(student_logits, teacher_logits)
    labels = jsd_contract.check_jsd_labels(labels, student.shape[:-1], opts.ignore_index, "student_logits")
    route = _route(student, backend)
    student, teacher = jnp.asarray(student), jnp.asarray(teacher)
    labels = None if labels is None else jnp.asarray(labels)
    if jnp.float64 in (student.dtype, teacher.dtype) or math.prod(student.shape[:-1]) == 0:
        route = "reference"  # the kernels compute in float32; an empty grid has no kernel
    if route == "reference":
        return reference_loss(student, teacher, labels, reference_terms(beta, opts, student.dtype), opts, reduction)
    vocab = student.shape[-1]
    st = _Launch(opts, route == INTERPRETED, labels is not None, jsd_kernels.jsd_config(vocab), jax.device_count() > 1)
    beta_operand = jsd_kernels.beta_operand(beta) if opts.kind == MIXTURE else None
    with jsd_kernels.quiet_triton(interpret=route == INTERPRETED):
        return _kernel_loss(student, teacher, labels, beta_operand, st=st, mode=route, reduction=reduction)
