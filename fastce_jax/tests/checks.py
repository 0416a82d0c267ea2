"""fastce_jax's results against the repository's float64 reference, with its one tolerance model
(shared_tests/reference.py, shared_tests/tolerances.py). The same names as fastce_torch/tests/checks.py."""

import jax.numpy as jnp
import numpy as np

from shared_tests import tolerances
from shared_tests.reference import Options, cross_entropy


def as_float64(array):
    """The values an array holds (bf16 / fp16 / fp32 are exact in float64), on the host."""
    return np.asarray(jnp.asarray(array).astype(jnp.float32), np.float64)


def expected(logits, labels, reduction="none", n_items=None, upstream=None, **options):
    """The float64 reference on exactly the values the kernels read (logits already rounded to their dtype)."""
    if upstream is not None:
        upstream = np.asarray(upstream, np.float64)
    return cross_entropy(
        as_float64(logits),
        np.asarray(labels),
        reduction=reduction,
        n_items=n_items,
        upstream=upstream,
        opts=Options(**options),
    )


def assert_loss(loss, ref, what="loss"):
    assert loss.dtype == jnp.float32, f"{what}: dtype {loss.dtype}"
    return tolerances.assert_loss(as_float64(loss), ref, what)


def assert_grad(grad, ref, what="grad"):
    """The gradient against the reference, in ulps of its own dtype."""
    return tolerances.assert_grad(as_float64(grad), ref, grad.dtype, what)
