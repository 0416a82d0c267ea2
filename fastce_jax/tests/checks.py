"""fastce_jax's results against the repository's float64 reference, with its one tolerance model: the logic is
shared_tests' (reference.expected, tolerances.assert_loss / assert_grad); this module only turns arrays into host
float64 arrays. The same names as fastce_torch/tests/checks.py."""

import jax.numpy as jnp
import numpy as np

from shared_tests import reference, tolerances

# The option sets the kernel and fused linear tests run (each a set of cross_entropy keywords).
OPTION_SETS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcapping=4.0),
    "scaling": dict(logit_scaling=0.5),
    "ignore5": dict(ignore_index=5),
    "all": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcapping=7.0, logit_scaling=1.3),
}


def as_float64(array):
    """The values an array holds (bf16 / fp16 / fp32 are exact in float64), on the host."""
    return np.asarray(jnp.asarray(array).astype(jnp.float32), np.float64)


def expected(logits, labels, reduction="none", n_items=None, upstream=None, **options):
    """The float64 reference on exactly the values the kernels read (logits already rounded to their dtype)."""
    upstream = None if upstream is None else np.asarray(upstream, np.float64)
    return reference.expected(as_float64(logits), np.asarray(labels), reduction, n_items, upstream, **options)


def assert_loss(loss, ref, what="loss"):
    return tolerances.assert_loss(as_float64(loss), ref, what, dtype=loss.dtype)


def assert_grad(grad, ref, what="grad"):
    """The gradient against the reference, in ulps of its own dtype."""
    return tolerances.assert_grad(as_float64(grad), ref, grad.dtype, what)
