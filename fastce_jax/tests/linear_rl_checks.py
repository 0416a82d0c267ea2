"""Helpers of the fused linear loss's RL tests (test_linear_rl.py, test_linear_rl_entropy.py): the float64
expectation of temperature, token weights and the entropy's gradient (shared_tests/reference.py: head_logits,
differentiated, chain_through_head), the kernel path's value and gradients, and the matmuls a traced call runs.
"""

import jax
import jax.numpy as jnp
import numpy as np

from fastce_jax import linear_cross_entropy
from shared_tests import reference as ref64

from .checks import as_float64
from .test_linear_cross_entropy import LOSS_TOL, ROWS, assert_close, grad_tol


def expected(
    hidden, weight, labels, *, bias=None, reduction="mean", n_items=None, temperature=1.0, token_weights=None,
    class_weight=None, g_loss=1.0, g_entropy=None, **opts,
):  # fmt: skip
    """float64 (loss, entropy output, d hidden, d weight, d bias) of g_loss * loss + g_entropy * entropy (both
    scalars for "mean" / "sum", per-token arrays for "none"; g_entropy None: the loss alone)."""
    logits, _, h, w, b, lead = ref64.head_logits(
        as_float64(hidden), as_float64(weight), None if bias is None else as_float64(bias)
    )
    y = np.asarray(labels).reshape(-1).astype(np.int64)

    def flat(values):
        return None if values is None else np.asarray(values, np.float64).reshape(-1)

    per_token = reduction == "none"
    cotangents = (g_loss, 0.0, 0.0 if g_entropy is None else g_entropy)
    ref = ref64.differentiated(
        logits, y, reduction=reduction, n_items=n_items, opts=ref64.Options(temperature=temperature, **opts),
        weight=flat(class_weight), token_weights=flat(token_weights),
        upstream=tuple(flat(g) if per_token and np.ndim(g) else float(g) for g in cotangents),
    )  # fmt: skip
    shape = np.shape(labels)
    loss, entropy = (v.reshape(shape) if per_token else v for v in (ref.loss.loss, ref.entropy.loss))
    return (loss, entropy, *ref64.chain_through_head(ref.loss.grad, h, w, b, lead))


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
