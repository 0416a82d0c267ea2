"""jsd's own formulas in plain jnp: the reference of the distillation loss (``reference_rows``: backend="reference",
float64 inputs, and the non-GPU branch of a platform-dependent trace), its gradient and its reduced loss. The
transform of each side is the contract's (fastce_jax/core/reference.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core.options import ignore_value
from ...core.reference import compute_dtype, transform
from .options import FORWARD_KL, MIXTURE, REVERSE_KL, JsdOptions, beta_terms, reduce_rows

__all__ = ["reference_rows", "reference_backward", "reference_terms", "reference_loss"]


def _log_softmax(u):
    """log softmax over the last axis, with the row's max stopped (an all -inf row shifts by 0)."""
    m = jax.lax.stop_gradient(jnp.max(u, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    lse = m + jnp.log(jnp.sum(jnp.exp(u - m), axis=-1, keepdims=True))
    return u - lse, lse[..., 0]


def reference_rows(student, teacher, labels, beta_terms, opts: JsdOptions):
    """(loss, lse_s, lse_t, kl_s) per row of student logits (..., V) and teacher logits (..., V_t >= V) in jnp,
    the kernels' outputs (float32; float64 for float64 student logits); differentiable in the student by plain
    autodiff (the teacher is stop_gradient'ed). beta_terms: options.beta_terms(beta), floats or traced
    scalars (a mixture's only). Ignored rows are zeroed before any math, so their gradient is exactly 0; a
    probability of 0 (a -inf logit) takes no part in any term or gradient."""
    dtype = compute_dtype(student.dtype)
    vocab = student.shape[-1]
    teacher = jax.lax.stop_gradient(teacher[..., :vocab])
    ignored = None
    ign = None if labels is None else ignore_value(labels.dtype, opts.ignore_index)
    if ign is not None:
        ignored = labels == ign
        student = jnp.where(ignored[..., None], jnp.zeros((), student.dtype), student)
        teacher = jnp.where(ignored[..., None], jnp.zeros((), teacher.dtype), teacher)
    ls, lse_s = _log_softmax(transform(student.astype(dtype), opts.student))
    lt, lse_t = _log_softmax(transform(teacher.astype(dtype), opts.teacher))
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
    return vjp(g.astype(compute_dtype(student.dtype)))[0]


def reference_terms(beta: float, opts: JsdOptions, dtype):
    """A mixture's beta terms as a (4,) array of the computation's dtype (float64 for float64 logits), else None."""
    if opts.kind != MIXTURE:
        return None
    return jnp.asarray(beta_terms(beta), compute_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("opts", "reduction"))
def reference_loss(student, teacher, labels, terms, opts: JsdOptions, reduction: str):
    """backend="reference": reference_rows reduced, jitted once per static configuration (beta is an operand)."""
    terms = None if terms is None else tuple(terms[i] for i in range(4))
    losses = reference_rows(student, teacher, labels, terms, opts)[0]
    return reduce_rows(losses, labels, reduction, opts.ignore_index)
