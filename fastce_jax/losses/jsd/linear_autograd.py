"""The custom_vjps of the fused linear distillation loss around its chunk loops (linear_chunks.py), and the jitted
kernel path ``kernel_loss``.

Gradients (student hidden, weight, bias only; the teacher's hidden, weight and bias enter under stop_gradient):
"mean" / "sum" compute them in the forward pass of the VJP and only scale them by the upstream scalar in the
backward; "none" keeps lse_s, lse_t and kl_s per row and recomputes both chunks of logits in the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...linear.engine import finish_grads
from .linear_chunks import LinearJsdConfig, chunked_backward, chunked_forward
from .options import counted_rows, reduce_rows

__all__ = ["kernel_loss"]


def _row_scale(labels, n_rows: int, st: LinearJsdConfig):
    """d loss / d loss_t of "mean" / "sum" per row (traced, no host synchronisation); ignored rows get whatever:
    the kernels give them a zero gradient."""
    unit = jnp.ones((n_rows,), jnp.float32)
    return unit / counted_rows(labels, n_rows, st.opts.ignore_index) if st.reduction == "mean" else unit


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _reduced_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    losses, _, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st)
    return reduce_rows(losses, labels, st.reduction, st.opts.ignore_index)


def _reduced_fwd(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    g_rows = _row_scale(labels, h_s.shape[0], st)
    losses, grads, _ = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, g_rows, st)
    # Zero-size stand-ins keep the inputs' dtypes for the backward's casts.
    likes = (h_s[:0], w_s[:0], None if b_s is None else b_s[:0])
    return reduce_rows(losses, labels, st.reduction, st.opts.ignore_index), (grads, likes)


def _reduced_bwd(st: LinearJsdConfig, residuals, g):
    grads, likes = residuals
    return (*finish_grads(grads, *likes, scale=g.astype(jnp.float32)), None, None, None, None, None)


_reduced_loss.defvjp(_reduced_fwd, _reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _row_losses(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    return chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st)[0]


def _row_losses_fwd(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st: LinearJsdConfig):
    losses, _, stats = chunked_forward((h_s, w_s, b_s), (h_t, w_t, b_t), labels, beta, None, st, keep_stats=True)
    return losses, (h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, stats)


def _row_losses_bwd(st: LinearJsdConfig, residuals, g):
    h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, stats = residuals
    student = (h_s, w_s, b_s)
    grads = chunked_backward(student, (h_t, w_t, b_t), labels, beta, stats, g.astype(jnp.float32), st)
    return (*finish_grads(grads, *student), None, None, None, None, None)


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


@functools.partial(jax.jit, static_argnames=("st",))
def kernel_loss(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, *, st: LinearJsdConfig):
    """The chunked kernel path, jitted once per static configuration (every beta in (0, 1) shares it)."""
    h_t, w_t, b_t = jax.lax.stop_gradient((h_t, w_t, b_t))
    loss_fn = _row_losses if st.reduction == "none" else _reduced_loss
    return loss_fn(h_s, w_s, b_s, h_t, w_t, b_t, labels, beta, st)
