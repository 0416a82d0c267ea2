"""The custom_vjp of the cross-entropy around its kernels, and the jitted kernel path ``kernel_loss``.

The forward and backward launches go through ``fastce_jax/distributed/partitioning.py`` (custom_partitioning of
sharded logits, the jvp rules of higher-order autodiff); ``_route_forward`` / ``_route_backward`` pick the compiled,
interpreted or platform-dependent path (core.options.route). The public ``cross_entropy`` is ``api.py``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core.options import COMPILED, INTERPRETED, NO_EXTRAS, Options, lse_differentiated
from ...core.outputs import reduce_outputs
from ...core.reference import reference_backward, reference_row_outputs, reference_token_losses
from ...distributed import partitioning

__all__ = ["kernel_loss"]

# ----------------------------------------------------------------------------
# custom_vjp around the kernels.
# ----------------------------------------------------------------------------


def _reference_forward(logits, labels, options: Options, returns=NO_EXTRAS, weight=None):
    if returns:
        loss, lse, accuracy, entropy = reference_row_outputs(logits, labels, options, returns, weight)
        return (loss, lse) + tuple(v for v in (accuracy, entropy) if v is not None)
    # The reference backward recomputes from the logits; the lse slot only keeps both branches' outputs alike.
    loss = reference_token_losses(logits, labels, options, weight)
    return loss, jnp.zeros_like(loss)


def _route_forward(logits, labels, options: Options, mode: str, configs, returns=NO_EXTRAS, weight=None):
    kw = {"returns": returns} if returns else {}
    # Class weights travel as one more operand (none without them).
    weights = () if weight is None else (weight,)

    def compiled(x, y, *w, interpret=False):
        return partitioning.forward(
            x, y, options, interpret=interpret, config=configs[0], **kw, **dict(zip(["weight"], w))
        )

    if mode in (COMPILED, INTERPRETED):
        return compiled(logits, labels, *weights, interpret=mode == INTERPRETED)

    def elsewhere(x, y, *w):
        return _reference_forward(x, y, options, returns, *w)

    return jax.lax.platform_dependent(logits, labels, *weights, cuda=compiled, rocm=compiled, default=elsewhere)


def _route_backward(
    logits, labels, lse, g, options: Options, inplace: bool, mode: str, configs, g_lse=None, weight=None,
    g_entropy=None, mz=None,
):  # fmt: skip
    kw = {} if g_lse is None else {"g_lse": g_lse}
    if weight is not None:
        kw["weight"] = weight
    if g_entropy is not None:
        kw.update(g_entropy=g_entropy, mz=mz)

    def compiled(x, y, lse, g, *gl, interpret=False):
        return partitioning.backward(
            x, y, lse, g, options, inplace=inplace, interpret=interpret, config=configs[1], **dict(zip(kw, gl))
        )

    extra = tuple(kw.values())
    if mode in (COMPILED, INTERPRETED):
        return compiled(logits, labels, lse, g, *extra, interpret=mode == INTERPRETED)

    def elsewhere(x, y, lse, g, *gl):
        named = dict(zip(kw, gl))
        named.pop("mz", None)  # the reference recomputes it
        return reference_backward(x, y, g, options, **named)

    return jax.lax.platform_dependent(logits, labels, lse, g, *extra, cuda=compiled, rocm=compiled, default=elsewhere)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _kernel_token_losses(logits, labels, weight, options: Options, inplace: bool, mode: str, configs, returns):
    """Per-token losses; with any extra output asked for, the tuple (loss, lse, accuracy?, entropy?) of the
    forward kernels (lse differentiable when a returned z_loss needs it, entropy differentiable, accuracy not).
    weight: class weights (V,) or None (a constant: core.options.check_class_weight refuses its gradient). A call
    that is not differentiated runs this (no residuals kept)."""
    outs = _route_forward(logits, labels, options, mode, configs, returns, weight)
    return tuple(outs) if returns else outs[0]


def _kernel_fwd(logits, labels, weight, options: Options, inplace: bool, mode: str, configs, returns):
    # symbolic_zeros: the primals arrive wrapped (CustomVJPPrimal); weight may be None.
    logits, labels, weight = (None if a is None else a.value for a in (logits, labels, weight))
    # logits (..., V) and labels (...) keep their shape here so that a sharding
    # of any leading axis reaches distributed/partitioning.py without a reshape across devices.
    outs = _route_forward(logits, labels, options, mode, configs, returns, weight)
    entropy = outs[-1] if returns.entropy else None
    # Residuals: only what the backward reads.  logits stays in its own dtype
    # (no float32 copy); lse (and the entropy, when returned) is N floats.
    return (tuple(outs) if returns else outs[0]), (logits, labels, outs[1], entropy, weight)


def _is_zero(cotangent) -> bool:
    """Whether a cotangent is symbolically zero (its output is not differentiated)."""
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _kernel_bwd(options: Options, inplace: bool, mode: str, configs, returns, residuals, g):
    logits, labels, lse, entropy, weight = residuals
    cotangents = list(g) if returns else [g]
    no_weight_grad = None if weight is None else jnp.zeros_like(weight)
    # Only lse's cotangent (from a returned z_loss) and the entropy's flow back; accuracy is not differentiable.
    # An output that is not differentiated gets a symbolic zero: its kernel variant does not run.
    g_lse = cotangents[1] if lse_differentiated(options, returns) else None
    g_lse = None if _is_zero(g_lse) else g_lse
    g_entropy = cotangents[-1] if returns.entropy and not _is_zero(cotangents[-1]) else None
    g_loss = cotangents[0]
    if _is_zero(g_loss):
        if g_lse is None and g_entropy is None:
            return jnp.zeros_like(logits), None, no_weight_grad
        g_loss = jnp.zeros(labels.shape, jnp.float32)
    # g_loss is the per-token upstream factor: 1/denominator (broadcast) for "mean", 1 for "sum", the caller's
    # cotangent (times the token weights) for "none".
    mz = None if g_entropy is None else lse - entropy  # sum_j p_j z_j per row
    dlogits = _route_backward(
        logits, labels, lse, g_loss, options, inplace, mode, configs, g_lse, weight, g_entropy, mz
    )
    return dlogits, None, no_weight_grad


_kernel_token_losses.defvjp(_kernel_fwd, _kernel_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnames=("options", "reduction", "inplace", "mode", "configs", "returns"))
def kernel_loss(
    logits, labels, n_items, weight, token_weights, *, options: Options, reduction: str, inplace: bool, mode: str,
    configs, returns,
):  # fmt: skip
    """The kernel path, jitted once per static configuration: an eager call reuses its trace and executable
    instead of tracing and lowering the Pallas kernels again (under an outer jit it is inlined). token_weights
    multiply the per-token losses outside the custom_vjp, so they reach the backward kernel as its per-row
    upstream factor (no extra pass)."""
    outs = _kernel_token_losses(logits, labels, weight, options, inplace, mode, configs, returns)
    loss, lse, *rest = outs if returns else (outs, None)
    accuracy = rest.pop(0) if returns.accuracy else None
    entropy = rest.pop(0) if returns.entropy else None
    return reduce_outputs(
        loss, lse, accuracy, entropy, labels, reduction, n_items, options, returns, logits.shape[-1], weight,
        token_weights=token_weights, entropy_grad=True,
    )  # fmt: skip
