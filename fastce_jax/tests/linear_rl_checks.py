"""Helpers of the fused linear loss's RL tests (test_linear_rl.py, test_linear_rl_entropy.py): a float64 NumPy
reference of temperature, token weights and the entropy's gradient, the kernel path's value and gradients, and the
matmuls a traced call runs.

The reference computes the temperature literally, z = softcap(scaling * x) / T (shared_tests/reference.py's
transform, then the division), and runs shared_tests' cross_entropy on z with the remaining options; the entropy's
gradient dH/dz_j = p_j (mz - z_j) (mz = sum_j p_j z_j) is added by hand, then chained through dz/dx and the
matmul.
"""

import jax
import jax.numpy as jnp
import numpy as np

from fastce_jax import linear_cross_entropy
from shared_tests import reference as ref64

from .checks import as_float64
from .test_linear_cross_entropy import LOSS_TOL, ROWS, assert_close, grad_tol


def expected(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    reduction="mean",
    n_items=None,
    temperature=1.0,
    token_weights=None,
    class_weight=None,
    g_loss=1.0,
    g_entropy=None,
    **opts,
):
    """float64 (loss, entropy output, d hidden, d weight, d bias) of g_loss * loss + g_entropy * entropy (both
    scalars for "mean" / "sum", per-token arrays for "none"; g_entropy None: the loss alone). Labels flat (N,)."""
    h = as_float64(hidden).reshape(-1, hidden.shape[-1])
    w = as_float64(weight)
    y = np.asarray(labels).reshape(-1).astype(np.int64)
    x = h @ w.T + (0.0 if bias is None else as_float64(bias))
    base = ref64.Options(**opts)
    z = ref64.transform(x, base) / temperature
    dz_dx = ref64.dz_dx(x, base) / temperature
    plain = ref64.Options(ignore_index=base.ignore_index, label_smoothing=base.label_smoothing, z_loss=base.z_loss)
    ignored = y == base.ignore_index
    tw = np.ones(y.shape) if token_weights is None else np.asarray(token_weights, np.float64).reshape(-1)
    tw = np.where(ignored, 0.0, tw)
    cw = None if class_weight is None else np.asarray(class_weight, np.float64)
    if reduction == "none":
        den = den_h = 1.0
        g_tok = np.broadcast_to(np.asarray(g_loss, np.float64), y.shape).reshape(-1)
        g_h = None if g_entropy is None else np.broadcast_to(np.asarray(g_entropy, np.float64), y.shape).reshape(-1)
    else:
        den = ref64.denominator(y, reduction, n_items, base.ignore_index, cw)
        den_h = ref64.denominator(y, reduction, n_items, base.ignore_index)
        g_tok = np.full(y.shape, g_loss / den)
        g_h = None if g_entropy is None else np.full(y.shape, g_entropy / den_h)
    r = ref64.cross_entropy(z, y, reduction="none", upstream=g_tok * tw, opts=plain, weight=cw)
    token = r.token_loss * tw
    loss = token.reshape(np.shape(labels)) if reduction == "none" else np.sum(token) / den
    ent = ref64.outputs(z, y, reduction="none", opts=plain).entropy
    entropy = ent.reshape(np.shape(labels)) if reduction == "none" else np.sum(ent) / den_h
    grad_z = r.grad
    if g_h is not None:
        p = np.exp(z - r.lse[:, None])
        mz = np.sum(p * z, axis=-1, keepdims=True)
        grad_z = grad_z + np.where(ignored[:, None], 0.0, g_h[:, None] * p * (mz - z))
    g = grad_z * dz_dx
    dh = (g @ w).reshape(hidden.shape)
    return loss, entropy, dh, g.T @ h, None if bias is None else g.sum(axis=0)


def run(put, hidden, weight, labels, *, bias=None, reduction="mean", g_loss=1.0, g_entropy=None, **kw):
    """value and gradients (hidden, weight, bias) of g_loss * loss (+ g_entropy * entropy) through the kernels."""
    y = put(labels, jnp.int32)
    entropy_out = g_entropy is not None

    def f(h, w, b):
        out = linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, backend="kernel", chunk_rows=kw.pop("chunk_rows", ROWS),
            return_entropy=entropy_out, **kw,
        )  # fmt: skip
        loss = out.loss if entropy_out else out
        total = jnp.sum(loss * g_loss)
        if entropy_out:
            total = total + jnp.sum(out.entropy * g_entropy)
        return total, out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(hidden, weight, bias)
    return out, grads


def compare(out, grads, want, *, entropy=False, grad_rtol=2e-4, loss_tol=LOSS_TOL):
    loss = out.loss if entropy else out
    assert_close(loss, want[0], what="loss", **loss_tol)
    if entropy:
        assert_close(out.entropy, want[1], what="entropy", **loss_tol)
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), grads, want[2:]):
        if ref is None:
            continue
        assert_close(got, ref, what=name, **grad_tol(ref, grad_rtol))


def dot_generals(fn, *args):
    """(operand dtypes, output dtype, output shape) of every dot_general in fn's jaxpr (nested ones included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(
                    (tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype),
                     tuple(eqn.outvars[0].aval.shape))
                )  # fmt: skip
            for param in eqn.params.values():
                for inner in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(inner, "jaxpr") and hasattr(inner.jaxpr, "eqns"):
                        walk(inner.jaxpr)
                    elif hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
