"""The custom_vjps of the fused linear cross-entropy around its chunk loops (linear_chunks.py on the engine,
fastce_jax/linear/engine.py), and the jitted kernel path ``kernel_loss``.

Reductions (jax.custom_vjp).
- "mean" / "sum": the gradients are computed in the forward pass of the VJP and are its residuals (the reduction's
  per-token factor is traced, no host synchronisation); the backward only multiplies them by the upstream scalar.
  6·N·H·V flops in all; a plain forward (no VJP) computes no gradients (2·N·H·V flops).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops.

A call with ``partitioned`` set (several devices) runs the loop through fastce_jax/distributed/linear_sharded.py's
custom_partitioning ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ...core.options import loss_divisor, lse_differentiated, reduce_losses
from ...core.outputs import with_outputs
from ...distributed import linear_sharded
from ...linear.engine import finish_grads, vocab_axis
from . import linear_chunks
from .linear_chunks import StaticConfig, extra_names

__all__ = ["forward_chunks", "backward_chunks", "kernel_loss"]


def forward_chunks(hidden, weight, bias, labels, g_tokens, st: StaticConfig, class_weight=None):
    """linear_chunks.chunked_forward, through linear_sharded.py's partitioned op when ``st.partitioned``."""
    if st.partitioned:
        return linear_sharded.fused_forward(hidden, weight, bias, labels, g_tokens, st)
    return linear_chunks.chunked_forward(hidden, weight, bias, labels, g_tokens, st, class_weight)


def backward_chunks(
    hidden, weight, bias, labels, lse, g_tokens, st: StaticConfig, g_lse=None, class_weight=None, entropy=None
):
    """linear_chunks.chunked_backward, through linear_sharded.py's partitioned op when ``st.partitioned``."""
    if st.partitioned:
        return linear_sharded.fused_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse, entropy)
    return linear_chunks.chunked_backward(hidden, weight, bias, labels, lse, g_tokens, st, g_lse, class_weight, entropy)


def _with_extras(loss, lse, extra: dict, st: StaticConfig):
    """What the custom_vjps return: the loss alone, or (loss, lse, *extras) when extra outputs are asked for."""
    return (loss, lse, *extra.values()) if st.returns else loss


# --- custom_vjp: "mean"/"sum" (the gradients are residuals) and "none" (lse is) ------------------------------------


def _token_scale(labels, n_items, st: StaticConfig, class_weight=None, token_weights=None):
    """d loss / d loss_t of the reduction: 1 / core.options.loss_divisor (traced; no host synchronisation), times the
    token's weight when there are token weights."""
    divisor = loss_divisor(labels, st.reduction, n_items, st.options.ignore_index, weight=class_weight)
    if token_weights is not None:
        return token_weights.astype(jnp.float32) / divisor
    return jnp.broadcast_to(1.0 / divisor, labels.shape)


def _weighted_reduce(losses, labels, n_items, st: StaticConfig, class_weight, token_weights):
    if token_weights is not None:
        losses = losses * token_weights.astype(losses.dtype)
    return reduce_losses(losses, labels, st.reduction, n_items, st.options.ignore_index, class_weight)


