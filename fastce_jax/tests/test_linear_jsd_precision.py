"""fastce_jax.linear_jsd's precision keywords (linear_cross_entropy's, the same meaning) against the float64
reference (shared_tests/reference_distill.py) on the bf16 inputs themselves (as fastce_torch's
test_linear_jsd_precision.py):
- logits_dtype="float32": both models' logits stay float32. The JSD gradient p_s - p_t is a difference of nearly
  equal numbers, so logits rounded to bf16 move it by percents at a realistic logit spread (randn weights scaled to
  a logit std of 10, as Liger-Kernel 0.8.5's test_logits_projection_is_not_rounded_to_input_dtype). The bf16-logits
  run is asserted clearly worse, so the test fails if the keyword were ignored.
- accumulate_in_float32=True over many chunks: the weight gradient summed in float32 and rounded once.
The argument checks are in test_linear_jsd.py's BAD_LINEAR. Compile time is the cost on the CPU: one beta (the mixture).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import linear_jsd
from shared_tests.distill_precision import check_float32_accumulation, check_float32_logits
from shared_tests.reference_distill import linear_jsd as linear_jsd_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LOGIT_STD = 10.0


def spread_inputs(n=16, width=64, vocab=256, seed=0, std=LOGIT_STD):
    """bf16 (student hidden, weight, teacher hidden, weight) with logits of standard deviation about std."""
    rng = np.random.default_rng(seed)
    tensors = [
        rng.standard_normal((n, width)),
        rng.standard_normal((vocab, width)) * (std / width**0.5),
        rng.standard_normal((n, width)),
        rng.standard_normal((vocab, width)) * (std / width**0.5),
    ]
    return [jnp.asarray(t, jnp.bfloat16) for t in tensors]


def student_grads(inputs, **keywords):
    h_s, w_s, h_t, w_t = inputs

    def loss(hidden, weight):
        return linear_jsd(hidden, weight, h_t, w_t, backend="kernel", **keywords)

    grads = jax.grad(loss, argnums=(0, 1))(h_s, w_s)
    for grad in grads:
        assert grad.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(grad)))
    return [np.asarray(grad, np.float64) for grad in grads]


def exact(inputs, **options):
    return linear_jsd_reference(*(np.asarray(t, np.float64) for t in inputs), None, **options)


def test_float32_logits_keep_the_gradient():
    """Measured on the CPU (N=16, H=64, V=256, std 10, beta 0 / 0.5 / 1): max relative error of d hidden and d weight
    2.0-4.3e-3 with float32 logits, 1.2-2.6e-2 with bf16 logits (2.7-12x worse)."""
    inputs = spread_inputs()
    want = exact(inputs, beta=0.5)
    grads = {dtype: student_grads(inputs, beta=0.5, logits_dtype=dtype) for dtype in (None, "float32")}
    check_float32_logits(grads["float32"], grads[None], want)


def test_accumulate_in_float32_over_many_chunks():
    """16 chunks of one row (float32 logits: 4 + 4 bytes a column of a row): the float32 accumulator rounds d weight
    once, so it matches one chunk's product (one rounding) to within a bf16 ulp and the float64 reference to the
    products' rounding; the default rounds every chunk (distill_precision.check_float32_accumulation)."""
    inputs = spread_inputs(n=16, width=32, vocab=64, seed=1, std=4.0)
    options = dict(beta=0.0, reduction="sum", logits_dtype="float32")
    one_chunk = student_grads(inputs, **options)[1]
    chunks = dict(workspace_bytes=64 * 8, **options)
    accumulated = student_grads(inputs, accumulate_in_float32=True, **chunks)[1]
    want = exact(inputs, beta=0.0, reduction="sum").grad_weight
    check_float32_accumulation(one_chunk, accumulated, want)