def _values(*primals):
    """The arrays of a symbolic_zeros custom_vjp fwd's arguments (each leaf a CustomVJPPrimal)."""
    return jax.tree.map(lambda p: p.value, primals, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _used(cotangent):
    """The cotangent as a float32 array, or None when it is a symbolic zero (that output is not differentiated)."""
    return None if isinstance(cotangent, SymbolicZero) else cotangent.astype(jnp.float32)


def _output_cotangents(g, st: StaticConfig):
    """(the loss's cotangent, the lse cotangent or None, the entropy output's cotangent or None) of a custom_vjp's
    output cotangents; None where that output is not differentiated (a symbolic zero) or carries no gradient."""
    if not st.returns:
        return _used(g), None, None
    g_loss, g_lse, *g_rest = g
    g_lse = _used(g_lse) if lse_differentiated(st.options, st.returns) else None
    g_entropy = dict(zip(extra_names(st), g_rest)).get("entropy")
    return _used(g_loss), g_lse, None if g_entropy is None else _used(g_entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _reduced_loss(hidden, weight, bias, labels, n_items, class_weight, token_weights, st: StaticConfig):
    losses, lse, _, extra = forward_chunks(hidden, weight, bias, labels, None, st, class_weight)
    loss = _weighted_reduce(losses, labels, n_items, st, class_weight, token_weights)
    return _with_extras(loss, lse, extra, st)


def _reduced_fwd(*primals):
    *primals, st = primals
    hidden, weight, bias, labels, n_items, class_weight, token_weights = _values(*primals)
    # Token weights: each row's factor w_t / divisor in place of the scalar 1 / divisor; the same single pass.
    g_tokens = _token_scale(labels, n_items, st, class_weight, token_weights)
    losses, lse, grads, extra = forward_chunks(hidden, weight, bias, labels, g_tokens, st, class_weight)
    loss = _weighted_reduce(losses, labels, n_items, st, class_weight, token_weights)
    # Zero-size stand-ins keep the input dtypes for the backward's casts.
    likes = (jnp.zeros((0,), hidden.dtype), jnp.zeros((0,), weight.dtype), None if bias is None else bias[:0])
    # A returned z_loss or entropy: its gradient is only known in the backward, which recomputes the chunks.
    inputs = None
    if lse_differentiated(st.options, st.returns) or st.returns.entropy:
        inputs = (hidden, weight, bias, labels, lse, extra.get("entropy"))
    return _with_extras(loss, lse, extra, st), (grads, likes, inputs, class_weight, token_weights)


def _reduced_bwd(st: StaticConfig, residuals, g):
    grads, (h_like, w_like, b_like), inputs, class_weight, token_weights = residuals
    g, g_lse, g_entropy = _output_cotangents(g, st)
    extra = None
    if g_lse is not None or g_entropy is not None:
        hidden, weight, bias, labels, lse, entropy = inputs

        def outputs_part():
            # The loss's part is the residual gradients; this pass adds the outputs' (no class weights: g_lse
            # already holds their factor of the z_loss output, and the entropy is unweighted).
            zeros = jnp.zeros(labels.shape, jnp.float32)
            ent = None if g_entropy is None else (g_entropy, lse - entropy)
            return backward_chunks(hidden, weight, bias, labels, lse, zeros, st, g_lse, entropy=ent)

        def nothing():
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(outputs_part))

        # Only an output that is differentiated costs the recomputing pass (logging it costs nothing).
        nonzero = [jnp.any(c != 0) for c in (g_lse, g_entropy) if c is not None]
        extra = jax.lax.cond(functools.reduce(jnp.logical_or, nonzero), outputs_part, nothing)
    scale = jnp.zeros((), jnp.float32) if g is None else g
    dh, dw, db = finish_grads(grads, h_like, w_like, b_like, scale=scale, extra=extra)
    return dh, dw, db, None, None, _zero_like(class_weight), _zero_like(token_weights)


def _zero_like(constant):
    """The cotangent of a constant operand (class or token weights, which never get a gradient)."""
    return None if constant is None else jnp.zeros_like(constant)


_reduced_loss.defvjp(_reduced_fwd, _reduced_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _per_token_losses(hidden, weight, bias, labels, class_weight, st: StaticConfig):
    losses, lse, _, extra = forward_chunks(hidden, weight, bias, labels, None, st, class_weight)
    return _with_extras(losses, lse, extra, st)


def _per_token_fwd(*primals):
    *primals, st = primals
    hidden, weight, bias, labels, class_weight = _values(*primals)
    losses, lse, _, extra = forward_chunks(hidden, weight, bias, labels, None, st, class_weight)
    residuals = (hidden, weight, bias, labels, lse, class_weight, extra.get("entropy"))
    return _with_extras(losses, lse, extra, st), residuals


def _per_token_bwd(st: StaticConfig, residuals, g):
    hidden, weight, bias, labels, lse, class_weight, entropy = residuals
    g, g_lse, g_entropy = _output_cotangents(g, st)
    g = jnp.zeros(labels.shape, jnp.float32) if g is None else g
    # A differentiated entropy output adds its term to the same recomputing pass (no extra matmul).
    ent = None if g_entropy is None else (g_entropy, lse - entropy)
    grads = backward_chunks(hidden, weight, bias, labels, lse, g, st, g_lse, class_weight, ent)
    dh, dw, db = finish_grads(grads, hidden, weight, bias)
    return dh, dw, db, None, _zero_like(class_weight)


_per_token_losses.defvjp(_per_token_fwd, _per_token_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnames=("st",))
def kernel_loss(h2, weight, bias, labels, n_items, class_weight=None, token_weights=None, *, st: StaticConfig):
    """The chunked kernel path, jitted once per static configuration (an eager call reuses its trace)."""
    if st.reduction == "none":
        outs = _per_token_losses(h2, weight, bias, labels, class_weight, st)
        if token_weights is not None:
            # Outside the custom_vjp: the backward's per-token upstream is then g_t * w_t.
            outs = (outs[0] * token_weights, *outs[1:]) if st.returns else outs * token_weights
    else:
        outs = _reduced_loss(h2, weight, bias, labels, n_items, class_weight, token_weights, st)
    if not st.returns:
        return outs
    loss, lse, *rest = outs
    extra = dict(zip(extra_names(st), rest))
    return with_outputs(
        loss, lse, extra.get("accuracy"), extra.get("entropy"), labels, st.reduction, n_items, st.options, st.returns,
        weight.shape[vocab_axis(st)], class_weight, token_weights=token_weights, entropy_grad=True,
    )  # fmt: skip
